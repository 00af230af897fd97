"""Containment and recovery inside the actor, driven by fail points on the tiny model."""

from __future__ import annotations

import anyio
import pytest

from mlx_serve.engine import EngineConfig, EngineState
from mlx_serve.errors import (
    EngineDeadError,
    GenerationError,
    IsolatedRequestError,
    StepTimeoutError,
    UnstableGenerationError,
)
from tests.conftest import running_engine
from tests.engine_helpers import (
    drain,
    generate,
    generate_all,
    make_request,
    prompts,
    step_hanging,
)

pytestmark = pytest.mark.anyio

MALLOC = "RuntimeError:[metal::malloc] Resource limit (499000) exceeded"


async def reference(model_dir, count: int, max_tokens: int = 16) -> list[str]:
    async with running_engine(model_dir) as engine:
        reqs = [make_request(p, max_tokens=max_tokens) for p in prompts(engine, count)]
        return [r.text for r in await generate_all(engine, reqs)]


@pytest.mark.parametrize("spec", ["engine.step=5*off->1*raise(RuntimeError:boom)",
                                  f"engine.step=4*off->3*raise({MALLOC})"])
async def test_failed_steps_are_replayed_without_changing_any_output(tiny_model_dir, spec):
    expected = await reference(tiny_model_dir, 8)
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=16) for p in prompts(engine, 8)]
        results = await generate_all(engine, reqs)
        stats = engine.statistics()
    assert [r.error for r in results] == [None] * 8
    assert [r.text for r in results] == expected
    assert [r.tokens for r in results] == [16] * 8
    assert stats.recoveries >= 1 and stats.replays >= 8 and stats.isolated == 0
    assert stats.state is EngineState.READY


async def test_seeded_sampling_survives_replay_exactly(tiny_model_dir):
    async with running_engine(tiny_model_dir) as engine:
        p = prompts(engine, 1)[0]
        clean = await generate(engine, p, max_tokens=20, temperature=0.9, seed=1234)
    async with running_engine(tiny_model_dir,
                              failpoints="engine.step=8*off->1*raise(RuntimeError:x)") as engine:
        faulty = await generate(engine, p, max_tokens=20, temperature=0.9, seed=1234)
        assert engine.statistics().recoveries == 1
    assert faulty.text == clean.text


async def test_poison_request_is_isolated_and_the_rest_complete_exactly(tiny_model_dir):
    expected = await reference(tiny_model_dir, 8)
    spec = "engine.step[user=poison]=raise(ValueError:poisoned)"
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=16, user="poison" if i == 3 else None)
                for i, p in enumerate(prompts(engine, 8))]
        results = await generate_all(engine, reqs)
        stats = engine.statistics()
        after = await generate(engine, prompts(engine, 1)[0], max_tokens=4)
    assert isinstance(results[3].error, GenerationError)
    healthy = [r for i, r in enumerate(results) if i != 3]
    assert [r.text for r in healthy] == [t for i, t in enumerate(expected) if i != 3]
    assert stats.isolated == 1 and stats.state is EngineState.READY
    assert after.tokens == 4


async def test_every_step_failing_ends_in_failed_with_every_request_answered(tiny_model_dir):
    config = EngineConfig(max_failed_rebuilds=3)
    async with running_engine(tiny_model_dir, failpoints="engine.step=raise(OSError:dead)",
                              config=config) as engine:
        reqs = [make_request(p, max_tokens=8) for p in prompts(engine, 6)]
        results = await generate_all(engine, reqs)
        assert engine.state is EngineState.FAILED
        # The self-test (a bare forward pass) passes here, so bisection isolates requests
        # until the isolations, or whole batches failing, say the engine is broken.
        errors = [type(r.error) for r in results]
        assert set(errors) <= {IsolatedRequestError, EngineDeadError}, errors
        assert errors.count(IsolatedRequestError) == engine.statistics().isolated >= 3, errors
        assert engine.statistics().recoveries < 40


async def test_a_broken_engine_fails_at_the_first_replay_that_fails(tiny_model_dir):
    spec = "engine.step=raise(OSError:dead);engine.self_test=raise(OSError:dead)"
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=8) for p in prompts(engine, 6)]
        results = await generate_all(engine, reqs)
        assert engine.state is EngineState.FAILED
        assert all(isinstance(r.error, EngineDeadError) for r in results)
        assert engine.statistics().recoveries == 2  # the first failure and its replay


