"""The one OS thread that runs every MLX call.

MLX streams are thread-local: an array built lazily on one thread cannot be evaluated on
another, and ``anyio.to_thread`` does not pin a thread. So model load, batch steps and
recovery all run here, one job at a time, and the event loop awaits their futures.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class MLXThread:
    def __init__(self, name: str = "mlx") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the MLX thread. Cancelling the await does not stop the job."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, *args)))

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end after its current job; wait up to ``timeout``."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting actor, never lost
                future.set_exception(exc)
