"""Poll ``GET /health`` from a separate process while a load runs.

The probe must not share an event loop (or an interpreter lock) with the load
generator: at a hundred streams the generator's own loop lags by tens of milliseconds,
and a probe inside it would report that lag as the server's. A small child process
with blocking sockets measures only the server and the network. It polls until its
standard input closes, then prints its samples as JSON.

    python -m benchmarks.health_probe http://127.0.0.1:8000 0.2
"""

from __future__ import annotations

import http.client
import json
import select
import subprocess
import sys
import time
from urllib.parse import urlsplit


def probe_until_stdin_closes(base_url: str, interval: float) -> list[tuple[float, bool]]:
    url = urlsplit(base_url)
    samples: list[tuple[float, bool]] = []
    print("ready", flush=True)
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

    def start(self) -> None:
        self._process = subprocess.Popen(self._command, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        self._process.stdout.readline()  # "ready": imports done, polling begins

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