async def test_two_failing_requests_in_one_batch_are_isolated_and_the_rest_served(
        tiny_model_dir):
    expected = await reference(tiny_model_dir, 8)
    spec = "engine.step[user=poison]=raise(ValueError:poisoned)"
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=16, user="poison" if i in (1, 6) else None)
                for i, p in enumerate(prompts(engine, 8))]
        results = await generate_all(engine, reqs)
        assert engine.state is EngineState.READY
    assert [isinstance(r.error, GenerationError) for r in results] == [
        i in (1, 6) for i in range(8)]
    assert [r.text for i, r in enumerate(results) if i not in (1, 6)] == [
        t for i, t in enumerate(expected) if i not in (1, 6)]


@pytest.mark.parametrize("self_test", ["off", "raise(RuntimeError:device lost)"])
async def test_failing_requests_sent_one_at_a_time_end_the_engine_only_if_it_is_broken(
        tiny_model_dir, self_test):
    """Three requests in a row that each fail alone, with nothing between them: a
    client resending a bad request, or an engine that fails everything? The self-test
    tells: it passes, serving goes on; it fails, the engine is failed."""
    spec = f"engine.step[user=poison]=raise(ValueError:poisoned);engine.self_test={self_test}"
    config = EngineConfig(max_failed_rebuilds=3)
    async with running_engine(tiny_model_dir, failpoints=spec, config=config) as engine:
        p = prompts(engine, 1)[0]
        if self_test != "off":  # the test before bisecting already fails
            failed = await generate(engine, p, max_tokens=4, user="poison")
            assert isinstance(failed.error, EngineDeadError)
        for _ in range(3 if self_test == "off" else 0):
            failed = await generate(engine, p, max_tokens=4, user="poison")
            assert isinstance(failed.error, GenerationError)
        # The third failure is answered before the actor settles its state.
        settled = EngineState.READY if self_test == "off" else EngineState.FAILED
        with anyio.fail_after(10):
            while engine.state in (EngineState.READY, EngineState.RECOVERING) and (
                    engine.state is not settled):
                await anyio.sleep(0.005)
        assert engine.state is settled
        if self_test == "off":
            assert (await generate(engine, p, max_tokens=4)).tokens == 4
            assert engine.statistics().isolated == 3
        else:
            assert "self-test" in (engine.statistics().error or "")


async def test_requests_worn_out_by_failures_with_no_culprit_are_told_to_resend(
        tiny_model_dir):
    """Every other step fails and every replay passes: no request is ever found the
    cause, and each ends after ``max_involvement`` failed steps. The answer says so, and
    that a resend may succeed, unlike a request found to be the cause."""
    spec = "engine.step=" + "->".join(["1*raise(RuntimeError:flaky)", "1*off"] * 8)
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=40) for p in prompts(engine, 3)]
        with anyio.fail_after(60):
            results = await generate_all(engine, reqs)
            stats = engine.statistics()
            after = await generate(engine, prompts(engine, 1)[0], max_tokens=4)
    errors = [r.error for r in results]
    assert all(isinstance(e, UnstableGenerationError) for e in errors), errors
    assert all(e.should_retry and "8 steps" in e.message and "flaky" in e.message
               for e in errors), errors
    assert stats.worn_out == 3 and stats.isolated == 0 and stats.recoveries == 8
    assert after.tokens == 4 and after.error is None


async def test_a_request_that_fails_three_steps_in_four_ends_alone(tiny_model_dir):
    """Its batch-mates miss the failed probes without it, so the suspects narrow to it:
    they complete exactly, where before every one of them wore out with it."""
    expected = await reference(tiny_model_dir, 8)
    spec = ("engine.step[user=flaky]="
            + "->".join(["3*raise(RuntimeError:flaky)", "1*off"] * 8))
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=16, user="flaky" if i == 5 else None)
                for i, p in enumerate(prompts(engine, 8))]
        with anyio.fail_after(60):
            results = await generate_all(engine, reqs)
        stats = engine.statistics()
    assert isinstance(results[5].error, GenerationError)
    healthy = [r for i, r in enumerate(results) if i != 5]
    assert [r.error for r in healthy] == [None] * 7
    assert [r.text for r in healthy] == [t for i, t in enumerate(expected) if i != 5]
    assert stats.isolated + stats.worn_out == 1 and stats.state is EngineState.READY


