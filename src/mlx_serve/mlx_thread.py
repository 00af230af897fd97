"""The one OS thread that runs every MLX call.

MLX streams are thread-local: an array built lazily on one thread cannot be evaluated on
another, and ``anyio.to_thread`` does not pin a thread. So model load, batch steps and
recovery all run here, one job at a time. The event loop awaits the futures of
``call``; a batch step, posted without one, reports its outcome to the loop itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


class MLXThread:
    def __init__(self, name: str = "mlx", nice: int = 0,
                 on_exit: Callable[[], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._nice = nice
        self._on_exit = on_exit  # runs on this thread, after its last job
        # Seconds spent in finished jobs. Beside wall time it tells a thread kept busy
        # (stepping at the engine's pace) from one waiting for its next step.
        self.busy_seconds = 0.0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The OS thread id (for ``/proc``), once the thread has started."""
        return self._thread.native_id

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn`` with no future: it reports its own result (the per-step path).

        A concurrent ``Future`` costs a lock, a condition and a chained asyncio future per
        job; a batch step reports straight to the event loop instead (see EngineStep).
        """
        self._jobs.put((None, fn, args))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the MLX thread. Cancelling the await does not stop the job."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, *args)))

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end after its current job (and ``on_exit``); wait up to
        ``timeout``."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)

    def _serve(self) -> None:
        name_os_thread(self._thread.name)
        if self._nice:
            set_thread_nice(self._nice)
        while True:
            job = self._jobs.get()
            if job is _STOP:
                self._exit()
                return
            future, fn, args = job
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting actor, never lost
                result, error = None, exc
            # Counted before the result is handed back, so a caller sees its job in it.
            self.busy_seconds += time.perf_counter() - started
            _hand_back(future, result, error)

    def _exit(self) -> None:
        if self._on_exit is None:
            return
        try:
            self._on_exit()
        except Exception:
            log.exception("the MLX thread's exit job failed")


def _hand_back(future: Future[Any] | None, result: Any, error: BaseException | None) -> None:
    """A job's outcome to its future; a posted job (no future) reports its own faults."""
    if future is None:
        if error is not None:  # it escaped the job's own reporting
            log.error("a job on the MLX thread failed", exc_info=error)
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def set_thread_nice(nice: int) -> None:
    """Give the calling thread niceness ``nice``; threads it starts later (MLX's compute
    and BLAS workers) inherit it. On Linux niceness is per thread; elsewhere it would
    apply to the whole process, so it is left alone there.

    On two shared vCPUs the MLX thread waited 0.2-2.8 ms a step for a core that the
    event loop or the load generator held (benchmarks/MEASUREMENTS.md); a lower
    niceness puts the batch step first. Best effort: without the privilege to lower it,
    a warning and the default."""
    if not sys.platform.startswith("linux"):
        log.warning("mlx_thread_nice is applied on Linux only; ignored")
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # 0: the calling thread, on Linux
    except OSError as exc:
        log.warning("could not set the MLX thread's niceness to %d (%s); it keeps %d",
                    nice, exc, os.getpriority(os.PRIO_PROCESS, 0))
    else:
        log.info("MLX thread niceness %d", nice)


_PR_SET_NAME = 15  # linux/prctl.h


def name_os_thread(name: str) -> None:
    """Give the calling OS thread ``name`` (Linux, 15 bytes at most), so that ``top -H``,
    ``ps -L`` and ``/proc/PID/task/*/comm`` tell the MLX thread apart from the event loop.
    Threads it starts later (MLX's own workers) inherit the name. Python names only its
    own view of a thread before 3.14. Best effort."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the name is only a convenience
        pass
