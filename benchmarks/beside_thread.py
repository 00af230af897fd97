"""A thread that takes the interpreter lock in short bursts, as a server's event loop does.

In a server the stepping thread shares the interpreter lock with the event loop, which
wakes for every batch of tokens, runs a burst of Python (parsing, framing, socket
writes) and sleeps in ``epoll`` again. ``BesideThread`` does the same with no server in
the way: every ``period_ms`` it runs ``work_us`` of pure Python, then sleeps. The engine
harness runs one beside its stepping thread when a job asks (``benchmarks.neighbours``'s
``thread:W/P``), so that what such bursts cost a step can be read apart from HTTP.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class BesideThread:
    def __init__(self, work_us: float, period_ms: float) -> None:
        self.work_s, self.period_s = work_us / 1e6, period_ms / 1e3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beside", daemon=True)
        self.bursts = 0
        self.busy_s = 0.0

    def __enter__(self) -> BesideThread:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.elapsed_s = time.perf_counter() - self._started

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            began = time.perf_counter()
            end = began + self.work_s
            while time.perf_counter() < end:
                x = (x * 7 + 1) % 1000003
            self.busy_s += time.perf_counter() - began
            self.bursts += 1
            self._stop.wait(self.period_s)  # sleeps without the lock, as in epoll

    def record(self) -> dict[str, Any]:
        """How much of the run the thread spent in its bursts (the lock's share it took)."""
        elapsed = getattr(self, "elapsed_s", 0.0)
        return {"work_us": self.work_s * 1e6, "period_ms": self.period_s * 1e3,
                "bursts": self.bursts,
                "busy_share": round(self.busy_s / elapsed, 4) if elapsed else None}
