"""One measured load against a running server, with the server's own counters around it.

The load generator's figures, plus what only the server process can tell: its CPU time
per output token (in total and by thread role), its batch steps and the MLX thread's busy
time (mlx_serve's /health), that thread's kernel counters per step (``thread_detail``),
and what the host gave the run.
"""

from __future__ import annotations

from typing import Any, TypeVar

from benchmarks.host import HostWatch
from benchmarks.loadgen import Target, run_async, run_load
from benchmarks.metrics import busy_share, cpu_per_token, step_figures
from benchmarks.servers import ServerProcess, busy_in, steps_in
from benchmarks.thread_detail import per_step, read_thread
from benchmarks.threads import cpu_by_role, cpu_per_token_by_thread, mlx_thread_id, thread_times
from benchmarks.workload import Workload

T = TypeVar("T", int, float)


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
        threads = thread_times(server.pid, children=True)
        stepping = mlx_thread_id(threads)
        start.update(steps=steps_in(health), prefill_steps=steps_in(health, "prefill_steps"),
                     busy=busy_in(health), threads=threads,
                     stepping=stepping, detail=read_thread(stepping))
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
    after = result["health_after"]
    run_steps = _grown(start["steps"], steps_in(after))
    step_figures(result["summary"], run_steps,
                 _grown(start["prefill_steps"], steps_in(after, "prefill_steps")))
    result["summary"]["stepping_detail"] = per_step(
        start["detail"], read_thread(start["stepping"]), run_steps)
    busy_share(result["summary"], _grown(start["busy"], busy_in(after)))
    return result


def _grown(before: T | None, after: T | None) -> T | None:
    """A server counter's growth over the run (None where either reading is missing)."""
    return None if before is None or after is None else after - before
