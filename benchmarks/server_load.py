"""One measured load against a running server, with the server's own counters around it.

The load generator's figures, plus what only the server process can tell: its CPU time
per output token (in total and by thread role), its batch steps and the MLX thread's busy
time (mlx_serve's /health), and what the host gave the run.
"""

from __future__ import annotations

from typing import Any

from benchmarks.host import HostWatch
from benchmarks.loadgen import Target, run_async, run_load
from benchmarks.metrics import busy_share, cpu_per_token, step_figures
from benchmarks.servers import ServerProcess, busy_in, steps_in
from benchmarks.threads import cpu_by_role, cpu_per_token_by_thread, thread_times
from benchmarks.workload import Workload


def measured_load(server: ServerProcess, target: Target, workload: Workload,
                  prompts: list[str], warmup: tuple[str, ...] = ()) -> dict[str, Any]:
    """One load against ``server``; its summary gets the server's CPU per output token,
    where the server counts them (mlx_serve) its batch steps, and what the host gave the
    load (``host``), all read from the end of the warm-up requests. The server's /health
    body at the end goes in ``health_after``."""
    start: dict[str, Any] = {}
    host = HostWatch()

    def read_counters() -> None:
        health = server.health()
        start.update(steps=steps_in(health), busy=busy_in(health),
                     threads=thread_times(server.pid, children=True))
        host.start()

    try:
        result = run_async(run_load(target, workload, prompts, warmup, read_counters))
    finally:
        host.stop()
    result["summary"]["host"] = host.record()
    # Threads' own clocks count nanoseconds where the process's counts 10 ms ticks.
    roles = cpu_by_role(server.pid, start["threads"], thread_times(server.pid, children=True))
    cpu_per_token(result["summary"], None if roles is None else sum(roles.values()))
    cpu_per_token_by_thread(result["summary"], roles)
    result["health_after"] = server.health()
    steps = steps_in(result["health_after"])
    step_figures(result["summary"],
                 None if steps is None or start["steps"] is None else steps - start["steps"])
    busy = busy_in(result["health_after"])
    busy_share(result["summary"],
               None if busy is None or start["busy"] is None else busy - start["busy"])
    return result
