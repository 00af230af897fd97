"""Short and long replies interleaved in one benchmark run: the same per-request lengths
for the load generator, the engine harness and every tool that passes the flags on."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm import load

from benchmarks.loadgen import Target, run_load
from benchmarks.workload import Workload, build_prompts, load_tokenizer

pytestmark = pytest.mark.anyio

MIXED = Workload(prompt_tokens=16, output_tokens=3, num_requests=8, concurrency=4, seed=2,
                 time_limit=60.0, long_output_tokens=12, long_fraction=0.25)


def test_a_seeded_share_of_the_requests_is_long():
    lengths = MIXED.output_lengths()
    assert sorted(lengths) == [3] * 6 + [12] * 2
    assert MIXED.output_lengths() == lengths  # the same for every contender
    other_places = [Workload(num_requests=40, seed=s, long_output_tokens=9).output_lengths()
                    for s in range(4)]
    assert len({tuple(p) for p in other_places}) > 1  # the seed picks the places
    assert all(p.count(9) == 10 for p in other_places)
    assert Workload(output_tokens=5, num_requests=3).output_lengths() == [5, 5, 5]
    assert Workload(num_requests=4, long_output_tokens=7, long_fraction=1.0
                    ).output_lengths() == [7] * 4


@pytest.mark.parametrize("bad", [dict(long_fraction=1.5), dict(long_fraction=-0.1),
                                 dict(long_output_tokens=0), dict(output_tokens=0)])
def test_a_mix_that_cannot_be_run_is_refused(bad):
    with pytest.raises(ValueError):
        Workload(**bad)


def test_the_tools_pass_the_mix_on():
    from benchmarks import ab, engine_limit, env_ab, loadgen
    from benchmarks.engine_worker import workload_flags

    mix = ["--long-output-tokens", "40", "--long-fraction", "0.5"]
    config = ab.config_from_args(ab.build_parser().parse_args(mix))
    assert config.workload(4, seed=1).output_lengths().count(40) == 8  # 16 requests
    env_args = env_ab.build_parser().parse_args(["--variant", "-", "--variant", "-", *mix])
    assert env_ab._workload(env_args, 4, 1).long_output_tokens == 40
    # The engine worker hands a workload to engine_limit as flags: it arrives whole.
    flags = workload_flags(config.workload(4, seed=1))
    parsed = engine_limit.build_parser().parse_args(["--model", "m", *flags])
    assert (parsed.long_output_tokens, parsed.long_fraction) == (40, 0.5)
    assert "--long-output-tokens" not in workload_flags(Workload())
    gen_args = loadgen.build_parser().parse_args(["--base-url", "u", "--tokenizer", "t", *mix])
    assert (gen_args.long_output_tokens, gen_args.long_fraction) == (40, 0.5)


def test_the_engine_harness_gives_each_request_its_own_length(tiny_model_dir: Path):
    from benchmarks.engine_limit import BatchSettings, EngineHarness

    model, tokenizer = load(str(tiny_model_dir))
    prompts = [list(tokenizer.encode(p)) for p in
               build_prompts(tokenizer, MIXED.num_requests, MIXED.prompt_tokens, seed=4)]
    for early in (False, True):
        summary = EngineHarness(model, tokenizer, BatchSettings(early_decode_join=early)
                                ).run(prompts, MIXED)
        assert (summary["completed"], summary["failed"]) == (8, 0)
        assert _long_replies_ran_past_the_short_limit(summary)


async def test_the_load_generator_asks_each_request_for_its_own_length(tiny_server,
                                                                      tiny_model_dir):
    prompts = build_prompts(load_tokenizer(str(tiny_model_dir)), MIXED.num_requests,
                            MIXED.prompt_tokens, seed=4)
    summary = (await run_load(Target(tiny_server.base_url, request_timeout=30.0), MIXED,
                              prompts))["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert _long_replies_ran_past_the_short_limit(summary)


def _long_replies_ran_past_the_short_limit(summary: dict) -> bool:
    """More tokens than eight short replies hold, no more than the mix allows (6 x 3 +
    2 x 12). A reply may end sooner: the random model samples its end-of-sequence now
    and then."""
    return 8 * 3 < summary["output_tokens"] <= sum(MIXED.output_lengths()) == 42
