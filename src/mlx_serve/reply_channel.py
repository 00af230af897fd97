"""One request's reply events: the actor puts without ever waiting, the route awaits.

A memory object stream would do, but it costs an extra trip through the event loop
for every token of every stream (``receive`` always checkpoints first); at 128
streams that is the event loop's time that the batch step needs.

Several producers may share a channel (the choices of one HTTP request): it ends for
the consumer once every producer has closed its side. With ``wake_every=N`` the consumer
is woken by the first item and then only once N items wait (or the channel ends): a
stream that writes every N tokens costs the event loop one wake-up per N steps, and a
whole (non-streamed) reply, ``wake_every=None``, none until it is complete. The
consumer closing the channel is how the actor learns that the client is gone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class ReplyChannel(Generic[T]):
    __slots__ = ("_items", "_waiter", "_producers", "_consumer_gone", "_wake_every",
                 "_woken")

    def __init__(self, producers: int = 1, wake_every: int | None = 1) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._producers = producers
        self._consumer_gone = False
        self._wake_every = wake_every
        self._woken = False  # the first item always wakes (time to first token)

    # -- producers (the actor) -------------------------------------------------------

    @property
    def consumer_gone(self) -> bool:
        return self._consumer_gone

    def put(self, item: T, urgent: bool = False) -> None:
        """Queue an item; dropped silently once the consumer has gone.

        ``urgent`` wakes the consumer whatever ``wake_every`` says (a terminal event).
        """
        if not self._consumer_gone:
            self._items.append(item)
            if urgent or not self._woken or (self._wake_every is not None
                                             and len(self._items) >= self._wake_every):
                self._woken = True
                self._wake()

    def close_producer(self) -> None:
        self._producers -= 1
        if self._producers <= 0:
            self._wake()

    # -- the consumer (the route) ----------------------------------------------------

    async def peek(self) -> T | None:
        """The next item without taking it; None when the channel has ended."""
        while not self._items:
            if self._producers <= 0 or self._consumer_gone:
                return None
            try:
                await self._waiter_future()
            finally:
                self._waiter = None
        return self._items[0]

    def __aiter__(self) -> ReplyChannel[T]:
        return self

    async def __anext__(self) -> T:
        while not self._items:
            if self._producers <= 0 or self._consumer_gone:
                raise StopAsyncIteration
            # The future is awaited here, not in a coroutine of its own: one coroutine
            # less to make and resume for every token a stream waits for.
            try:
                await self._waiter_future()
            finally:
                self._waiter = None
        return self._items.popleft()

    @property
    def ended(self) -> bool:
        """Nothing queued and nothing more to come: the next ``__anext__`` stops."""
        return not self._items and (self._producers <= 0 or self._consumer_gone)

    def take_ready(self) -> list[T]:
        """Every item already queued, without waiting."""
        items = list(self._items)
        self._items.clear()
        return items

    def close(self) -> None:
        self._consumer_gone = True
        self._items.clear()
        self._wake()

    def _waiter_future(self) -> asyncio.Future[None]:
        """The future the consumer awaits until ``_wake`` (it resets ``_waiter`` after)."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
