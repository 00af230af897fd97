"""One step handed to the MLX thread, open to late admissions until it begins."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from mlx_serve.generation import GenerationRequest, StepOutcome


class EngineStep:
    """A step submitted to the MLX thread.

    Until the MLX thread begins it, the actor may add admissions (requests that arrived
    while the step waited in the queue): a newcomer then joins the very next step
    instead of the one after it. Once run, the step reports its outcome to the event
    loop itself, one ``call_soon_threadsafe`` per step.
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
        with self._lock:
            self.started = time.monotonic()
            admissions = list(self.admissions)
        return runner.step(admissions, self.cancellations)

    def run_and_report(self, runner: Any, loop: asyncio.AbstractEventLoop,
                       done: Callable[[EngineStep, StepOutcome], None]) -> None:
        """Run on the MLX thread, then call ``done(self, outcome)`` on the event loop."""
        try:
            outcome = self.run(runner)
        except BaseException as exc:  # a fault outside the runner's own guard
            outcome = StepOutcome(error=exc)
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
