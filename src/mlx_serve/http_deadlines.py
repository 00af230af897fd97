"""Deadlines for what uvicorn does not bound: a request's head, and a client that takes
no more of its reply.

uvicorn's keep-alive timeout covers only a connection idle between requests, and any byte
received cancels it. A connection that sends nothing, or a request head that never ends
(one byte now and then: slowloris), is kept for ever, with its socket and its parser's
buffer. And a client that stops reading its reply (a stream it never reads) leaves the
reply's writes waiting for ever: the connection, the handler and, for a stream, its
request's place in the batch are held until the client goes.

``with_deadlines`` wraps uvicorn's HTTP protocol class with two deadlines:

- **head**: from a connection's start, or from the first byte of a next request on a
  kept-alive connection, to the end of that request's headers; then the connection is
  closed. A request whose headers have arrived is never cut by it (its body has
  ``--body-timeout``): when the deadline passes during a request, it is left alone.
- **send**: while the transport holds more unsent reply than its high-water mark (the
  client's socket buffers are full: it is not reading), writes wait; once they have
  waited this long the connection is aborted. Its request then sees the client gone, as
  if it had hung up: a stream's request is cancelled and its sequences leave the batch.

Relies on what uvicorn's HTTP protocols (httptools and h11) both keep: ``cycle`` (the
current request's cycle, replaced when a request's headers are complete),
``cycle.response_complete``, ``transport`` and ``loop``, and the transport's
``pause_writing``/``resume_writing`` calls; the methods are checked when the class is made.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import Any

log = logging.getLogger("mlx_serve")

_NEEDED = ("connection_made", "data_received", "connection_lost", "pause_writing",
           "resume_writing")


def uvicorn_protocol() -> type[asyncio.Protocol]:
    """The HTTP protocol class uvicorn's ``auto`` picks: httptools' if it is there."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def with_deadlines(base: type[asyncio.Protocol], head_timeout: float, send_timeout: float
                   ) -> type[asyncio.Protocol] | None:
    """``base`` with the head and send deadlines, in seconds; None when ``base`` lacks
    what they need (a uvicorn that changed)."""
    if not all(hasattr(base, name) for name in _NEEDED):
        log.warning("%s lacks %s: request heads and stalled replies are not timed",
                    base.__name__, _NEEDED)
        return None
    return type(f"Deadlines{base.__name__}", (DeadlinesMixin, base),
                {"head_deadline": head_timeout, "send_deadline": send_timeout})


class DeadlinesMixin:
    """The deadlines, before one of uvicorn's HTTP protocols in a class's bases (the
    attributes it reads are that protocol's)."""

    head_deadline: float
    send_deadline: float
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: Any

    def connection_made(self, transport: Any) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # a request's headers are complete
            self._head_timer = _cancelled(self._head_timer)
        elif self._head_timer is None and self._between_requests():
            self._arm_head()  # the first bytes of a next request's head

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._send_timer = _cancelled(self._send_timer)
        super().connection_lost(exc)  # type: ignore[misc]

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_deadline, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._send_timer = _cancelled(self._send_timer)

    def _send_expired(self) -> None:
        self._send_timer = None
        log.warning("aborted a connection from %s: its client took none of the reply "
                    "for %g s", _peer(self.transport), self.send_deadline)
        self.transport.abort()  # close() would wait to flush what the client won't take

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head(self) -> None:
        self._head_timer = self.loop.call_later(self.head_deadline, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return  # closed already, or a request is under way: its own bounds hold
        log.warning("closed a connection from %s: no complete request head within "
                    "%g s", _peer(self.transport), self.head_deadline)
        self.transport.close()


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if there is one; what the attribute that held it holds now."""
    if timer is not None:
        timer.cancel()
    return None


def _peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
