"""Where the contenders' stepping threads run: ``ab --pin-stepping CPU``.

On the GPU hosts a step at one to 64 streams is bound by the vCPU that builds and
launches it, and the vCPUs of one virtual machine need not run at one speed
(``python -m benchmarks.host --per-cpu``). A thread keeps the vCPU the kernel first
gave it (about 0.01 migrations a step), so two contenders may sit on vCPUs of different
speeds for a whole run. Pinning puts every contender's stepping thread on the same vCPU
and everything else (their other threads, the load generator, the probes) on the rest,
so that the ratio compares the software rather than where the kernel happened to put it.

mlx_lm.server's stepping thread is not told apart (``threads.py``): it stays on the rest.
Linux only (``os.sched_setaffinity`` on thread ids).
"""

from __future__ import annotations

import os

from benchmarks.threads import mlx_thread_id, thread_times


def machine_vcpus() -> list[int]:
    """The vCPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def keep_off(cpu: int) -> set[int]:
    """Move the calling thread (and so every process it starts afterwards) off ``cpu``;
    the vCPUs left, which must not be empty."""
    rest = set(machine_vcpus()) - {cpu}
    if cpu not in machine_vcpus() or not rest:
        raise ValueError(f"cannot pin to vCPU {cpu}: this process may use {machine_vcpus()}")
    os.sched_setaffinity(0, rest)
    return rest


def pin_stepping(pid: int, stepping_tid: int | None, cpu: int, rest: set[int]) -> int:
    """Pin process ``pid``'s stepping thread (mlx_serve's MLX thread when
    ``stepping_tid`` is None) to ``cpu`` and its other threads, its children's too, to
    ``rest``. Returns the stepping thread's id; RuntimeError where none was found (a
    run pinned to nothing would read as pinned)."""
    threads = thread_times(pid, children=True) or {}
    stepping = stepping_tid if stepping_tid is not None else mlx_thread_id(threads)
    if stepping not in threads:
        raise RuntimeError(f"no stepping thread found in process {pid} to pin")
    for tid in threads:
        try:
            os.sched_setaffinity(tid, {cpu} if tid == stepping else rest)
        except OSError:  # the thread ended meanwhile
            continue
    return stepping
