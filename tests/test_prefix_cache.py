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


@pytest.mark.parametrize("seed", range(4))
def test_the_radix_trie_answers_as_mlx_lm_s_trie_does(seed):
    """Random adds, pops, prefix pops and searches on both tries give the same answers
    (``longer`` may be any stored sequence through the common prefix)."""
    import random

    from mlx_lm.models.cache import PromptTrie

    from mlx_serve.runner.prompt_trie import RadixPromptTrie

    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(12)]

    def sequence() -> list[int]:
        head = system[:rng.randrange(len(system) + 1)] if rng.random() < 0.8 else []
        return head + [rng.randrange(50) for _ in range(rng.randrange(0 if head else 1, 15))]

    ours, theirs = RadixPromptTrie(), PromptTrie()
    stored: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not stored:
            tokens = sequence()
            assert ours.add("m", tokens, step) == theirs.add("m", tokens, step)
            if tokens not in stored:
                stored.append(tokens)
        elif op < 0.6:
            tokens = stored.pop(rng.randrange(len(stored)))
            assert ours.pop("m", tokens) == theirs.pop("m", tokens)
        elif op < 0.65:
            tokens = rng.choice(stored)
            popped = theirs.pop_prefixes("m", tokens)
            assert ours.pop_prefixes("m", tokens) == popped
            for length, _ in popped:
                stored.remove(tokens[:length])
        else:
            query = rng.choice([sequence(), rng.choice(stored) + [rng.randrange(50)],
                                rng.choice(stored)[:rng.randrange(1, 20)]])
            a, b = ours.search("m", query), theirs.search("m", query)
            assert (a.exact, a.shorter, a.common_prefix) == (b.exact, b.shorter, b.common_prefix)
            assert (a.longer is None) == (b.longer is None)
            if a.longer is not None:
                assert a.longer in stored and a.longer[:a.common_prefix] == query[:a.common_prefix]
                assert ours.get("m", a.longer) == theirs.get("m", a.longer)
        for tokens in rng.sample(stored, min(3, len(stored))):
            assert ours.get("m", tokens) == theirs.get("m", tokens)


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


async def test_a_shared_prefix_shorter_than_the_minimum_is_not_reused(tiny_model_dir):
    from mlx_serve.runner.prefix_cache import MIN_REUSED_TOKENS

    async with running_engine(tiny_model_dir, prefix_cache_bytes=64 << 20) as engine:
        first = [5 + i for i in range(48)]
        await generate(engine, first, max_tokens=4)
        # Unrelated prompts often share a token or two: no copy of the entry for those.
        short = first[:MIN_REUSED_TOKENS - 1] + [200 + i for i in range(33)]
        assert (await generate(engine, short, max_tokens=4)).cached_tokens == 0
        enough = first[:MIN_REUSED_TOKENS + 4] + [300 + i for i in range(28)]
        assert (await generate(engine, enough, max_tokens=4)).cached_tokens == MIN_REUSED_TOKENS + 4
