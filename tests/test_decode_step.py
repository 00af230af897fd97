"""The one-array decode step produces exactly what mlx-lm's own step produces."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_serve.failpoints import FailPoints
from mlx_serve.runner import BatchLimits, load_runner
from mlx_serve.runner.decode_step import one_array_step, use_one_array_step


def _record_generation(model, one_array: bool) -> list[tuple[int, int, np.ndarray]]:
    """Two waves of sequences with greedy, seeded and penalised sampling, of different
    lengths (so the batch is extended and filtered); every (uid, token, logprobs row)."""
    mx.random.seed(7)
    gen = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=4)
    if one_array:
        assert use_one_array_step(gen)
    no_stop = StopSequences([])

    def insert(first: int, count: int) -> None:
        prompts = [[(first + i) * 13 % 200 + j + 1 for j in range(5 + 3 * i)]
                   for i in range(count)]
        samplers = [make_sampler(temp=0.0) if i % 3 == 0 else make_sampler(temp=0.9, top_p=0.9)
                    for i in range(count)]
        processors = [make_logits_processors(repetition_penalty=1.3) if i % 2 else []
                      for i in range(count)]
        gen.insert(prompts, max_tokens=[4 + 2 * i for i in range(count)], samplers=samplers,
                   logits_processors=processors, stop_sequences=[no_stop] * count)

    seen = []
    try:
        insert(0, 6)
        for step in range(40):
            if step == 3:
                insert(6, 5)  # joins a running batch: extend
            _, responses = gen.next()
            for r in responses:
                seen.append((r.uid, r.token, np.array(r.logprobs)))
    finally:
        gen.close()
    return seen


def test_one_array_step_matches_mlx_lm_step_token_for_token_and_logprob_for_logprob(
    tiny_model_dir: Path,
):
    model, _ = load(str(tiny_model_dir))
    stock = _record_generation(model, one_array=False)
    ours = _record_generation(model, one_array=True)
    assert len(stock) == sum(4 + 2 * i for i in range(6)) + sum(4 + 2 * i for i in range(5))
    assert [(uid, token) for uid, token, _ in ours] == [(uid, token) for uid, token, _ in stock]
    for (_, _, a), (_, _, b) in zip(ours, stock, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_stock_step_stays_with_an_mlx_lm_it_does_not_mirror(tiny_model_dir, monkeypatch):
    model, _ = load(str(tiny_model_dir))
    gen = BatchGenerator(model)
    try:
        monkeypatch.setattr(mlx_lm, "__version__", "0.99.0")
        assert not use_one_array_step(gen)
        assert "_step" not in vars(gen._generation_batch)
    finally:
        gen.close()


@pytest.mark.parametrize("on", [True, False])
def test_the_runner_steps_with_the_one_array_step_only_when_asked_and_after_rebuilds(
    tiny_model_dir: Path, on: bool,
):
    runner = load_runner(str(tiny_model_dir), limits=BatchLimits(),
                         failpoints=FailPoints.from_spec(None), one_array_logprobs=on)
    try:
        for _ in range(2):
            step = vars(runner._batch._generation_batch).get("_step")
            assert (step is not None and step.__func__ is one_array_step) is on
            runner.rebuild()
    finally:
        runner.close()
