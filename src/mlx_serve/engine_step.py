"""One step handed to the MLX thread, open to late admissions until it begins."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from mlx_serve.generation import GenerationRequest, StepOutcome
from mlx_serve.mlx_thread import MLXThread


class EngineStep:
    """A step submitted to the MLX thread.

    Until the MLX thread begins it, the actor may add admissions (requests that arrived
    while the step waited in the queue): a newcomer then joins the very next step
    instead of the one after it. Once run, the step reports its outcome to the event
    loop itself, one ``call_soon_threadsafe`` per step: from the MLX thread, or from the
    text thread where one makes the step's text.
    """

    __slots__ = ("in_step", "admissions", "cancellations", "outcome", "started", "_lock")

    def __init__(self, in_step: set[str], admissions: list[GenerationRequest],
                 cancellations: list[str]) -> None:
        self.in_step = in_step  # the requests taking part, for blame if it fails
        self.admissions = admissions
        self.cancellations = cancellations
        self.outcome: StepOutcome | None = None  # set on the event loop once it has run
        self.started: float | None = None  # set on the MLX thread when the step begins
        self._lock = threading.Lock()

    def run(self, runner: Any) -> StepOutcome:
        return runner.step(self._begin(), self.cancellations)

    def _begin(self) -> list[GenerationRequest]:
        """Close the step to late admissions; the ones it takes."""
        with self._lock:
            self.started = time.monotonic()
            return list(self.admissions)

    def launch(self, runner: Any, loop: asyncio.AbstractEventLoop,
               done: Callable[[EngineStep, StepOutcome], None], mlx: MLXThread,
               text: MLXThread | None) -> None:
        """Queue the step on the MLX thread; its text made there too, or on ``text``."""
        if text is None:
            mlx.post(self.run_and_report, runner, loop, done)
        else:
            mlx.post(self.run_then_text, runner, loop, done, text, mlx)

    def run_and_report(self, runner: Any, loop: asyncio.AbstractEventLoop,
                       done: Callable[[EngineStep, StepOutcome], None]) -> None:
        """Run on the MLX thread, then call ``done(self, outcome)`` on the event loop."""
        try:
            outcome = self.run(runner)
        except BaseException as exc:  # a fault outside the runner's own guard
            outcome = StepOutcome(error=exc)
        self._report(loop, done, outcome)

    def run_then_text(self, runner: Any, loop: asyncio.AbstractEventLoop,
                      done: Callable[[EngineStep, StepOutcome], None],
                      text: MLXThread, mlx: MLXThread) -> None:
        """Run the step's first phase on the MLX thread and hand its tokens to ``text``,
        the text thread, which makes the deltas and reports (``runner.token_text``)."""
        try:
            tokens = runner.step_tokens(self._begin(), self.cancellations)
        except BaseException as exc:  # reported behind the text of the steps before it
            text.post(self._report, loop, done, StepOutcome(error=exc))
            return
        text.post(self._text_and_report, runner, tokens, loop, done, mlx)

    def _text_and_report(self, runner: Any, tokens: Any, loop: asyncio.AbstractEventLoop,
                         done: Callable[[EngineStep, StepOutcome], None],
                         mlx: MLXThread) -> None:
        """On the text thread: the deltas, then the outcome to the event loop. Replies
        the text ended are taken out of the batch by a job on the MLX thread, so that
        an idle engine does not keep them there."""
        try:
            outcome = runner.step_texts(tokens)
        except BaseException as exc:  # a fault outside the text phase's own guard
            outcome = StepOutcome(error=exc, ran_batch=True)
        self._report(loop, done, outcome)
        if runner.ended_waiting:
            mlx.post(runner.take_out_ended)

    def _report(self, loop: asyncio.AbstractEventLoop,
                done: Callable[[EngineStep, StepOutcome], None], outcome: StepOutcome) -> None:
        try:
            loop.call_soon_threadsafe(done, self, outcome)
        except RuntimeError:  # the loop has closed: nobody waits for this step any more
            pass

    def add_admissions(self, requests: list[GenerationRequest]) -> bool:
        """Add requests to a step that has not begun; False if it has."""
        with self._lock:
            if self.started is not None:
                return False
            self.admissions.extend(requests)
            self.in_step.update(r.request_id for r in requests)
            return True
