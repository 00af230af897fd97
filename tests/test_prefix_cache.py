"""Prompt prefix caching: reuse is reported, bounded, and never changes the output."""

from __future__ import annotations

import pytest

from mlx_serve.generation import OutputOptions
from tests.conftest import running_engine
from tests.engine_helpers import drain, generate, generate_all, make_request

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


def conversation(tokenizer, turns: int) -> list[list[int]]:
    """Prompts of a growing conversation: each one extends the previous prefix."""
    messages = [{"role": "system", "content": SYSTEM}]
    prompts = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question number {i}?"})
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        messages.append({"role": "assistant", "content": f"Answer number {i}."})
    return prompts


async def run_conversation(model_dir, cache_bytes: int) -> list:
    async with running_engine(model_dir, prefix_cache_bytes=cache_bytes) as engine:
        prompts = conversation(engine.runner.tokenizer, 3)
        results = [await generate(engine, p, max_tokens=10) for p in prompts]
        assert engine.runner.prefix_cache.nbytes <= max(cache_bytes, 0)
        return results


async def test_shared_prefixes_are_reused_and_outputs_do_not_change(tiny_model_dir):
    cold = await run_conversation(tiny_model_dir, 0)
    warm = await run_conversation(tiny_model_dir, 64 << 20)
    assert [r.text for r in warm] == [r.text for r in cold]
    assert [r.cached_tokens for r in cold] == [0, 0, 0]
    assert warm[0].cached_tokens == 0
    assert all(r.cached_tokens > 40 for r in warm[1:])  # at least the system prompt


async def test_the_byte_budget_bounds_the_cache(tiny_model_dir):
    async with running_engine(tiny_model_dir, prefix_cache_bytes=200_000) as engine:
        for p in conversation(engine.runner.tokenizer, 4):
            await generate(engine, p, max_tokens=40)
            assert 0 < engine.runner.prefix_cache.nbytes <= 200_000


async def test_choices_of_one_prompt_share_its_prefill(tiny_model_dir):
    async def choices(cache_bytes: int):
        async with running_engine(tiny_model_dir, prefix_cache_bytes=cache_bytes) as engine:
            prompt = conversation(engine.runner.tokenizer, 1)[0]
            reqs = [make_request(prompt, max_tokens=8, temperature=0.8, seed=10 + i)
                    for i in range(4)]
            reqs = [r.__class__(r.request_id, r.prompt_tokens, r.params, None, i,
                                OutputOptions()) for i, r in enumerate(reqs)]
            handle = engine.submit(*reqs)
            texts: dict[int, str] = {}
            cached: dict[int, int] = {}
            async with handle:
                async for event in handle:
                    texts[event.index] = texts.get(event.index, "") + event.text
                    if event.finish_reason is not None:
                        cached[event.index] = event.cached_tokens
            return texts, cached, len(prompt)

    plain_texts, plain_cached, _ = await choices(0)
    shared_texts, shared_cached, prompt_len = await choices(64 << 20)
    assert shared_texts == plain_texts
    assert set(plain_cached.values()) == {0}
    assert shared_cached[0] == 0
    assert all(shared_cached[i] == prompt_len - 1 for i in (1, 2, 3))


async def test_replay_after_a_fault_is_exact_with_the_cache_on(tiny_model_dir):
    async with running_engine(tiny_model_dir, prefix_cache_bytes=64 << 20) as engine:
        prompts = conversation(engine.runner.tokenizer, 3)
        clean = await generate_all(engine, [make_request(p, max_tokens=12) for p in prompts])
    spec = "engine.step=6*off->2*raise(RuntimeError:boom)"
    async with running_engine(tiny_model_dir, failpoints=spec,
                              prefix_cache_bytes=64 << 20) as engine:
        handles = [engine.submit(make_request(p, max_tokens=12)) for p in prompts]
        faulty = [await drain(h) for h in handles]
        assert engine.statistics().recoveries >= 1
    assert [r.text for r in faulty] == [r.text for r in clean]


def test_the_trie_search_agrees_with_mlx_lm_and_finds_a_sibling_branch():
    import random

    from mlx_lm.models.cache import PromptTrie

    from mlx_serve.runner.prefix_cache import _LinearPromptTrie

    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(30)]
    stored = [system + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
              for _ in range(50)]
    ours, theirs = _LinearPromptTrie(), PromptTrie()
    for i, tokens in enumerate(stored):
        ours.add("m", tokens, i)
        theirs.add("m", tokens, i)
    queries = (stored[:5] + [s[:20] for s in stored[:5]] + [s + [7, 8] for s in stored[:5]]
               + [system + [rng.randrange(1000) for _ in range(20)] for _ in range(5)]
               + [[], [1001, 1002]])
    for query in queries:
        a, b = ours.search("m", query), theirs.search("m", query)
        assert (a.exact, a.shorter, a.common_prefix) == (b.exact, b.shorter, b.common_prefix)
        assert (a.longer is None) == (b.longer is None)
        if a.longer is not None:  # any stored sequence through the common prefix serves
            assert a.longer in stored
            assert a.longer[:a.common_prefix] == query[:a.common_prefix]


async def test_a_new_conversation_reuses_the_shared_system_prompt(tiny_model_dir):
    async with running_engine(tiny_model_dir, prefix_cache_bytes=64 << 20) as engine:
        tokenizer = engine.runner.tokenizer
        def prompt(question: str) -> list[int]:
            return tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                add_generation_prompt=True)
        first, second = prompt("What is a cat?"), prompt("Where is the sea?")
        common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False))
                      if a != b)
        await generate(engine, first, max_tokens=4)
        again = await generate(engine, second, max_tokens=4)
        assert 0 < again.cached_tokens <= common
        assert again.cached_tokens >= common - 1
