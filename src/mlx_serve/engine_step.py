"""One step handed to the MLX thread, open to late admissions until it begins."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from mlx_serve.generation import GenerationRequest, StepOutcome


class EngineStep:
    """A step submitted to the MLX thread.

    Until the MLX thread begins it, the actor may add admissions (requests that arrived
    while the step waited in the queue): a newcomer then joins the very next step
    instead of the one after it.
    """

    __slots__ = ("in_step", "admissions", "cancellations", "future", "started", "_lock")

    def __init__(self, in_step: set[str], admissions: list[GenerationRequest],
                 cancellations: list[str]) -> None:
        self.in_step = in_step  # the requests taking part, for blame if it fails
        self.admissions = admissions
        self.cancellations = cancellations
        self.future: asyncio.Future[StepOutcome] | None = None
        self.started: float | None = None  # set on the MLX thread when the step begins
        self._lock = threading.Lock()

    def run(self, runner: Any) -> StepOutcome:
        with self._lock:
            self.started = time.monotonic()
            admissions = list(self.admissions)
        return runner.step(admissions, self.cancellations)

    def add_admissions(self, requests: list[GenerationRequest]) -> bool:
        """Add requests to a step that has not begun; False if it has."""
        with self._lock:
            if self.started is not None:
                return False
            self.admissions.extend(requests)
            self.in_step.update(r.request_id for r in requests)
            return True
