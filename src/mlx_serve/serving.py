"""Running the app under uvicorn with Kubernetes-style draining on SIGTERM/SIGINT.

uvicorn's own shutdown stops listening at once, so a readiness probe could never see a
"draining" state, and it re-raises the signal afterwards (exit status 143). Here the
first SIGTERM (or Ctrl+C) only starts draining: admission closes, ``/health`` answers
503 ``draining`` while ``/live`` stays 200, in-flight requests finish (up to
``drain_timeout``, then they get a terminal error), and only then does uvicorn shut
down; the process exits 0. A second signal gives every request still in flight its
terminal error at once and shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from mlx_serve.app import drain_engine

log = logging.getLogger(__name__)

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, drain_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_timeout = drain_timeout
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        state = getattr(self._app.state, "server", None)
        if state is not None:
            state.request_exit = self.request_exit

    def request_exit(self, code: int) -> None:
        """Shut down as after a drain, then exit with ``code``."""
        self.exit_code = code
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Like uvicorn's, minus re-raising the signal afterwards: a drained shutdown
        # is a clean exit.
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in DRAIN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self._app.state, "server", None)
        if state is None or self._loop is None:
            self.should_exit = True  # nothing to drain: stop now
        elif self._draining:
            self._loop.call_soon_threadsafe(self._stop_now)
        else:
            self._draining = True
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    def _stop_now(self) -> None:
        """A second signal: every request still in flight gets its terminal error now (a
        stream its error event and [DONE]), then the server stops. Stopping without it
        left uvicorn to cut the streams off mid-reply once its shutdown timeout passed."""
        log.warning("second signal: aborting the requests still in flight and stopping")
        state = self._app.state.server
        state.engine.abort()
        state.drained = state.stop_now = True
        self.should_exit = True

    async def _drain(self) -> None:
        state = self._app.state.server
        log.info("draining: admission closed, waiting up to %.0f s for in-flight requests",
                 self._drain_timeout)
        # An engine that did not end: nothing more to wait for, stop as at a 2nd signal.
        state.stop_now = not await drain_engine(state.engine, self._drain_timeout)
        state.drained = True
        self.should_exit = True
