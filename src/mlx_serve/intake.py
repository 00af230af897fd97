"""The event loop's share of preparing requests, paced: a time budget per turn of the loop.

Decoding a request's JSON, validating it and tokenizing a short prompt take 0.3-1.5 ms
of event-loop time, and a task runs until it first waits. A burst of 128 arrivals thus
did all of that in one turn of the loop, and whatever became ready meanwhile (a
``/health`` probe, the next chunk of every open stream) waited behind all of it: on a
two-core CPU host the loop stood still for up to 33-106 ms in such bursts, 10-17 ms
paced (benchmarks/README.md). Now each POST is admitted, and each piece of its
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
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

T = TypeVar("T")

# Text up to this many characters is rendered and tokenized on the event loop: that
# takes 0.1-0.5 ms, less than a worker-thread hop, which added about 1 ms to the time
# to first token under load. Longer text (a long prompt is CPU work) goes to a thread.
INLINE_TEXT_CHARS = 2048

# Event-loop time that preparation may use per turn of the loop.
TURN_BUDGET_S = 0.005


class Intake:
    """Admits preparation work on the event loop within a budget per turn of the loop.

    New requests wait in one line, more work of admitted requests in another that goes
    first. Waiters are woken a batch per turn, as many as fitted in the last full turn,
    so a burst costs each waiter about one wake-up rather than one per turn it waits.
    """

    def __init__(self, budget: float = TURN_BUDGET_S) -> None:
        self._budget = budget
        self._turn_started: float | None = None  # when this turn's first admission came
        self._admitted = 0  # in this turn
        self._fit = 1  # admissions that fitted in the last turn that ran out: a batch
        self._new: deque[asyncio.Future[None]] = deque()  # new requests
        self._ahead: deque[asyncio.Future[None]] = deque()  # admitted ones' further work
        self._woken = 0  # woken for the next turn, not yet resumed
        self.wakeups = 0  # every resumption of a waiter (for tests and diagnostics)

    async def admit(self) -> None:
        """A new request: return once a turn of the loop has budget left for it.

        At once unless in a burst. The first admission of a turn always goes; later ones
        go while less than the budget has passed since it (whatever ran meanwhile).
        """
        await self._enter(self._new)

    async def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop for an admitted request, within the budget."""
        await self._enter(self._ahead)
        return fn(*args)

    async def _enter(self, line: deque[asyncio.Future[None]]) -> None:
        waiting = self._woken or self._ahead or (line is self._new and self._new)
        if self._room() and not waiting:
            self._take()
            return
        loop = asyncio.get_running_loop()
        while True:
            if not self._room():
                self._fit = max(1, self._admitted)
            turn: asyncio.Future[None] = loop.create_future()
            line.append(turn)
            self._wake_batch()
            try:
                if turn.done():  # woken by its own call: the next turn is its turn
                    await asyncio.sleep(0)
                else:
                    await turn
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._woken -= 1  # woken, then cancelled: its place goes on
                    self._wake_batch()
                else:
                    line.remove(turn)
                raise
            self._woken -= 1
            self.wakeups += 1
            if self._room():
                self._take()
                return
            line = self._ahead  # woken too late for this turn: first in the next

    def _room(self) -> bool:
        return (self._turn_started is None
                or time.perf_counter() - self._turn_started < self._budget)

    def _take(self) -> None:
        if self._turn_started is None:
            self._turn_started = time.perf_counter()
            self._admitted = 0
            # A callback scheduled now runs at the start of the next turn, ahead of the
            # waiters woken after this: they find the budget fresh.
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._admitted += 1
        self._wake_batch()

    def _next_turn(self) -> None:
        self._turn_started = None

    def _wake_batch(self) -> None:
        """Unless a batch is on its way, wake the next one: it runs in the next turn."""
        if self._woken:
            return
        for _ in range(self._fit):
            line = self._ahead or self._new
            if not line:
                return
            line.popleft().set_result(None)
            self._woken += 1

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
