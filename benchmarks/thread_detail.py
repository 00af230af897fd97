"""How one thread spent a run, from the kernel's counters: what its CPU time was made of.

``threads.py`` gives each thread's time on a CPU. When the thread that steps the batch
uses more CPU for the same step, these counters tell the kinds of cost apart:

- ``user_ms`` / ``system_ms``: CPU time in user space and in the kernel (``stat``,
  10 ms ticks: read them over runs of seconds). Time in the kernel is system calls,
  page faults and interrupts taken on the thread's behalf.
- ``runqueue_ms``: time runnable but waiting for a CPU (``schedstat``, nanoseconds):
  the thread sharing a vCPU with another busy thread.
- ``voluntary`` / ``involuntary``: context switches (``status``); voluntary ones are
  blocking waits (a lock, a queue, a device sync that sleeps), involuntary ones
  preemption by another thread on the same vCPU.
- ``minor_faults``: page faults served without I/O (``stat``): memory being mapped
  in (an allocator that hands pages back and takes them again), or, with MLX's CUDA
  backend, the CPU touching managed memory that the GPU holds.
- ``migrations``: how often the thread changed vCPU (``sched``), where the kernel has it.
- ``vcpu_start`` / ``vcpu``: the vCPU it was last seen on at the start and at the end
  (``stat``'s ``processor``): on a virtual machine whose vCPUs run at different speeds,
  where a stepping thread sits decides its step's length (``--pin-stepping`` in ``ab``).

Linux only; every reader returns None elsewhere or once the thread has gone.
"""

from __future__ import annotations

import os
from typing import Any

COUNTERS = ("user_ms", "system_ms", "runqueue_ms", "voluntary", "involuntary",
            "minor_faults", "migrations")


def read_thread(tid: int | None) -> dict[str, float] | None:
    """The counters of thread ``tid`` so far, whichever process it is in."""
    if tid is None:
        return None
    task = f"/proc/{tid}/task/{tid}"
    try:
        fields = stat_fields(task)
        with open(f"{task}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        with open(f"{task}/schedstat") as fh:
            schedstat = fh.read().split()
    except (OSError, ValueError):
        return None
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return {
        "user_ms": int(fields[11]) * tick_ms,
        "system_ms": int(fields[12]) * tick_ms,
        "runqueue_ms": int(schedstat[1]) / 1e6,
        "voluntary": int(status["voluntary_ctxt_switches"]),
        "involuntary": int(status["nonvoluntary_ctxt_switches"]),
        "minor_faults": int(fields[7]),
        "migrations": _migrations(task),
        "vcpu": int(fields[36]),
    }


def stat_fields(task: str) -> list[str]:
    """A ``/proc`` task's ``stat`` fields after its command name (which may hold spaces):
    state is field 0, minflt 7, utime 11, stime 12, processor 36."""
    with open(f"{task}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def _migrations(task: str) -> float:
    """``se.nr_migrations`` from ``sched`` (kernels with scheduler debugging); -1 without."""
    try:
        with open(f"{task}/sched") as fh:
            for line in fh:
                if line.startswith("se.nr_migrations"):
                    return float(line.split(":")[1])
    except OSError:
        pass
    return -1.0


def per_step(before: dict[str, float] | None, after: dict[str, float] | None,
             steps: int | None) -> dict[str, Any] | None:
    """Each counter's growth between two readings, per batch step (None if unreadable)."""
    if before is None or after is None or not steps:
        return None
    out: dict[str, Any] = {name: round((after[name] - before[name]) / steps, 4)
                           for name in COUNTERS if after[name] >= 0}
    out["steps"] = steps
    out["vcpu_start"], out["vcpu"] = int(before["vcpu"]), int(after["vcpu"])
    return out


def describe(detail: dict[str, Any] | None) -> str:
    """``stepping/step user 3.10 sys 0.40 runq 0.05 ms, vol 2.0 invol 0.1 flt 0.0`` or ''."""
    if not detail:
        return ""
    return (f"stepping/step user {detail['user_ms']:.2f} sys {detail['system_ms']:.2f} "
            f"runq {detail['runqueue_ms']:.2f} ms, vol {detail['voluntary']:.1f} "
            f"invol {detail['involuntary']:.1f} flt {detail['minor_faults']:.1f}"
            + (f" migr {detail['migrations']:.2f}" if "migrations" in detail else "")
            + _on_vcpu(detail))


def _on_vcpu(detail: dict[str, Any]) -> str:
    """`` on vCPU 5`` (`` on vCPU 5->7`` when it moved); '' for records without it."""
    if "vcpu" not in detail:
        return ""
    start, end = detail["vcpu_start"], detail["vcpu"]
    return f" on vCPU {end}" if start == end else f" on vCPU {start}->{end}"
