"""Poll ``GET /health`` from a separate process while a load runs.

The probe must not share an event loop (or an interpreter lock) with the load
generator: at a hundred streams the generator's own loop lags by tens of milliseconds,
and a probe inside it would report that lag as the server's. A small child process
with blocking sockets measures only the server and the network. It polls until its
standard input closes, then prints its samples as JSON.

Where it may, the child runs under the real-time scheduler (``SCHED_FIFO``, lowest
priority; it sleeps between probes and blocks on its socket, so it takes a vCPU only to
probe). On a machine whose vCPUs are all busy (two vCPUs shared by a server's stepping
thread, its event loop and the load generator) an ordinary child waits its turn for a
vCPU: at 16 streams on the tiny model about one short run in five read one answer of
34-91 ms that way, while a real-time prober beside it read at most 8.9 ms. The priority
it got is reported (``HealthProbe.priority``: "fifo" or "normal").

    python -m benchmarks.health_probe http://127.0.0.1:8000 0.2
"""

from __future__ import annotations

import http.client
import json
import os
import select
import subprocess
import sys
import time
from urllib.parse import urlsplit


def raise_priority() -> str:
    """Run this process under ``SCHED_FIFO`` if allowed: "fifo", else "normal"."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, OSError):  # not Linux, or not permitted
        return "normal"
    return "fifo"


def probe_until_stdin_closes(base_url: str, interval: float) -> list[tuple[float, bool]]:
    url = urlsplit(base_url)
    samples: list[tuple[float, bool]] = []
    print(f"ready {raise_priority()}", flush=True)
    while True:  # one probe at once, then one per interval until stdin closes
        start = time.perf_counter()
        try:  # a fresh connection each time, as a Kubernetes probe makes
            conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port,
                                              timeout=10.0)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
        except OSError:
            ok = False
        samples.append((time.perf_counter() - start, ok))
        if select.select([sys.stdin], [], [], interval)[0]:
            return samples


class HealthProbe:
    """``start()`` the child (returns once it polls); ``stop()`` returns its samples."""

    def __init__(self, base_url: str, interval: float) -> None:
        self._command = [sys.executable, "-m", "benchmarks.health_probe", base_url,
                         str(interval)]
        self._process: subprocess.Popen[str] | None = None
        self.priority = "normal"  # the scheduling the child got: "fifo" or "normal"

    def start(self) -> None:
        self._process = subprocess.Popen(self._command, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        # "ready PRIORITY": imports done, polling begins.
        words = self._process.stdout.readline().split()
        self.priority = words[1] if len(words) == 2 else "normal"

    def stop(self, timeout: float = 15.0) -> list[tuple[float, bool]]:
        """The samples (latency in seconds, success); [] if the child was lost."""
        if self._process is None:
            return []
        try:
            out, _ = self._process.communicate(timeout=timeout)  # closes its stdin
            return [(float(s), bool(ok)) for s, ok in json.loads(out or "[]")]
        except (subprocess.TimeoutExpired, ValueError):
            self._process.kill()
            self._process.wait()
            return []


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m benchmarks.health_probe BASE_URL INTERVAL_SECONDS\n"
              "polls GET /health until standard input closes, then prints the samples "
              "(seconds, success) as JSON", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    print(json.dumps(probe_until_stdin_closes(argv[0], float(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
