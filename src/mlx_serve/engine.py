"""The generation actor: the one task that owns the batch and every request.

    routes ── submit() ──► inbox (memory channel) ──► Engine.run()
                                                              admit → step → deliver
    reply channel (one per request) ◄── put ──────────────────┘

Only ``run`` mutates engine state. ``submit`` and ``statistics`` are synchronous and
never wait on the actor, so a full batch or a stuck step can never stall the event loop
or a health probe. Every request ends with exactly one terminal event on its reply
stream: a Delta carrying ``finish_reason``, or a Failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import anyio

from mlx_serve.engine_state import (
    ALIVE_STATES,
    EngineConfig,
    EngineState,
    EngineStatistics,
    ended_error,
    unavailable_error,
)
from mlx_serve.engine_step import EngineStep
from mlx_serve.errors import (
    EngineDeadError,
    MLXServeError,
    StepTimeoutError,
    as_request_error,
    isolation_error,
)
from mlx_serve.generation import Delta, Failure, GenerationRequest, ReplyEvent, StepOutcome
from mlx_serve.mlx_thread import MLXThread
from mlx_serve.open_requests import OpenRequests
from mlx_serve.recovery import Decision, Isolation
from mlx_serve.reply_channel import ReplyChannel
from mlx_serve.request_handle import RequestHandle
from mlx_serve.wakeup import Wakeup

log = logging.getLogger(__name__)

__all__ = ["ALIVE_STATES", "Engine", "EngineConfig", "EngineState", "EngineStatistics",
           "RequestHandle", "unavailable_error"]


class _EngineFailed(Exception):
    """Recovery gave up: the engine cannot step any more."""


class Engine:
    def __init__(
        self, load: Callable[[], Any], config: EngineConfig, mlx: MLXThread
    ) -> None:
        self._load = load
        self._config = config
        self._mlx = mlx
        self._state = EngineState.LOADING
        self._error: str | None = None
        self._requests = OpenRequests(config.max_running + config.max_queue)
        self._batch: frozenset[str] | None = None  # None: every open request is in it
        self._isolation = Isolation(config.max_failed_rebuilds, config.max_request_failures)
        self._step_started: float | None = None
        self._counts = {"steps": 0, "prefill_steps": 0, "recoveries": 0, "replays": 0,
                        "isolated": 0, "worn_out": 0}
        self._draining = False
        self.runner: Any = None
        self._aborted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: Wakeup | None = None  # made in run(), on the actor's event loop
        self._text: MLXThread | None = None  # the text thread, if configured (run())
        self._wake_on_arrival = False  # a queued step could still take a newcomer
        self._arrived = False
        self.ready = anyio.Event()
        self.finished = anyio.Event()

    # -- producers' side: synchronous, never waits on the actor ----------------------------

    def submit(self, *requests: GenerationRequest, wake_every: int | None = 1
               ) -> RequestHandle:
        """Queue requests that share one reply stream (the choices of one HTTP request).

        Events on the stream carry their request's ``index``; the stream ends once every
        request has had its terminal event. ``wake_every``: see ``ReplyChannel``.
        """
        reply = ReplyChannel[ReplyEvent](producers=len(requests), wake_every=wake_every)
        self.submit_to(reply, *requests)
        return RequestHandle(requests[0].request_id, reply)

    def submit_to(self, reply: ReplyChannel[ReplyEvent], *requests: GenerationRequest) -> None:
        """Queue requests that answer on ``reply`` (one producer each); on an error the
        reply is closed and the error raised."""
        if self._state not in (EngineState.READY, EngineState.RECOVERING):
            reply.close()
            raise self.unavailable_error()
        try:
            self._requests.queue(reply, requests)
            if self._wake_on_arrival:  # the actor may add it to the queued step
                self._arrived = True
                self._wake()
        except MLXServeError:
            reply.close()
            raise
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            reply.close()
            raise EngineDeadError("the generation engine has stopped") from None

    def statistics(self) -> EngineStatistics:
        started = self._step_started
        return EngineStatistics(
            state=self._state, running=len(self._requests),
            waiting=self._requests.waiting,
            step_age=0.0 if started is None else time.monotonic() - started,
            error=self._error, mlx_busy=self._mlx.busy_seconds, **self._counts,
        )

    @property
    def state(self) -> EngineState:
        return self._state

    def begin_drain(self) -> None:
        """Stop admitting; in-flight requests go on. Called on SIGTERM.

        Closing the inbox's sending side wakes an idle actor; queued requests are
        answered with 503 by the actor itself.
        """
        self._draining = True
        if self._state in (EngineState.READY, EngineState.RECOVERING, EngineState.LOADING):
            self._state = EngineState.DRAINING
        self._requests.close_inbox()

    @property
    def idle(self) -> bool:
        return not self._requests and self._requests.waiting == 0

    # -- the actor ------------------------------------------------------------------------

    def abort(self) -> None:
        """End the actor after its current step; every open request gets a terminal error.

        A flag rather than a cancellation: cancelling the actor while it receives from
        the inbox could lose a request that was being handed over. A step stuck on the
        MLX thread is left behind, not waited for.
        """
        self._aborted = True
        self._wake()
        self.begin_drain()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = Wakeup(self._loop)
        if self._config.text_thread:  # a job thread like the MLX one; it calls no MLX
            self._text = MLXThread(name="text")
        try:
            try:
                self.runner = await self._mlx.call(self._load)
            except Exception as exc:  # said in one line first: the traceback follows
                log.critical("the model could not be loaded: %s: %s", type(exc).__name__, exc)
                raise
            if not self._draining:
                self._state = EngineState.READY
            self.ready.set()
            while not self._aborted and await self._wait_for_work():
                # A cancellation waits for the batch to go idle: a step is never
                # abandoned on the MLX thread while requests depend on it (abort() is
                # how to stop a busy actor).
                with anyio.CancelScope(shield=True):
                    await self._step_until_idle()
        except _EngineFailed as exc:
            log.critical("the generation engine failed for good: %s", exc)
            self._state, self._error = EngineState.FAILED, str(exc)
        except Exception as exc:
            log.exception("the generation engine crashed")
            self._state, self._error = EngineState.FAILED, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._wakeup.close()
            if self._text is not None:  # ends after its job; it holds nothing to wait for
                self._text.stop(timeout=0)
            if self._state not in (EngineState.FAILED, EngineState.WEDGED):
                self._state = EngineState.STOPPED
            self._fail_all(ended_error(self._state, self._aborted))
            self.ready.set()
            self.finished.set()

    async def _wait_for_work(self) -> bool:
        """Return True when there is something to step; False when the actor should end."""
        while not self._requests:
            entry = await self._requests.next_queued()
            if entry is None:
                return False
            self._requests.open(entry, self._draining)  # draining may have begun meanwhile
        return True

    async def _step_until_idle(self) -> None:
        """Step, pipelined, until no request is open (or the actor is aborted)."""
        inflight: deque[EngineStep] = deque()
        while not self._aborted:
            if not inflight:
                if not self._requests:
                    await self._end_moot_recovery()
                    return
                inflight.append(self._launch_step())
            self._top_up(inflight)
            step = inflight.popleft()
            outcome = await self._await_step(step, inflight)
            if outcome is None:  # wedged or aborted, and dealt with: queued steps are moot
                return
            # Finished requests leave first, so that queued ones can take their slots in
            # the next step; that step is queued before this one's fan-out, so the MLX
            # thread never waits for the deltas of 128 streams to be handed out.
            self._retire_finished(outcome)
            if outcome.error is None and not outcome.skipped:
                self._top_up(inflight)
            await self._handle(outcome, step.in_step)

    async def _end_moot_recovery(self) -> None:
        """Idle mid-recovery (its requests all ended, or their clients left): no step
        would come to end it, so it ends here; the next request starts a whole batch."""
        if self._isolation.recovering:  # (a probe's batch is only set while recovering)
            log.info("recovery over: no request left to replay")
            self._isolation.reset()
            if self._batch is not None:
                self._batch = None
                await self._mlx.call(self.runner.rebuild, None)
            if self._state is EngineState.RECOVERING:
                self._state = EngineState.READY

    def _retire_finished(self, outcome: StepOutcome) -> None:
        """Each terminal delta ends its request here; ``_deliver`` hands out the rest."""
        for rid, delta in outcome.deltas:
            if delta.finish_reason is not None:
                self._finish(rid, delta)

    def _top_up(self, inflight: deque[EngineStep]) -> None:
        """Keep ``pipeline_depth`` steps in the MLX thread's hands in plain serving.

        Further steps wait in its queue while one runs: the thread goes from step to
        step without waiting for the event loop, which meanwhile fans out deltas and
        writes to clients.
        """
        while len(inflight) < self._config.pipeline_depth and self._can_pipeline():
            inflight.append(self._launch_step())

    def _take_admissions(self) -> list[GenerationRequest]:
        """New requests from the inbox, up to the running limit (none while isolating)."""
        limit = self._config.max_running if self._batch is None else None
        return self._requests.take_new(limit, self._draining)

    def _take_cancellations(self) -> list[str]:
        gone = self._requests.take_departed()
        if gone:
            self._isolation.forget(gone)
        return gone

    def _in_batch(self, admissions: list[GenerationRequest]) -> set[str]:
        """The requests the next step runs (a fresh set: a queued step may add to it)."""
        self._requests.given(admissions)
        return self._requests.in_batch(self._batch)

    def _launch_step(self) -> EngineStep:
        admissions = self._take_admissions()
        cancellations = self._take_cancellations()
        step = EngineStep(self._in_batch(admissions), admissions, cancellations)
        assert self._loop is not None  # set in run(), the only caller's caller
        step.launch(self.runner, self._loop, self._step_done, self._mlx, self._text)
        return step

    def _step_done(self, step: EngineStep, outcome: StepOutcome) -> None:
        """On the event loop: a step's outcome is in."""
        step.outcome = outcome
        self._wake()

    def _admit_late(self, queued: Collection[EngineStep]) -> None:
        """Hand requests that arrived meanwhile to the first queued step not begun: the
        MLX thread may have begun the one right behind the awaited step before the event
        loop saw the awaited step's outcome, and the step after it can still take them."""
        if not self._can_pipeline():
            return
        admissions = self._take_admissions()
        if admissions and any(step.add_admissions(admissions) for step in queued):
            self._requests.given(admissions)

    def _can_pipeline(self) -> bool:
        """Queue a step behind the running one only in plain serving, with work left."""
        return bool(self._requests) and self._batch is None and not self._isolation.recovering

    async def _await_step(self, step: EngineStep, queued: Collection[EngineStep]
                          ) -> StepOutcome | None:
        """Wait for a step, never abandoning it; one past its deadline wedges the engine.
        Arrivals meanwhile join the first of ``queued`` (the steps behind it) not begun.
        Returns None when the engine wedged or was aborted meanwhile."""
        started = step.started or time.monotonic()  # not begun yet: its turn is now
        self._step_started = started
        try:
            if await self._done_or_aborted(step, started + self._config.step_timeout, queued):
                return step.outcome
            if not self._aborted:
                await self._wedged(step)
            return None
        finally:
            self._step_started = None
            # Batch steps the model ran; a step that hung counts, a queued empty one not.
            if step.outcome is None or step.outcome.ran_batch:
                self._counts["steps"] += 1
                self._counts["prefill_steps"] += bool(step.outcome and step.outcome.prefilled)

    async def _done_or_aborted(self, step: EngineStep, deadline: float | None,
                               queued: Collection[EngineStep] = ()) -> bool:
        """Wait for ``step`` up to ``deadline`` or until ``abort()``; True if it is done.

        The MLX thread cannot be interrupted, so an abort leaves the step running there
        and stops waiting for it: a stuck step can never hold up shutdown. With a
        ``queued`` step not begun, each arrival in the inbox is handed to it meanwhile.
        """
        assert self._wakeup is not None
        while True:
            if self._arrived and queued:
                self._admit_late(queued)  # to the first not begun; else the next launched
            self._arrived = False
            if step.outcome is not None:
                return True
            if self._aborted or (deadline is not None and time.monotonic() >= deadline):
                return False
            self._wake_on_arrival = any(s.started is None for s in queued)
            try:
                await self._wakeup.sleep(deadline)
            finally:
                self._wake_on_arrival = False

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.wake()

    async def _wedged(self, step: EngineStep) -> None:
        log.error("a step exceeded %.1f s: engine wedged", self._config.step_timeout)
        previous, self._state = self._state, EngineState.WEDGED
        self._fail_all(StepTimeoutError("the generation step timed out; the engine is wedged"))
        if not await self._done_or_aborted(step, None):
            return  # aborted while wedged: the actor ends without the step
        await self._mlx.call(self._rebuild_empty)
        self._state = EngineState.DRAINING if self._draining else previous
        log.warning("the wedged step returned; engine rebuilt and %s", self._state.value)

    def _rebuild_empty(self) -> None:
        self.runner.forget(self.runner.live_ids())
        self.runner.rebuild()

    async def _handle(self, outcome: StepOutcome, in_step: set[str]) -> None:
        for rid, exc in outcome.failed:
            self._finish(rid, Failure(as_request_error(exc)))
        if outcome.skipped:  # queued behind a failed step: admitted, not stepped
            return
        self._deliver(outcome.deltas)
        if outcome.error is None:
            decision = self._isolation.on_success(in_step)
        else:
            log.warning("step failed (%s: %s) with %d requests",
                        type(outcome.error).__name__, outcome.error, len(in_step))
            self._counts["recoveries"] += 1
            decision = self._isolation.on_failure(in_step & self._requests.ids())
        if decision is not None:
            await self._apply(decision, outcome.error)
        if self._state is EngineState.RECOVERING and not self._isolation.recovering:
            self._state = EngineState.READY

    async def _apply(self, decision: Decision, error: BaseException | None) -> None:
        if decision.fatal:
            raise _EngineFailed(
                f"steps keep failing after rebuilds; last error: {type(error).__name__}: {error}"
            )
        involvement = self._isolation.max_involvement
        for rid in decision.isolate:
            worn = rid in decision.worn_out
            self._counts["worn_out" if worn else "isolated"] += 1
            after = involvement if worn else None
            self._finish(rid, Failure(isolation_error(error, worn_out_after=after)))
        if decision.self_test:
            log.warning("requests keep failing alone; testing the engine outside the batch")
            try:
                await self._mlx.call(self.runner.self_test)
            except Exception as exc:
                raise _EngineFailed(f"the engine's self-test failed: {exc!r}") from exc
        if decision.isolate:
            await self._mlx.call(self.runner.forget, decision.isolate)
        self._batch = decision.batch
        if self._isolation.recovering and self._state is EngineState.READY:
            self._state = EngineState.RECOVERING
        self._counts["replays"] += len(self._in_batch([]))
        await self._mlx.call(self.runner.rebuild, self._batch)

    def _deliver(self, deltas: Collection[tuple[str, Delta]]) -> None:
        """The non-terminal deltas (``_retire_finished`` has ended the finished requests)."""
        for rid, delta in deltas:
            if delta.finish_reason is None and (entry := self._requests.get(rid)) is not None:
                entry.reply.put(delta)  # a departed client's is dropped; cancelled next step

    def _finish(self, rid: str, event: ReplyEvent) -> None:
        self._requests.finish(rid, event)
        self._isolation.forget([rid])

    def _fail_all(self, error: MLXServeError) -> None:
        """Terminal error to every open and queued request; close the inbox for good
        (a wedged engine keeps it: it may come back)."""
        for rid in list(self._requests.ids()):
            self._finish(rid, Failure(error))
        if self._state is not EngineState.WEDGED:
            self._requests.close_inbox()
        self._requests.answer_queued(Failure(error))

    def unavailable_error(self) -> MLXServeError:
        return unavailable_error(self._state)
