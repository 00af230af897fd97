"""The actor on the tiny model: batching, cancellation, back-pressure, actor death."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace

import anyio
import mlx.core as mx
import pytest

from mlx_serve.engine import EngineConfig, EngineState
from mlx_serve.errors import EngineDeadError, OverloadedError, RequestError, ShuttingDownError
from mlx_serve.generation import Failure, GenerationRequest
from tests.conftest import running_engine
from tests.engine_helpers import (
    drain,
    generate,
    generate_all,
    make_request,
    prompts,
    record_runner_steps,
    step_hanging,
)

pytestmark = pytest.mark.anyio


async def wait_until(predicate, timeout: float = 10.0) -> None:
    """Re-check a condition on every event-loop turn, bounded by ``timeout``."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def test_concurrent_requests_finish_with_exact_token_counts(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        ps = prompts(engine, 12)
        reqs = [make_request(p, max_tokens=3 + i) for i, p in enumerate(ps)]
        results = await generate_all(engine, reqs)
        assert [r.tokens for r in results] == [3 + i for i in range(12)]
        assert all(r.finish == "length" and r.error is None for r in results)
        assert engine.statistics().running == 0


async def test_batched_output_equals_solo_output_at_temperature_zero(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        ps = prompts(engine, 6)
        solo = [await generate(engine, p, max_tokens=12) for p in ps]
        together = await generate_all(engine, [make_request(p, max_tokens=12) for p in ps])
        assert [r.text for r in together] == [r.text for r in solo]
        assert len({r.text for r in solo}) > 1, "the tiny model should vary with the prompt"


@pytest.mark.parametrize("depth", [1, 2])
async def test_output_and_cancellation_do_not_depend_on_the_pipeline_depth(tiny_model_dir, depth):
    async with running_engine(tiny_model_dir) as engine:  # the default depth, 3
        ps = prompts(engine, 6)
        reference = await generate_all(engine, [make_request(p, max_tokens=12) for p in ps])
    config = EngineConfig(pipeline_depth=depth)
    async with running_engine(tiny_model_dir, config=config) as engine:
        results = await generate_all(engine, [make_request(p, max_tokens=12) for p in ps])
        assert [r.text for r in results] == [r.text for r in reference]
        # A client that leaves mid-stream is dropped however many steps are queued.
        handle = engine.submit(make_request(ps[0], max_tokens=10_000))
        async with handle:
            assert (await handle.peek()) is not None
        await wait_until(lambda: engine.idle)
        assert engine.statistics().running == 0


async def test_seeded_sampling_is_reproducible_inside_a_mixed_batch(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        p = prompts(engine, 1)[0]
        alone = await generate(engine, p, max_tokens=16, temperature=1.0, seed=42)
        noise = [make_request(q, max_tokens=16, temperature=1.0) for q in prompts(engine, 5)]
        mixed = await generate_all(
            engine, [make_request(p, max_tokens=16, temperature=1.0, seed=42), *noise])
        other_seed = await generate(engine, p, max_tokens=16, temperature=1.0, seed=7)
        assert mixed[0].text == alone.text
        assert other_seed.text != alone.text


async def test_stop_string_across_tokens_ends_output_before_it(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        p = prompts(engine, 1)[0]
        full = await generate(engine, p, max_tokens=24)
        stop = full.text[5:9]  # four characters, likely spanning a token boundary
        cut = await generate(engine, p, max_tokens=24, stop=(stop,))
        assert cut.finish == "stop"
        assert cut.text == full.text[: full.text.index(stop)]


async def test_client_that_disconnects_leaves_the_batch(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        p = prompts(engine, 1)[0]
        handle = engine.submit(make_request(p, max_tokens=1000))
        async for _ in handle:
            break  # one delta arrived: the request is decoding
        assert engine.statistics().running == 1
        handle.close()
        await wait_until(lambda: engine.statistics().running == 0)
        assert (await generate(engine, p, max_tokens=4)).tokens == 4


async def test_queued_request_whose_client_left_is_never_run(tiny_model_dir):
    async with running_engine(tiny_model_dir, failpoints="engine.step=1*hang",
                              decode_batch_size=1) as engine:
        steps = record_runner_steps(engine)
        first = engine.submit(make_request(prompts(engine, 1)[0], max_tokens=2))
        await step_hanging(engine)
        gone = make_request(prompts(engine, 1)[0], max_tokens=2)
        engine.submit(gone).close()
        engine.failpoints.release()
        assert (await drain(first)).tokens == 2
        await wait_until(lambda: engine.idle)
        admitted = [rid for ids, _ in steps for rid in ids]
        assert gone.request_id not in admitted
        assert admitted  # the spy saw the first request's admission


async def test_a_queued_request_takes_a_finished_ones_slot_in_the_next_step_launched(
        tiny_model_dir):
    config = EngineConfig(max_running=1)
    async with running_engine(tiny_model_dir, config=config, decode_batch_size=1) as engine:
        first, second = (make_request(p, max_tokens=4) for p in prompts(engine, 2))
        steps = record_runner_steps(engine)
        handles = [engine.submit(first), engine.submit(second)]
        assert [(await drain(h)).tokens for h in handles] == [4, 4]
        finished = next(i for i, (_, outcome) in enumerate(steps) if any(
            rid == first.request_id and d.finish_reason for rid, d in outcome.deltas))
        admitted = next(i for i, (ids, _) in enumerate(steps) if second.request_id in ids)
        # The steps already queued behind the one that finished the first request had no
        # free slot; the first step launched once its outcome is in takes the second.
        assert admitted == finished + config.pipeline_depth


async def test_request_arriving_during_a_step_joins_the_step_queued_behind_it(tiny_model_dir):
    async with running_engine(tiny_model_dir, failpoints="engine.step=1*hang") as engine:
        first_prompt, second_prompt = prompts(engine, 2)
        first = engine.submit(make_request(first_prompt, max_tokens=6))
        await step_hanging(engine)
        second = engine.submit(make_request(second_prompt, max_tokens=6))
        # The running step hangs; the actor still takes the newcomer from the inbox and
        # hands it to the queued step (before this, it stayed queued until the hung
        # step returned, then waited for the queued step too).
        try:
            await wait_until(lambda: engine.statistics().waiting == 0
                             and engine.statistics().running == 2)
        finally:
            engine.failpoints.release()  # a failed wait must not leave the step hung
        results = [await drain(first), await drain(second)]
        assert [r.tokens for r in results] == [6, 6]
        assert results[1].text == (await generate(engine, second_prompt, max_tokens=6)).text


def test_a_late_arrival_joins_the_first_queued_step_not_begun():
    """The MLX thread may have begun the step behind the awaited one before the event
    loop saw the awaited one's outcome; the step after it still takes the newcomer."""
    from types import SimpleNamespace

    from mlx_serve.engine import Engine
    from mlx_serve.engine_step import EngineStep

    newcomer = make_request([1, 2, 3])
    given: list = []
    actor = SimpleNamespace(_can_pipeline=lambda: True, _take_admissions=lambda: [newcomer],
                            _requests=SimpleNamespace(given=given.extend))
    runner = SimpleNamespace(step=lambda admissions, cancellations: None)
    begun, next_one, last = (EngineStep(set(), [], []) for _ in range(3))
    begun.run(runner)
    Engine._admit_late(actor, [begun, next_one, last])  # type: ignore[arg-type]
    assert begun.admissions == [] and last.admissions == []
    assert next_one.admissions == [newcomer] and newcomer.request_id in next_one.in_step
    assert given == [newcomer]
    # With every queued step begun, the newcomer waits for the next step launched.
    given.clear()
    next_one.run(runner)
    last.run(runner)
    Engine._admit_late(actor, [begun, next_one, last])  # type: ignore[arg-type]
    assert given == [] and last.admissions == []


@asynccontextmanager
async def first_step_hung(model_dir, running: int, queue: int):
    """An engine whose first step hangs with one request in it, until released:
    ``(engine, a prompt, that request's handle)``."""
    config = EngineConfig(max_running=running, max_queue=queue)
    async with running_engine(model_dir, failpoints="engine.step=1*hang", config=config,
                              decode_batch_size=running) as engine:
        p = prompts(engine, 1)[0]
        first = engine.submit(make_request(p, max_tokens=2))
        await step_hanging(engine)
        yield engine, p, first


async def test_full_inbox_answers_at_once(tiny_model_dir):
    async with first_step_hung(tiny_model_dir, running=1, queue=2) as (engine, p, first):
        handles = [first] + [engine.submit(make_request(p, max_tokens=2)) for _ in range(2)]
        with pytest.raises(OverloadedError) as info:
            engine.submit(make_request(p, max_tokens=2))
        assert info.value.status_code == 429 and info.value.retry_after
        engine.failpoints.release()
        results = [await drain(h) for h in handles]
        assert [r.tokens for r in results] == [2, 2, 2]


async def test_a_queued_client_that_leaves_gives_its_place_back_at_once(tiny_model_dir):
    async with first_step_hung(tiny_model_dir, running=1, queue=2) as (engine, p, first):
        gone = [engine.submit(make_request(p, max_tokens=2)) for _ in range(2)]
        assert engine.statistics().waiting == 2
        for handle in gone:
            handle.close()
        # While the step still hangs: the places are free again, and /health says so.
        assert engine.statistics().waiting == 0
        later = [engine.submit(make_request(p, max_tokens=2)) for _ in range(2)]
        with pytest.raises(OverloadedError):
            engine.submit(make_request(p, max_tokens=2))
        engine.failpoints.release()
        assert [(await drain(h)).tokens for h in [first, *later]] == [2, 2, 2]
        await wait_until(lambda: engine.idle)


async def test_a_running_client_that_leaves_gives_its_place_back_before_the_next_step(
        tiny_model_dir):
    async with first_step_hung(tiny_model_dir, running=1, queue=1) as (engine, p, running):
        queued = engine.submit(make_request(p, max_tokens=2))
        with pytest.raises(OverloadedError):
            engine.submit(make_request(p, max_tokens=2))
        running.close()  # while its step still hangs
        later = engine.submit(make_request(p, max_tokens=2))
        engine.failpoints.release()
        assert [(await drain(h)).tokens for h in (queued, later)] == [2, 2]


async def test_requests_that_fit_the_free_batch_slots_are_admitted_during_a_step(
        tiny_model_dir):
    async with first_step_hung(tiny_model_dir, running=4, queue=1) as (engine, p, first):
        handles = [first]
        # The actor is inside a step: before, the inbox's bound (max_queue) refused the
        # third of these although three batch slots were free.
        handles += [engine.submit(make_request(p, max_tokens=2)) for _ in range(4)]
        with pytest.raises(OverloadedError):
            engine.submit(make_request(p, max_tokens=2))
        engine.failpoints.release()
        assert [(await drain(h)).tokens for h in handles] == [2] * 5


async def test_more_choices_than_the_server_can_ever_hold_is_a_400(tiny_model_dir):
    config = EngineConfig(max_running=2, max_queue=1)
    async with running_engine(tiny_model_dir, config=config) as engine:
        p = prompts(engine, 1)[0]
        def choices(n: int) -> list[GenerationRequest]:
            return [replace(make_request(p, max_tokens=2), index=i) for i in range(n)]

        with pytest.raises(RequestError) as info:
            engine.submit(*choices(4))
        assert info.value.status_code == 400 and info.value.param == "n"
        ended = set()
        async with engine.submit(*choices(3)) as handle:
            async for event in handle:
                assert not isinstance(event, Failure)
                if event.finish_reason is not None:
                    ended.add(event.index)
        assert ended == {0, 1, 2}


async def test_actor_end_fails_every_open_request_and_refuses_new_ones(tiny_model_dir):
    async with running_engine(tiny_model_dir, failpoints="engine.step=2*off->hang") as engine:
        p = prompts(engine, 1)[0]
        handles = [engine.submit(make_request(p, max_tokens=50)) for _ in range(3)]
        await step_hanging(engine)
        engine.failpoints.release()
        engine.failpoints.set("engine.self_test", "raise(RuntimeError:boom)")  # broken
        engine.failpoints.set("engine.step", "raise(RuntimeError:boom)")
        results = [await drain(h) for h in handles]
        assert all(isinstance(r.error, EngineDeadError) or r.error is not None
                   for r in results)
        assert engine.state is EngineState.FAILED
        with pytest.raises(EngineDeadError):
            engine.submit(make_request(p))


async def test_drain_finishes_in_flight_requests_and_refuses_new_ones(tiny_model_dir):
    from mlx_serve.errors import EngineUnavailableError

    async with running_engine(tiny_model_dir, decode_batch_size=2) as engine:
        ps = prompts(engine, 3)
        running = [engine.submit(make_request(p, max_tokens=30)) for p in ps[:2]]
        queued = engine.submit(make_request(ps[2], max_tokens=30))
        async for _ in running[0]:
            break  # both running requests are decoding; the third waits for a slot
        engine.begin_drain()
        assert engine.state is EngineState.DRAINING
        with pytest.raises(EngineUnavailableError):
            engine.submit(make_request(ps[0]))
        assert (await drain(queued)).error is not None
        assert (await drain(running[1])).tokens == 30
        with anyio.fail_after(10):
            await engine.finished.wait()


async def test_abort_ends_in_flight_requests_with_a_terminal_error(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        handle = engine.submit(make_request(prompts(engine, 1)[0], max_tokens=1000))
        async for _ in handle:
            break
        engine.abort()
        result = await drain(handle)
        assert isinstance(result.error, ShuttingDownError)  # a shutdown's, not a dead engine's
        assert result.tokens < 999  # ended long before its max_tokens


async def test_memory_figures_are_read_without_calling_into_mlx(tiny_model_dir, monkeypatch):
    async with running_engine(tiny_model_dir) as engine:
        (prompt,) = prompts(engine, 1)
        await generate(engine, prompt, max_tokens=4)  # idle again: no step is running

        def off_the_mlx_thread() -> int:
            raise AssertionError("MLX's allocator was called from the event loop")

        # /health reads these figures; MLX's allocator lock may be held by a step.
        for name in ("get_active_memory", "get_cache_memory", "get_peak_memory"):
            monkeypatch.setattr(mx, name, off_the_mlx_thread)
        memory = engine.runner.memory()
        assert memory["active_bytes"] > 0  # the weights, sampled on the MLX thread
        assert memory["peak_bytes"] >= memory["active_bytes"]
        assert set(memory) == {"active_bytes", "cache_bytes", "peak_bytes",
                               "prefix_cache_bytes"}
