"""The two ends of a request's reply channel: the route's handle, the actor's entry."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mlx_serve.generation import GenerationRequest, ReplyEvent
from mlx_serve.reply_channel import ReplyChannel


class RequestHandle:
    """The route's end of one request: iterate its events; close it when the client goes."""

    def __init__(self, request_id: str, events: ReplyChannel[ReplyEvent]) -> None:
        self.request_id = request_id
        self._events = events

    async def peek(self) -> ReplyEvent | None:
        """Wait for the first event without consuming it (None: the stream ended)."""
        return await self._events.peek()

    def __aiter__(self) -> AsyncIterator[ReplyEvent]:
        return self._events

    def take_ready(self) -> list[ReplyEvent]:
        """The events already queued, without waiting (to write them out together)."""
        return self._events.take_ready()

    @property
    def ended(self) -> bool:
        """Every event taken and the request over: no more will come."""
        return self._events.ended

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closing tells the actor the client is gone; it drops the request next step."""
        self._events.close()


class OpenRequest:
    """The actor's record of one open request: what to run and where to answer."""

    __slots__ = ("request", "reply")

    def __init__(self, request: GenerationRequest, reply: ReplyChannel[ReplyEvent]):
        self.request = request
        self.reply = reply

    @property
    def client_gone(self) -> bool:
        return self.reply.consumer_gone
