"""What stood still inside a server process: its event loop, its interpreter lock, its GC.

A /health probe from outside measures the server, the network and, on a small host, the
probe's own wait for a core. To tell them apart, ``with_stall_log(env)`` puts
``benchmarks/stall_log`` (a ``sitecustomize``) on an mlx_serve process's PYTHONPATH, and
the process then logs to its stderr, one line each:

- ``loop``: the event loop ran a 1 ms timer more than 10 ms late (it was busy);
- ``lock``: a plain thread sleeping 1 ms got the interpreter lock back more than 10 ms
  late (a C call or a collection held it);
- ``gc``: a garbage collection took more than 3 ms (the generation is in the line);
- ``watching``: once, at start;
- with ``STALL_TRACES=1`` (``with_stall_log(env, traces=True)``) also ``loop-trace``,
  the event loop thread's stack during a loop stall; with ``STALL_TRACES=all`` also
  faulthandler's dump of every thread during a lock stall. That dump reads the other
  threads' frames without the lock and can crash a busy process (it did, at start-up,
  on a CUDA host), so it is asked for on its own.

``read_stalls(log, start, end)`` sums up the lines of a time window (wall clock).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

STALL_LOG_DIR = Path(__file__).resolve().parent / "stall_log"
MARK = "mlx-serve-stall"
LATE_S = 0.010  # a 1 ms wait this much late is a stall
GC_S = 0.003


def _log(kind: str, seconds: float, detail: str = "") -> None:
    # One write per line: threads' lines must not interleave.
    sys.stderr.write(f"{MARK} {time.time():.4f} {kind} {seconds * 1e3:.1f} {detail}\n")
    sys.stderr.flush()


def with_stall_log(env: dict[str, str], traces: bool = False) -> dict[str, str]:
    """``env`` with the stall log's directory and this checkout first on PYTHONPATH.

    ``traces``: each stall also logs where it happened (``TRACES_ENV``; a value that
    ``env`` already holds, such as "all", is kept)."""
    root = str(STALL_LOG_DIR.parent.parent)
    rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join(p for p in (str(STALL_LOG_DIR), root, rest) if p)
    return {**env, "PYTHONPATH": path, **({TRACES_ENV: env.get(TRACES_ENV, "1")} if traces else {})}


# With this set to 1, a loop stall logs the event loop thread's stack as seen from
# another thread once it is 10 ms late. Set to "all", a lock stall also makes faulthandler
# dump every thread's stack (from its own thread, which needs no lock) once 15 ms have
# passed: the thread holding the lock is the one inside a call into C.
TRACES_ENV = "STALL_TRACES"
_heartbeat = [0.0]


async def watch_loop(late: float = LATE_S) -> None:
    """Log every time the running loop wakes a 1 ms sleep more than ``late`` late."""
    import anyio

    while True:
        start = _heartbeat[0] = time.perf_counter()
        await anyio.sleep(0.001)
        behind = time.perf_counter() - start - 0.001
        if behind > late:
            _log("loop", behind)


def trace_loop(thread_id: int, late: float, stop: threading.Event) -> None:
    """Log the loop thread's stack once per stall, while it is late; until ``stop``."""
    import traceback

    traced = 0.0
    while not stop.wait(0.002):
        beat = _heartbeat[0]
        if beat and beat != traced and time.perf_counter() - beat > late:
            traced = beat
            frame = sys._current_frames().get(thread_id)
            stack = "".join(traceback.format_stack(frame, limit=12)) if frame else "?"
            _log("loop-trace", time.perf_counter() - beat,
                 "\n" + "\n".join("    " + line for line in stack.splitlines()))


def watch_lock(late: float, dumps: bool, stop: threading.Event) -> None:
    """Log every time this thread gets the interpreter lock back ``late``; until ``stop``."""
    import faulthandler

    while not stop.is_set():
        start = time.perf_counter()
        if dumps:
            faulthandler.dump_traceback_later(late + 0.005, file=sys.stderr)
        time.sleep(0.001)
        if dumps:
            faulthandler.cancel_dump_traceback_later()
        behind = time.perf_counter() - start - 0.001
        if behind > late:
            _log("lock", behind)


def _gc_callback() -> Callable[[str, dict[str, Any]], None]:
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) > GC_S:
            _log("gc", took, f"gen{info['generation']}")
    return callback


def install() -> None:
    """Start the three watches in this process (mlx_serve's app runs the loop's)."""
    _log("watching", 0.0)
    traces = os.environ.get(TRACES_ENV)  # None, "1" (the loop's stack) or "all"
    gc.callbacks.append(_gc_callback())
    never = threading.Event()  # the watches last as long as the process
    threading.Thread(target=watch_lock, args=(LATE_S, traces == "all", never), daemon=True,
                     name="stall-lock-watch").start()
    if traces in ("1", "all"):  # uvicorn runs the event loop in the main thread
        threading.Thread(target=trace_loop, args=(threading.main_thread().ident, LATE_S,
                                                  never),
                         daemon=True, name="stall-loop-trace").start()
    import anyio

    import mlx_serve.app as app_module

    create_app = app_module.create_app

    def create_watched_app(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        lifespan = app.router.lifespan_context

        @asynccontextmanager
        async def watched(app_: Any) -> AsyncIterator[None]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_loop)
                async with lifespan(app_):
                    yield
                tg.cancel_scope.cancel()

        app.router.lifespan_context = watched
        return app

    app_module.create_app = create_watched_app


def read_stalls(log: Path, start: float, end: float) -> dict[str, Any]:
    """The stall lines of ``log`` between two wall-clock times: count and worst per kind
    (ms), every collection as ``gen2 12.5``, and whether the process was watched at all."""
    out: dict[str, Any] = {"watched": False, "loop_max_ms": 0.0, "loop_count": 0,
                           "lock_max_ms": 0.0, "lock_count": 0, "gc": []}
    for line in log.read_text(errors="replace").splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[0] != MARK:
            continue
        out["watched"] = out["watched"] or fields[2] == "watching"
        if not start <= float(fields[1]) <= end:
            continue
        kind, ms = fields[2], float(fields[3])
        if kind == "gc":
            out["gc"].append(f"{fields[4] if len(fields) > 4 else '?'} {ms:.1f}")
        elif kind in ("loop", "lock"):
            out[f"{kind}_count"] += 1
            out[f"{kind}_max_ms"] = max(out[f"{kind}_max_ms"], ms)
    return out


def describe_stalls(stalls: dict[str, Any] | None) -> str:
    if not stalls:
        return ""
    gcs = ",".join(stalls["gc"]) or "-"
    return (f"stalls: loop {stalls['loop_max_ms']:.1f} ms (x{stalls['loop_count']}) "
            f"lock {stalls['lock_max_ms']:.1f} ms (x{stalls['lock_count']}) gc {gcs}")
