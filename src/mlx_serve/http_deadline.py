"""A deadline for a request's headers, which uvicorn does not bound.

uvicorn's keep-alive timeout covers only a connection idle between requests, and any byte
received cancels it. A connection that sends nothing, or a request head that never ends
(one byte now and then: slowloris), is kept for ever, with its socket and its parser's
buffer. ``with_head_deadline`` wraps uvicorn's HTTP protocol class so that such a
connection is closed once ``timeout`` seconds pass without a complete request head.

What it times: from a connection's start, or from the first byte of a next request on a
kept-alive connection, to the end of that request's headers. A request whose headers
have arrived is never cut by it (its body has ``--body-timeout``, its reply the engine's
own bounds): when the deadline passes during a request, the connection is left alone.

Relies on what uvicorn's HTTP protocols (httptools and h11) both keep: ``cycle`` (the
current request's cycle, replaced when a request's headers are complete),
``cycle.response_complete``, ``transport`` and ``loop``; their methods are checked when
the class is made.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import Any

log = logging.getLogger("mlx_serve")

_NEEDED = ("connection_made", "data_received", "connection_lost")


def uvicorn_protocol() -> type[asyncio.Protocol]:
    """The HTTP protocol class uvicorn's ``auto`` picks: httptools' if it is there."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def with_head_deadline(base: type[asyncio.Protocol], timeout: float
                       ) -> type[asyncio.Protocol] | None:
    """``base`` closing connections whose request head takes over ``timeout`` seconds;
    None when ``base`` lacks what the deadline needs (a uvicorn that changed)."""
    if not all(hasattr(base, name) for name in _NEEDED):
        log.warning("%s lacks %s: request heads are not timed", base.__name__, _NEEDED)
        return None

    class HeadDeadline(base):  # type: ignore[valid-type, misc]
        head_timeout = timeout

        def connection_made(self, transport: Any) -> None:
            self._head_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()
            elif self._head_timer is None and self._between_requests():
                self._arm()  # the first bytes of a next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or not self._between_requests():
                return  # closed already, or a request is under way: its own bounds hold
            log.warning("closed a connection from %s: no complete request head within "
                        "%g s", _peer(self.transport), self.head_timeout)
            self.transport.close()

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline


def _peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
