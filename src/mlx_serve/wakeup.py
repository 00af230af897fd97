"""The actor's one way to sleep: until something it waits for wakes it, or a deadline.

A finished step (reported from the MLX thread through ``call_soon_threadsafe``),
``abort()``, an arrival while a queued step can still take it, and a step's deadline all
resolve the same future. Waiting on several futures at once (``asyncio.wait``) or
arming a timer per step costs the event loop on every token.
"""

from __future__ import annotations

import asyncio
import time


class Wakeup:
    __slots__ = ("_loop", "_waiter", "_timer", "_timer_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    async def sleep(self, deadline: float | None) -> None:
        """Until ``wake()``, or by ``deadline`` (``time.monotonic()``), maybe sooner.

        A caller re-checks what it waits for after every return.
        """
        self._arm(deadline)
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        """Resolve the current sleep, if any (on the event loop)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, deadline: float | None) -> None:
        """One timer serves many steps: deadlines only move later, so a timer already set
        for an earlier one is kept; when it fires, the sleeper finds its step done or not
        yet due and sleeps again, which sets the next."""
        if deadline is None or (self._timer is not None and self._timer_at <= deadline):
            return
        self.close()
        self._timer_at = deadline
        self._timer = self._loop.call_later(max(deadline - time.monotonic(), 0.0), self._fired)

    def _fired(self) -> None:
        self._timer = None
        self.wake()
