"""The actor's book of open requests: which are open, which the runner has, which left.

Only the actor touches it. A request leaves it with exactly one terminal event on its
reply stream (``finish``), or silently once its client has gone (``take_departed``).
"""

from __future__ import annotations

from collections.abc import KeysView

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from mlx_serve.errors import EngineUnavailableError
from mlx_serve.generation import Failure, GenerationRequest, ReplyEvent
from mlx_serve.request_handle import OpenRequest


class OpenRequests:
    def __init__(self, inbox: MemoryObjectReceiveStream[OpenRequest]) -> None:
        self._inbox = inbox
        self._open: dict[str, OpenRequest] = {}
        self._given: set[str] = set()  # open requests the runner has been given

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> KeysView[str]:
        return self._open.keys()

    def get(self, rid: str) -> OpenRequest | None:
        return self._open.get(rid)

    @property
    def waiting(self) -> int:
        """Requests still in the inbox."""
        return self._inbox.statistics().current_buffer_used

    async def next_queued(self) -> OpenRequest | None:
        """Wait for the inbox's next request (to ``open``); None once the inbox has ended."""
        try:
            return await self._inbox.receive()
        except anyio.EndOfStream:
            return None

    def open(self, entry: OpenRequest, draining: bool) -> None:
        if entry.client_gone:
            entry.reply.close_producer()
        elif draining:
            answer(entry, Failure(EngineUnavailableError("the server is draining")))
        else:
            self._open[entry.request.request_id] = entry

    def take_new(self, limit: int | None, draining: bool) -> list[GenerationRequest]:
        """Open inbox requests while fewer than ``limit`` are open (None: take none;
        draining: take all, to answer them); return the open ones the runner lacks."""
        if limit is not None:
            while len(self._open) < limit or draining:
                try:
                    self.open(self._inbox.receive_nowait(), draining)
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
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
        """Answer every request still in the inbox (it must be closed or never refilled)."""
        while True:
            try:
                entry = self._inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            answer(entry, event)


def answer(entry: OpenRequest, event: ReplyEvent) -> None:
    """Send a terminal event and close the reply stream; a departed client is fine."""
    if isinstance(event, Failure) and event.index != entry.request.index:
        event = Failure(event.error, entry.request.index)
    entry.reply.put(event, urgent=True)
    entry.reply.close_producer()