async def test_admission_failure_fails_only_that_request(tiny_model_dir):
    spec = "engine.admit[user=bad]=raise(ValueError:cannot admit)"
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        reqs = [make_request(p, max_tokens=6, user="bad" if i == 0 else None)
                for i, p in enumerate(prompts(engine, 4))]
        results = await generate_all(engine, reqs)
    assert results[0].error is not None and results[0].error.status_code == 400
    assert [r.tokens for r in results[1:]] == [6, 6, 6]


async def test_a_step_past_its_deadline_wedges_then_recovers(tiny_model_dir):
    config = EngineConfig(step_timeout=0.5)
    async with running_engine(tiny_model_dir, failpoints="engine.step=3*off->1*hang",
                              config=config) as engine:
        handles = [engine.submit(make_request(p, max_tokens=50)) for p in prompts(engine, 3)]
        results = [await drain(h) for h in handles]
        assert all(isinstance(r.error, StepTimeoutError) for r in results)
        assert engine.state is EngineState.WEDGED
        assert engine.statistics().step_age >= 0.5
        engine.failpoints.release()  # the stuck step returns
        with anyio.fail_after(10):
            while engine.state is not EngineState.READY:
                await anyio.sleep(0.01)
        assert (await generate(engine, prompts(engine, 1)[0], max_tokens=5)).tokens == 5


async def test_deadline_holds_for_each_step_however_long_the_engine_has_run(tiny_model_dir):
    # One timer serves many steps' deadlines: after stepping for longer than the
    # timeout, healthy steps must not wedge, and a hung one must still be caught.
    timeout = 0.3
    async with running_engine(tiny_model_dir, config=EngineConfig(step_timeout=timeout)
                              ) as engine:
        prompt = prompts(engine, 1)[0]
        started = anyio.current_time()
        with anyio.fail_after(30):
            while anyio.current_time() - started < 3 * timeout:
                result = await generate(engine, prompt, max_tokens=16)
                assert result.error is None and engine.state is EngineState.READY
        engine.failpoints.set("engine.step", "hang")
        with anyio.fail_after(10):
            result = await generate(engine, prompt, max_tokens=16)
        assert isinstance(result.error, StepTimeoutError)
        assert engine.state is EngineState.WEDGED
        engine.failpoints.release()


async def test_requests_with_and_without_logits_processors_share_prefill(tiny_model_dir):
    """mlx-lm #1505: one request without and one with penalties finishing prefill in the
    same step used to kill mlx_lm.server's generation thread."""
    async with running_engine(tiny_model_dir) as engine:
        tok = engine.runner.tokenizer
        long_prompt = tok.encode("a long prompt without any penalty " * 20)
        short_prompt = tok.encode("short prompt with a penalty " * 3)
        plain = make_request(long_prompt, max_tokens=12)
        penalised = make_request(short_prompt, max_tokens=12, repetition_penalty=1.3,
                                 presence_penalty=0.5, logit_bias=((5, 2.0),))
        results = await generate_all(engine, [plain, penalised])
        assert [(r.tokens, r.error) for r in results] == [(12, None), (12, None)]
        assert engine.state is EngineState.READY


async def test_a_recovery_whose_requests_all_left_ends_ready(tiny_model_dir):
    # The only request's client leaves while a step hangs; the steps after it fail while
    # its sequence is still in the batch. Nothing is left to replay: the engine must not
    # stay "recovering" with no work that could ever end the recovery.
    spec = "engine.step[user=leaver]=1*hang->raise(RuntimeError:after the client left)"
    async with running_engine(tiny_model_dir, failpoints=spec) as engine:
        handle = engine.submit(make_request(prompts(engine, 1)[0], max_tokens=500,
                                            user="leaver"))
        await step_hanging(engine)
        handle.close()
        engine.failpoints.release()
        with anyio.fail_after(10):
            while (stats := engine.statistics()).running or stats.waiting or stats.steps < 2:
                await anyio.sleep(0.01)
        with anyio.fail_after(2):
            while engine.state is not EngineState.READY:
                await anyio.sleep(0.01)
        assert engine.statistics().recoveries >= 1  # a step did fail after the departure
        after = await generate(engine, prompts(engine, 1)[0], max_tokens=4)
        assert after.tokens == 4 and after.error is None
