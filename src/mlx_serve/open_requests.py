"""The actor's book of requests: which wait, which are open, which the runner has, which left.

Only the actor changes it. A request leaves it with exactly one terminal event on its
reply stream (``finish``), or silently once its client has gone (``take_departed``, or
while it waits).

The inbox is only the hand-off from the routes: the actor moves all of it into its own
waiting line at every step it launches, and a request whose client has gone leaves that
line there and then, so a client that gives up while queued does not keep its place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import KeysView, Sequence

import anyio

from mlx_serve.engine_state import check_admission
from mlx_serve.errors import EngineUnavailableError, OverloadedError
from mlx_serve.generation import Failure, GenerationRequest, ReplyEvent
from mlx_serve.reply_channel import ReplyChannel
from mlx_serve.request_handle import OpenRequest


class OpenRequests:
    def __init__(self, capacity: int) -> None:
        # Unbounded: admission is decided in ``queue`` on the requests still wanted,
        # which a channel's own bound cannot tell from the ones whose client has gone.
        self._send, self._inbox = anyio.create_memory_object_stream[OpenRequest](math.inf)
        self._capacity = capacity  # open and queued requests at most: batch + queue
        self._waiting: deque[OpenRequest] = deque()  # taken from the inbox, not yet open
        self._in_inbox: deque[OpenRequest] = deque()  # the inbox's entries, in its order
        self._open: dict[str, OpenRequest] = {}
        self._given: set[str] = set()  # open requests the runner has been given

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> KeysView[str]:
        return self._open.keys()

    def get(self, rid: str) -> OpenRequest | None:
        return self._open.get(rid)

    # -- the routes' side -----------------------------------------------------------

    def queue(self, reply: ReplyChannel[ReplyEvent], requests: Sequence[GenerationRequest]
              ) -> None:
        """Put requests into the inbox, or raise: 429 when the ones still wanted leave
        no room, 400 when they could never fit; anyio's errors once the inbox is closed."""
        check_admission(self.held, len(requests), self._capacity)
        if self.queued_entries >= 2 * self._capacity:  # departed ones not yet dropped
            raise OverloadedError("the server is at capacity; retry shortly")
        for request in requests:
            entry = OpenRequest(request, reply)
            self._send.send_nowait(entry)
            self._in_inbox.append(entry)

    def close_inbox(self) -> None:
        self._send.close()

    # -- the actor's side -----------------------------------------------------------

    @property
    def held(self) -> int:
        """Open and queued requests whose client is still there: a request whose client
        has gone gives its place back at once, not at the next step launched."""
        return sum(not entry.client_gone for entry in self._open.values()) + self.waiting

    @property
    def queued_entries(self) -> int:
        """Every queued entry, those whose client has gone included (until the next
        step launched drops them)."""
        return len(self._in_inbox) + len(self._waiting)

    @property
    def waiting(self) -> int:
        """Requests queued and not yet open whose client is still there."""
        return sum(1 for queue in (self._in_inbox, self._waiting)
                   for entry in queue if not entry.client_gone)

    async def next_queued(self) -> OpenRequest | None:
        """The next queued request (to ``open``), waiting for one; None once the inbox
        has ended."""
        if self._waiting:
            return self._waiting.popleft()
        try:
            return self._received(await self._inbox.receive())
        except anyio.EndOfStream:
            return None

    def _received(self, entry: OpenRequest) -> OpenRequest:
        self._in_inbox.popleft()  # the same entry: the inbox keeps the order it was given
        return entry

    def _take_inbox(self) -> None:
        """Move the inbox into the waiting line, dropping whoever has left it."""
        if not self._in_inbox and not self._waiting:  # most steps: nothing has arrived
            return
        while True:
            try:
                self._waiting.append(self._received(self._inbox.receive_nowait()))
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        if any(entry.client_gone for entry in self._waiting):
            for entry in self._waiting:
                if entry.client_gone:
                    entry.reply.close_producer()
            self._waiting = deque(e for e in self._waiting if not e.client_gone)

    def open(self, entry: OpenRequest, draining: bool) -> None:
        if entry.client_gone:
            entry.reply.close_producer()
        elif draining:
            answer(entry, Failure(EngineUnavailableError("the server is draining")))
        else:
            self._open[entry.request.request_id] = entry

    def take_new(self, limit: int | None, draining: bool) -> list[GenerationRequest]:
        """Open queued requests while fewer than ``limit`` are open (None: open none;
        draining: all, to answer them); return the open ones the runner lacks."""
        self._take_inbox()
        if limit is not None:
            while self._waiting and (len(self._open) < limit or draining):
                self.open(self._waiting.popleft(), draining)
        return [o.request for rid, o in self._open.items() if rid not in self._given]

    def given(self, requests: list[GenerationRequest]) -> None:
        """The runner has been handed these."""
        self._given.update(r.request_id for r in requests)

    def take_departed(self) -> list[str]:
        """Close and drop the requests whose client has gone; their ids, to cancel."""
        gone = [rid for rid, o in self._open.items() if o.client_gone]
        for rid in gone:
            self._open.pop(rid).reply.close_producer()
            self._given.discard(rid)
        return gone

    def in_batch(self, batch: frozenset[str] | None) -> set[str]:
        """The open requests a step runs (None: all); a fresh set, a step may add to it."""
        if batch is not None:
            return self._open.keys() & batch
        return set(self._open)

    def finish(self, rid: str, event: ReplyEvent) -> None:
        """The request's terminal event; nothing if it is no longer open."""
        entry = self._open.pop(rid, None)
        self._given.discard(rid)
        if entry is not None:
            answer(entry, event)

    def answer_queued(self, event: Failure) -> None:
        """Answer every queued request (the inbox must be closed or never refilled)."""
        while self._waiting:
            answer(self._waiting.popleft(), event)
        while True:
            try:
                entry = self._received(self._inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            answer(entry, event)


def answer(entry: OpenRequest, event: ReplyEvent) -> None:
    """Send a terminal event and close the reply stream; a departed client is fine."""
    if isinstance(event, Failure) and event.index != entry.request.index:
        event = Failure(event.error, entry.request.index)
    entry.reply.put(event, urgent=True)
    entry.reply.close_producer()
