"""Prefilled prompts join the decode batch a step sooner, with the same tokens."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_serve.failpoints import FailPoints
from mlx_serve.runner import BatchLimits, load_runner
from mlx_serve.runner.decode_step import use_one_array_step
from mlx_serve.runner.early_split import use_early_split


def _prompts(first: int, count: int) -> list[list[int]]:
    return [[(first + i) * 13 % 200 + j + 1 for j in range(5 + 3 * i)] for i in range(count)]


def _generate(model, early: bool) -> tuple[dict[int, list[int]], dict[int, list], dict[int, int]]:
    """Two waves of greedy sequences (some with a repetition penalty) of different
    lengths, the second joining a running batch. Per uid: its tokens, its logprob rows
    and the call that returned its first token."""
    gen = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=4,
                         prefill_step_size=8)  # the longer prompts take two chunks
    assert use_one_array_step(gen)
    if early:
        assert use_early_split(gen)
    tokens: dict[int, list[int]] = {}
    rows: dict[int, list] = {}
    first: dict[int, int] = {}

    def insert(start: int, count: int) -> None:
        gen.insert(_prompts(start, count), max_tokens=[4 + 2 * i for i in range(count)],
                   samplers=[make_sampler(temp=0.0)] * count,
                   logits_processors=[make_logits_processors(repetition_penalty=1.3)
                                      if i % 2 else [] for i in range(count)],
                   stop_sequences=[StopSequences([])] * count)

    try:
        insert(0, 6)
        for call in range(60):
            if call == 3:
                insert(6, 5)
            _, responses = gen.next()
            for r in responses:
                first.setdefault(r.uid, call)
                tokens.setdefault(r.uid, []).append(r.token)
                rows.setdefault(r.uid, []).append(np.array(r.logprobs))
    finally:
        gen.close()
    return tokens, rows, first


def test_early_join_gives_every_sequence_the_same_tokens_sooner(tiny_model_dir: Path):
    model, _ = load(str(tiny_model_dir))
    stock_tokens, stock_rows, stock_first = _generate(model, early=False)
    tokens, rows, first = _generate(model, early=True)
    assert len(stock_tokens) == 11  # every sequence finished in both
    assert tokens == stock_tokens
    for uid, uid_rows in rows.items():
        for a, b in zip(uid_rows, stock_rows[uid], strict=True):
            np.testing.assert_array_equal(a, b)
    # No sequence's first token came later, and most came a step sooner.
    assert all(first[uid] <= stock_first[uid] for uid in first)
    assert sum(first[uid] < stock_first[uid] for uid in first) >= 6


def test_a_lone_prompt_gets_its_first_token_in_the_second_call_not_the_third(tiny_model_dir):
    model, _ = load(str(tiny_model_dir))
    for early, expected in ((False, 2), (True, 1)):
        gen = BatchGenerator(model)
        if early:
            use_early_split(gen)
        try:
            gen.insert([[1, 2, 3, 4, 5]], max_tokens=[3])
            calls = [bool(gen.next()[1]) for _ in range(4)]
        finally:
            gen.close()
        assert calls.index(True) == expected, (early, calls)


def test_mlx_lms_own_schedule_stays_with_a_release_it_does_not_mirror(tiny_model_dir,
                                                                      monkeypatch):
    model, _ = load(str(tiny_model_dir))
    gen = BatchGenerator(model)
    try:
        monkeypatch.setattr(mlx_lm, "__version__", "0.99.0")
        assert not use_early_split(gen)
        assert "_next" not in vars(gen)
    finally:
        gen.close()


@pytest.mark.parametrize("on", [True, False])
def test_the_runner_joins_early_only_when_asked_and_after_rebuilds(tiny_model_dir: Path,
                                                                  on: bool):
    runner = load_runner(str(tiny_model_dir), limits=BatchLimits(),
                         failpoints=FailPoints.from_spec(None), early_decode_join=on)
    try:
        for _ in range(2):
            assert ("_next" in vars(runner._batch)) is on
            runner.rebuild()
    finally:
        runner.close()


def test_the_engine_harness_can_step_on_the_same_schedule(tiny_model_dir: Path):
    from benchmarks.engine_limit import BatchSettings, EngineHarness
    from benchmarks.engine_worker import harness_command
    from benchmarks.servers import BatchConfig

    model, tokenizer = load(str(tiny_model_dir))
    for early in (False, True):
        harness = EngineHarness(model, tokenizer, BatchSettings(early_decode_join=early))
        gen = harness._generator()
        try:
            assert ("_next" in vars(gen)) is early  # mlx-lm's schedule unless asked
        finally:
            gen.close()
    command = harness_command("m", BatchConfig(8, 8, 512), False, early_decode_join=True)
    assert "--early-decode-join" in command


def test_the_engine_harness_takes_first_tokens_where_the_server_sends_them(tiny_model_dir):
    from benchmarks.engine_limit import BatchSettings, EngineHarness
    from benchmarks.workload import Workload

    model, tokenizer = load(str(tiny_model_dir))
    harness = EngineHarness(model, tokenizer, BatchSettings(early_decode_join=True))
    gen = harness._generator()
    try:
        uids = gen.insert(_prompts(0, 3), max_tokens=[8] * 3)
        _, responses = gen.next()  # prefills them and moves them into decoding
        ahead = harness._first_tokens_ahead(gen, responses, lambda uid: 8)
        assert sorted(r.uid for r in ahead) == sorted(uids)
        _, responses = gen.next()  # hands the same tokens back: dropped
        assert {r.uid: r.token for r in responses} == {r.uid: r.token for r in ahead}
        assert harness._first_tokens_ahead(gen, responses, lambda uid: 8) == []
    finally:
        gen.close()
    # Whole runs count the same tokens on either schedule.
    workload = Workload(16, 8, num_requests=6, concurrency=3, time_limit=60.0)
    prompts = _prompts(0, 6)
    totals = [EngineHarness(model, tokenizer, BatchSettings(early_decode_join=early))
              .run(prompts, workload) for early in (False, True)]
    assert [(t["completed"], t["output_tokens"]) for t in totals] == \
        [(6, totals[0]["output_tokens"])] * 2
