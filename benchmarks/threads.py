"""CPU time by thread role, so a run shows where a contender's CPU per token goes.

Roles, read from ``/proc/PID/task/*`` (Linux):

- ``main``: the process's first thread, unless it steps the batch. In mlx_serve (and
  uvicorn generally) the event loop: HTTP parsing, the reply fan-out, socket writes. In
  mlx_lm.server its HTTP server.
- ``stepping``: the thread that steps the batch: mlx_serve's MLX thread (it names
  itself ``mlx``; MLX's workers, which it starts, inherit the name, so it is the oldest
  thread of that name), and the engine harness's only Python thread (which has no
  ``main`` then). Not told apart in mlx_lm.server, where it counts as ``other``.
- ``text``: mlx_serve's text thread (``--text-thread``, named ``text``), which makes each
  step's text while the MLX thread runs the next step.
- ``other``: every other thread: MLX's and BLAS's workers, worker threads for long
  prompts, mlx_lm.server's generation and handler threads.

Time on CPU comes from ``schedstat`` (nanoseconds; ``stat``'s 10 ms ticks where it is
missing), so short runs still read something. A run's figure is each thread's time at
its end less its time at the start (all of it for a thread that started meanwhile), so
a thread that ends during the run is left out rather than counted backwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from benchmarks.thread_detail import describe as describe_detail
from benchmarks.thread_detail import stat_fields

ROLES = ("main", "stepping", "text", "other")
MLX_THREAD_NAME = "mlx"  # the name mlx_serve gives its MLX thread (mlx_thread.py)
TEXT_THREAD_NAME = "text"  # and its text thread (engine.py)

Snapshot = dict[int, tuple[str, float]]  # thread id -> (name, CPU seconds so far)


def thread_times(pid: int | None = None, children: bool = False) -> Snapshot | None:
    """Every thread of process ``pid`` (this one by default), with ``children`` those of
    its child processes too, with its CPU time so far; None off Linux or once the
    process has gone.

    mlx_serve with ``--engine-process`` steps in a child: its MLX thread counts as
    ``stepping`` there too, the child's event loop as ``other``."""
    pid = os.getpid() if pid is None else pid
    snapshot = _process_threads(pid)
    if snapshot is None or not children:
        return snapshot
    for child in _children(pid, snapshot):
        snapshot.update(_process_threads(child) or {})
    return snapshot


def _process_threads(pid: int) -> Snapshot | None:
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    snapshot = {}
    for tid in tids:
        try:
            snapshot[tid] = _thread_name_and_cpu(f"/proc/{pid}/task/{tid}")
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return snapshot


def _children(pid: int, threads: Snapshot) -> list[int]:
    children = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                children += [int(c) for c in fh.read().split()]
        except OSError:
            continue
    return children


def _thread_name_and_cpu(task: str) -> tuple[str, float]:
    with open(f"{task}/comm") as fh:
        name = fh.read().strip()
    try:
        with open(f"{task}/schedstat") as fh:
            return name, int(fh.read().split()[0]) / 1e9
    except FileNotFoundError:  # a kernel without scheduler statistics
        fields = stat_fields(task)
        return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(pid: int, before: Snapshot | None, after: Snapshot | None,
                stepping_tid: int | None = None) -> dict[str, float] | None:
    """CPU seconds by role between two snapshots of process ``pid``. ``stepping_tid``
    names the stepping thread where it has no name of its own (the engine harness's)."""
    if before is None or after is None:
        return None
    stepping = {stepping_tid, mlx_thread_id(after)}
    roles = dict.fromkeys(ROLES, 0.0)
    for tid, (name, seconds) in after.items():
        role = ("stepping" if tid in stepping else "main" if tid == pid
                else "text" if name == TEXT_THREAD_NAME else "other")
        roles[role] += seconds - before.get(tid, ("", 0.0))[1]
    return roles


def mlx_thread_id(snapshot: Snapshot | None) -> int | None:
    """mlx_serve's MLX thread in a snapshot. Threads inherit their creator's name, so
    MLX's own workers, started from the MLX thread, are called "mlx" too; the MLX
    thread is the one created first: the earliest start time, and among threads started
    in the same clock tick the first listed (``/proc/PID/task`` lists a process's
    threads in the order they were created). Not the lowest id: ids wrap around at
    ``pid_max`` (32768 on some hosts), and a worker may then have a lower one."""
    named = [tid for tid, (name, _) in (snapshot or {}).items() if name == MLX_THREAD_NAME]
    return min(named, key=_start_time, default=None)  # min keeps the first of equals


def _start_time(tid: int) -> float:
    """When thread ``tid`` started (clock ticks since boot); infinity once it has gone."""
    try:
        return int(stat_fields(f"/proc/{tid}")[19])
    except (OSError, IndexError, ValueError):
        return float("inf")


def cpu_per_token_by_thread(summary: dict[str, Any], roles: dict[str, float] | None) -> None:
    """Record ``cpu_ms_per_token_by_thread`` (ms of CPU per output token by role)."""
    tokens = summary.get("output_tokens") or 0
    if roles is None or not tokens:
        summary["cpu_ms_per_token_by_thread"] = None
        return
    summary["cpu_ms_per_token_by_thread"] = {
        role: round(1000 * roles[role] / tokens, 4) for role in ROLES}


def role_cpu(role: str) -> Callable[[dict[str, Any]], float | None]:
    """A getter of one role's CPU ms per token (None where the run has no such thread)."""
    def get(summary: dict[str, Any]) -> float | None:
        by = summary.get("cpu_ms_per_token_by_thread")
        return by[role] if by and by.get(role, 0) > 0 else None  # none in older results
    return get


def describe_threads(summary: dict[str, Any]) -> str:
    """``cpu/token main 0.041 stepping 0.065 other 0.137 ms  mlx busy 62 %`` for a run
    line ('' without either)."""
    by = summary.get("cpu_ms_per_token_by_thread")
    busy = summary.get("mlx_busy_share")
    shown = [role for role in ROLES if role != "text" or (by and by.get(role))]
    line = ("cpu/token " + " ".join(f"{role} {by[role]:.3f}" for role in shown) + " ms"
            if by else "")
    if busy is not None:  # mlx_serve's MLX thread: in jobs this share of the run
        line = f"{line}  mlx busy {100 * busy:.0f} %".lstrip()
    prefill = summary.get("prefill_step_share")
    if prefill is not None:  # steps that also prefilled newcomers
        line = f"{line}  prefill in {100 * prefill:.0f} % of steps".lstrip()
    return f"{line}  {describe_detail(summary.get('stepping_detail'))}".strip()
