"""A newcomer's first token goes out in the step that prefilled it, with the same replies."""

from __future__ import annotations

import itertools
from pathlib import Path

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
from mlx_serve.runner import BatchLimits, load_runner
from mlx_serve.runner.early_split import take_first_tokens, use_early_split

_ids = itertools.count()


def _prompt(i: int) -> tuple[int, ...]:
    return tuple((i * 37 + j * 11) % 400 + 3 for j in range(6 + i % 5))


def _request(prompt: tuple[int, ...], max_tokens: int = 8, logprobs: int | None = None,
             **params: object) -> GenerationRequest:
    return GenerationRequest(f"r{next(_ids)}", prompt,
                             SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                             output=OutputOptions(logprobs=logprobs))


def _serve(model_dir: Path, waves: list[list[GenerationRequest]], early: bool,
           prefix_cache_bytes: int = 0) -> tuple[dict[int, tuple], dict[int, int]]:
    """Run waves of requests (wave k admitted at step 3k) to the end. Per request's
    position: (text, tokens, finish, logprobs count, prompt tokens reused from the prefix
    cache), and the step of its first delta."""
    runner = load_runner(str(model_dir), limits=BatchLimits(decode_batch_size=8,
                                                            prefill_batch_size=4),
                         failpoints=FailPoints.from_spec(None), early_decode_join=early,
                         prefix_cache_bytes=prefix_cache_bytes)
    position = {r.request_id: i for i, r in enumerate(itertools.chain(*waves))}
    replies: dict[int, list] = {}
    first: dict[int, int] = {}
    try:
        for step in range(80):
            admissions = waves[step // 3] if step % 3 == 0 and step // 3 < len(waves) else []
            outcome = runner.step(admissions, [])
            assert not outcome.failed and outcome.error is None
            for rid, delta in outcome.deltas:
                first.setdefault(position[rid], step)
                replies.setdefault(position[rid], []).append(delta)
            if step >= 3 * len(waves) and not runner.live_ids():
                break
    finally:
        runner.close()
    summary = {i: ("".join(d.text for d in ds), sum(d.token_count for d in ds),
                   ds[-1].finish_reason, sum(len(d.logprobs) for d in ds),
                   ds[-1].cached_tokens)
               for i, ds in replies.items()}
    return summary, first


def _first_greedy_token(model, prompt: tuple[int, ...]) -> int:
    gen = BatchGenerator(model)
    try:
        gen.insert([list(prompt)], max_tokens=[1])
        for _ in range(5):
            responses = gen.next()[1]
            if responses:
                return responses[0].token
    finally:
        gen.close()
    raise AssertionError("no first token in 5 calls")


def test_a_lone_request_gets_its_first_token_from_the_step_that_prefilled_it(
        tiny_model_dir: Path):
    request = [[_request(_prompt(0))]]
    stock, stock_first = _serve(tiny_model_dir, request, early=False)
    ahead, ahead_first = _serve(tiny_model_dir, request, early=True)
    assert ahead == stock
    assert stock_first[0] == 2  # mlx-lm: prefill, move into decoding, first token
    assert ahead_first[0] == 0


def test_replies_are_the_same_when_first_tokens_go_out_ahead(tiny_model_dir: Path):
    """Plain requests, the ones whose first token may not go out ahead (a stop token,
    the last token allowed, logprobs asked for) and one whose first token ends it with a
    stop string, in waves joining a running batch, against mlx-lm's schedule."""
    model, _ = load(str(tiny_model_dir))
    stop_first = _first_greedy_token(model, _prompt(3))

    def waves() -> list[list[GenerationRequest]]:
        return [
            [_request(_prompt(0)), _request(_prompt(1), max_tokens=1),
             _request(_prompt(2), logprobs=2)],
            [_request(_prompt(3), stop_token_ids=(stop_first,)), _request(_prompt(4), 12),
             _request(_prompt(5), 3), _request(_prompt(6))],
            [_request(_prompt(7), 5), _request(_prompt(8), 2),
             _request(_prompt(0), stop=("an",))],
        ]

    stock, stock_first = _serve(tiny_model_dir, waves(), early=False)
    ahead, ahead_first = _serve(tiny_model_dir, waves(), early=True)
    assert ahead == stock
    assert stock[3] == ("", 1, "stop", 0, 0)  # its first token was its stop token (counted)
    assert stock[2][3] == stock[2][1] > 0  # one logprobs entry per token
    assert stock[9] == ("", 1, "stop", 0, 0)  # "an", its first token's text, is a stop string
    # Every sequence joins decoding a step sooner (the early join); the first tokens
    # that may go out ahead came a step sooner still.
    sooner = {i: stock_first[i] - ahead_first[i] for i in stock_first}
    assert sooner == {0: 2, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2}


def test_first_tokens_are_the_ones_the_next_call_hands_back(tiny_model_dir: Path):
    model, _ = load(str(tiny_model_dir))
    gen = BatchGenerator(model, prefill_batch_size=4)
    assert use_early_split(gen)
    try:
        assert take_first_tokens(gen) == {}  # nothing moved yet
        uids = gen.insert([list(_prompt(i)) for i in range(3)], max_tokens=[4] * 3)
        gen.next()
        ahead = take_first_tokens(gen)
        assert sorted(ahead) == sorted(uids)
        assert take_first_tokens(gen) == {}  # taken once
        handed_back = {r.uid: r.token for r in gen.next()[1]}
        assert handed_back == ahead
    finally:
        gen.close()


def test_choices_sharing_a_prompt_get_the_same_replies(tiny_model_dir: Path):
    """With the prefix cache on, later choices of one prompt wait for the first one's
    prefill and start from its KV: their moves, and first tokens, come later."""
    def waves() -> list[list[GenerationRequest]]:
        shared = _prompt(1) * 3  # long enough to be reused (16 tokens or more)
        return [[_request(shared, 6), _request(shared, 6), _request(_prompt(2), 6)],
                [_request(shared, 4), _request(_prompt(2), 5)]]

    stock, _ = _serve(tiny_model_dir, waves(), early=False, prefix_cache_bytes=1 << 26)
    ahead, _ = _serve(tiny_model_dir, waves(), early=True, prefix_cache_bytes=1 << 26)
    assert ahead == stock
    assert stock[0][:4] == stock[1][:4] and stock[0][1] == 6
    assert stock[0][4] == 0 and stock[1][4] > 0 and stock[3][4] > 0  # reused the first's KV
