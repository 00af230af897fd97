"""Deadlines and bounds for what uvicorn does not bound: a request's head (its time and
its size), a client that takes no more of its reply, and the pipelined requests of a
client that has gone.

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
  client's socket buffers are full: it is not reading), writes wait; once the client has
  taken nothing of the reply for this long the connection is aborted. Its request then
  sees the client gone, as if it had hung up: a stream's request is cancelled and its
  sequences leave the batch. A client that reads, however slowly, is not cut: each
  deadline that finds the unsent reply smaller than before sets the next one.

And two bounds, and one repair:

- **head size**: a request head over ``MAX_HEAD_BYTES`` is answered 431 and the
  connection closed, as h11 does at 16 KiB. httptools has no limit: a head that never
  ends took hundreds of megabytes within the head deadline, and its parser's growing
  header value held the event loop for seconds at a time.
- **trailer fields**: a chunked body's trailer section is bounded by the same
  ``MAX_HEAD_BYTES``, and its fields are dropped (RFC 9110 lets a recipient discard
  them). httptools hands them to uvicorn as more header fields, which appended them to
  the request's headers without end: the body's own bound never saw them.
- **pipelined requests**: httptools marks only the newest request of a connection
  disconnected when it is lost, so a pipelined request under way went on (holding its
  place in the batch) until it wrote to the closed transport and failed there. Every
  request of the connection not yet answered is marked gone.
- **h2c**: a head that offers an upgrade to HTTP/2 over cleartext has its ``Upgrade``
  header renamed before uvicorn's parser sees it, which declines the offer; httptools
  otherwise lost the request's body.

Relies on what uvicorn's HTTP protocols (httptools and h11) both keep: ``cycle`` (the
current request's cycle, replaced when a request's headers are complete), the cycle's
``response_complete``, ``more_body``, ``disconnected`` and ``message_event``,
``transport`` and ``loop``, and the transport's ``pause_writing``/``resume_writing``
calls; httptools' ``on_message_begin``, ``on_header`` and ``on_headers_complete``
callbacks (h11 calls none of them: it bounds trailers itself, at 16 KiB); the methods
are checked when the class is made.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re
import struct
import sys
from typing import Any

from mlx_serve.errors import RequestError

log = logging.getLogger("mlx_serve")

_NEEDED = ("connection_made", "data_received", "connection_lost", "pause_writing",
           "resume_writing")
MAX_HEAD_BYTES = 65536
_LINGER_S = 1.0  # for a refused head's answer to reach its client
# An offer to upgrade to HTTP/2 over cleartext (``curl --http2`` on http://): httptools
# stops parsing at such a head and uvicorn drops what follows it, the body, so the
# request read as empty. Renamed, the offer is declined, as RFC 9110 lets a server do.
_H2C_UPGRADE = re.compile(rb"(?im)^upgrade(\s*:\s*h2c\s*\r?$)")
if sys.platform == "linux":  # the send queue's size in bytes (SIOCOUTQ)
    import fcntl
    import termios

    _SEND_QUEUE: int | None = termios.TIOCOUTQ
else:
    _SEND_QUEUE = None
_HEAD_TOO_LARGE = json.dumps(RequestError(
    f"the request head is over {MAX_HEAD_BYTES} bytes",
    code="request_header_fields_too_large").to_dict()).encode()
_TRAILERS_TOO_LARGE = json.dumps(RequestError(
    f"the request's trailer fields are over {MAX_HEAD_BYTES} bytes",
    code="request_header_fields_too_large").to_dict()).encode()


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
        self._unsent = 0  # the unsent reply's size when the send deadline was set
        self._head_bytes = 0  # of the head under way
        self._refused = False
        self._in_head = True  # httptools' header fields are the head's, not trailers
        self._trailer_bytes = 0
        self._unanswered: list[Any] = []  # this connection's request cycles
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._between_requests():
            if b"h2c" in data:  # not scanning bodies
                head, end, rest = data.partition(b"\r\n\r\n")  # the body is left alone
                data = _H2C_UPGRADE.sub(rb"x-declined-upgrade\1", head) + end + rest
            if self.cycle is None or not self.cycle.more_body:  # not a body answered early
                # Counted before the parser sees it: the read that completes a head
                # counts up to the head's end (the rest is its body).
                end_at = data.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end_at < 0 else end_at + 4
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse_head()
                    return
        cycle = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # a request's headers are complete
            self._head_timer = _cancelled(self._head_timer)
            self._head_bytes = 0
            self._track(self.cycle)
        elif self._between_requests() and self._head_timer is None:
            self._arm_head()  # the first bytes of a next request's head

    def on_message_begin(self) -> None:
        """httptools' callback, as each request's head begins."""
        self._in_head, self._trailer_bytes = True, 0
        super().on_message_begin()  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        """httptools' callback for a field of the head, or, after a chunked body, of its
        trailer section: those are counted, bounded and dropped."""
        if self._in_head:
            super().on_header(name, value)  # type: ignore[misc]
            return
        self._trailer_bytes += len(name) + len(value) + 4
        if self._trailer_bytes <= MAX_HEAD_BYTES or self._refused:
            return
        cycle = self.cycle
        answer = cycle is None or not cycle.response_started
        if cycle is not None:  # its handler sees its client gone; its writes go nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(f"its request's trailer fields passed {MAX_HEAD_BYTES} bytes",
                     _TRAILERS_TOO_LARGE, answer)

    def on_headers_complete(self) -> None:
        """httptools' callback, for each head of a pipelined write (h11 has none: it
        reads a next request only once the one before is answered)."""
        self._in_head = False
        super().on_headers_complete()  # type: ignore[misc]
        self._track(self.cycle)

    def _track(self, cycle: Any) -> None:
        if cycle is not None and (not self._unanswered or self._unanswered[-1] is not cycle):
            self._unanswered = [c for c in self._unanswered if not c.response_complete]
            self._unanswered.append(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._send_timer = _cancelled(self._send_timer)
        for cycle in self._unanswered:  # the running one and those pipelined behind it
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)  # type: ignore[misc]

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            self._arm_send()

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self._send_timer = _cancelled(self._send_timer)

    def _arm_send(self) -> None:
        self._unsent = self._untaken()
        self._send_timer = self.loop.call_later(self.send_deadline, self._send_expired)

    def _untaken(self) -> int:
        """Reply bytes the client has not taken: the transport's buffer and, where the
        system tells (Linux), the socket's send queue. The socket is only reported
        writable again once a third of its send buffer (megabytes) has drained, so a
        slow reader shows its progress there first."""
        size = int(self.transport.get_write_buffer_size())
        sock = self.transport.get_extra_info("socket")
        if _SEND_QUEUE is not None and sock is not None:
            try:
                size += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SEND_QUEUE, b"\0" * 4))[0]
            except OSError:
                pass
        return size

    def _send_expired(self) -> None:
        self._send_timer = None
        if self._untaken() < self._unsent:
            self._arm_send()  # the client took some: it reads, if slowly
            return
        log.warning("aborted a connection from %s: its client took none of the reply "
                    "for %g s", _peer(self.transport), self.send_deadline)
        self.transport.abort()  # close() would wait to flush what the client won't take

    def _refuse_head(self) -> None:
        self._refuse(f"its request head passed {MAX_HEAD_BYTES} bytes", _HEAD_TOO_LARGE)

    def _refuse(self, why: str, body: bytes, answer: bool = True) -> None:
        """Answer 431 (unless a response has begun), take nothing more, close."""
        self._refused = True
        self._head_timer = _cancelled(self._head_timer)
        log.warning("closed a connection from %s: %s", _peer(self.transport), why)
        if not answer:
            self.transport.abort()
            return
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Closed with the client's bytes unread, the socket would be reset, and the reset
        # can overtake the answer: end the writing side, drop what still comes (a second
        # at most), then close.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)

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
