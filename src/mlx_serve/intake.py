"""The event loop's share of preparing requests, paced: a time budget per turn of the loop.

Decoding a request's JSON, validating it and tokenizing a short prompt take 0.3-1.5 ms
of event-loop time, and a task runs until it first waits. A burst of 128 arrivals thus
did all of that in one turn of the loop, and whatever became ready meanwhile (a
``/health`` probe, the next chunk of every open stream) waited behind all of it: on a
two-core CPU host the loop stood still for up to 36-106 ms in such bursts, 14-27 ms
with the budget (benchmarks/README.md). Now each POST is admitted, and each piece of its
preparation runs, only while less than ``budget`` has passed since the turn's first
admission. The rest waits for the next turn, after the loop has polled its sockets and
run its other ready tasks; there the tasks that waited are ahead of newer arrivals.

The budget is per turn, not per request. A turn of its own for every request (a zero
budget) also kept the loop responsive, but at 128 streams on an H200 host a turn takes
several milliseconds, and a burst of 256 requests took 1.6x as long. Long input goes to
a worker thread outside the budget: one long prompt never holds up the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from starlette.types import ASGIApp, Receive, Scope, Send

T = TypeVar("T")

# Text up to this many characters is rendered and tokenized on the event loop: that
# takes 0.1-0.5 ms, less than a worker-thread hop, which added about 1 ms to the time
# to first token under load. Longer text (a long prompt is CPU work) goes to a thread.
INLINE_TEXT_CHARS = 2048

# Event-loop time that preparation may use per turn of the loop.
TURN_BUDGET_S = 0.005


class Intake:
    """Admits preparation work on the event loop within a budget per turn of the loop."""

    def __init__(self, budget: float = TURN_BUDGET_S) -> None:
        self._budget = budget
        self._turn_started: float | None = None  # when this turn's first admission came

    async def admit(self) -> None:
        """Return once this turn of the loop has budget left: at once, unless in a burst.

        The first admission of a turn always goes; later ones go while less than the
        budget has passed since it. The time counts whatever ran meanwhile.
        """
        while (self._turn_started is not None
               and time.perf_counter() - self._turn_started >= self._budget):
            await anyio.lowlevel.checkpoint()
        if self._turn_started is None:
            self._turn_started = time.perf_counter()
            # A callback scheduled now runs at the start of the next turn, ahead of the
            # tasks that wait after this one: they find the budget fresh.
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_started = None

    async def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop, once this turn's budget allows it."""
        await self.admit()
        return fn(*args)

    async def by_size(self, chars: int | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop for short input; in a worker thread otherwise.

        ``chars`` None: the input's size is not known cheaply, so it goes to a thread.
        """
        if chars is not None and chars <= INLINE_TEXT_CHARS:
            return await self.on_loop(fn, *args)
        return await anyio.to_thread.run_sync(fn, *args)


class IntakeGate:
    """ASGI middleware: each POST waits for budget before anything else is done for it.

    A burst's per-request work before the endpoint (routing, the request objects) is
    then spread over turns of the loop as well.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            state = getattr(scope["app"].state, "server", None)
            if state is not None:
                await state.intake.admit()
        await self.app(scope, receive, send)
