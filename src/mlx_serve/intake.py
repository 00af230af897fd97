"""The event loop's share of preparing requests, paced: one request per turn of the loop.

Decoding a request's JSON, validating it and tokenizing a short prompt take 0.3-1.5 ms
of event-loop time, and a task runs until it first waits. A burst of 128 arrivals thus
ran all of its preparation in one turn of the loop, and whatever became ready meanwhile
(a ``/health`` probe, the next chunk of every open stream) waited behind all of it.
Each piece of that work now passes through one lock. Taking it yields to the loop even
when it is free, and a release hands it to the next waiter for the following turn, so
the loop polls its sockets and runs its other ready tasks between any two requests'
preparation. Long input goes to a worker thread without the lock: one long prompt never
holds up the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

# Text up to this many characters is rendered and tokenized on the event loop: that
# takes 0.1-0.5 ms, less than a worker-thread hop, which added about 1 ms to the time
# to first token under load. Longer text (a long prompt is CPU work) goes to a thread.
INLINE_TEXT_CHARS = 2048


class Intake:
    """Runs preparation work on the event loop one call per loop turn, or in a thread."""

    def __init__(self) -> None:
        # fast_acquire=False: taking the lock yields to the loop even when it is free.
        self._turn = anyio.Lock(fast_acquire=False)

    async def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop, in a turn of the loop of its own."""
        async with self._turn:
            return fn(*args)

    async def by_size(self, chars: int | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop for short input; in a worker thread otherwise.

        ``chars`` None: the input's size is not known cheaply, so it goes to a thread.
        """
        if chars is not None and chars <= INLINE_TEXT_CHARS:
            return await self.on_loop(fn, *args)
        return await anyio.to_thread.run_sync(fn, *args)
