"""What the host gave the benchmark during a run: stolen CPU time and a CPU speed probe.

On shared and virtual machines the same engine run can go twice as slow from one minute
to the next. Two readings taken around each run tell "the machine was slower" apart
from "this contender is slower":

- ``steal_share``: the share of the machine's CPU time that the hypervisor gave to
  something else while the vCPUs wanted to run (the ``steal`` column of ``/proc/stat``,
  all CPUs, over the run).
- ``cpu_probe_ms``: how long a fixed pure-Python loop (about 1 ms) takes, sampled every
  0.2 s through the run; p50 and p90. A host that runs the vCPU slower (a busy sibling
  hyperthread, a lower clock) shows here even when it steals no time: on the 2-vCPU
  test machine the same loop took 0.85 ms in some stretches of a few hundred ms and
  1.35-1.45 ms in others, idle and with no time stolen.

``python -m benchmarks.host --per-cpu`` times the probe on every vCPU in turn instead:
on the H200 machine each vCPU switches between two speeds on its own, so the floating
probe reads only the vCPU it happens to land on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.metrics import percentiles

PROBE_LOOPS = 20_000  # about 1 ms of pure Python on these machines
SAMPLE_PERIOD_S = 0.2
FIRST_SAMPLE_TIMEOUT_S = 10.0
_STEAL = 7  # user nice system idle iowait irq softirq steal (guest time is in user)


def probe_seconds(loops: int = PROBE_LOOPS) -> float:
    """How long a fixed arithmetic loop takes."""
    started = time.perf_counter()
    acc = 0
    for i in range(loops):
        acc = (acc + i * i) % 1_000_003
    return time.perf_counter() - started


def cpu_times(path: Path = Path("/proc/stat")) -> tuple[int, ...] | None:
    """The machine's CPU time counters (``/proc/stat``'s ``cpu`` line); None off Linux."""
    try:
        fields = path.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) <= _STEAL + 1:
        return None
    return tuple(int(f) for f in fields[1:_STEAL + 2])


def steal_share(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> float | None:
    """Stolen over all CPU time between two ``cpu_times`` readings (None if unknown)."""
    if before is None or after is None:
        return None
    delta = [a - b for a, b in zip(after, before, strict=True)]
    total = sum(delta)
    return round(delta[_STEAL] / total, 4) if total > 0 else None


def busy_vcpus(before: tuple[int, ...] | None, after: tuple[int, ...] | None,
               seconds: float) -> float | None:
    """vCPUs the whole machine kept busy between two ``cpu_times`` readings (every
    counter but idle and iowait) over ``seconds`` of wall time."""
    if before is None or after is None or seconds <= 0:
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    busy = sum(delta) - delta[3] - delta[4]
    return round(busy / os.sysconf("SC_CLK_TCK") / seconds, 3)


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds process ``pid`` has used, all its threads (None if
    gone or off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quiet(seconds: float, pids: dict[str, int], vcpus: list[int] | None = None,
          sweeps: int = 5) -> dict[str, Any]:
    """Wait ``seconds`` with nothing measured, and record what the machine and the
    named processes (idle servers, a kept engine harness) still did meanwhile: a process
    that keeps a vCPU busy after its run slows whatever runs next.

    With ``vcpus``, the quiet ends with ``sweeps`` sweeps of the probe over those vCPUs
    (``vcpu_probe_ms``: each one's median), so a run's stepping thread can be set
    against the speed of the vCPU it ran on."""
    before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
    machine, started = cpu_times(), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    used = {}
    for name, pid in pids.items():
        after = process_cpu_seconds(pid)
        first = before[name]
        used[name] = None if after is None or first is None else round(after - first, 3)
    record: dict[str, Any] = {
        "seconds": round(elapsed, 3),
        "busy_vcpus": busy_vcpus(machine, cpu_times(), elapsed), "process_cpu_s": used}
    if vcpus:
        samples = [per_cpu_seconds(cpus=vcpus) for _ in range(sweeps)]
        record["vcpu_probe_ms"] = {
            cpu: round(1e3 * statistics.median(s[i] for s in samples), 3)
            for i, cpu in enumerate(vcpus)}
    return record


def describe_quiet(record: dict[str, Any]) -> str:
    """``quiet 20.0 s: machine 0.05 vCPUs busy; mlx_serve 0.01 s CPU, engine 0.00 s``."""
    busy = record["busy_vcpus"]
    parts = [f"{name} {'-' if v is None else f'{v:.2f}'} s"
             for name, v in record["process_cpu_s"].items()]
    line = (f"quiet {record['seconds']:.1f} s: machine "
            f"{'-' if busy is None else f'{busy:.2f}'} vCPUs busy; CPU used "
            + ", ".join(parts))
    if probe := record.get("vcpu_probe_ms"):
        line += "\nvCPU probe ms: " + " ".join(f"{cpu}:{ms:.2f}" for cpu, ms in probe.items())
    return line


class HostWatch:
    """``with HostWatch() as host: run()`` (or ``start()`` / ``stop()``), then
    ``host.record()`` for the run's JSON.

    The probe runs in a child process of its own, once per ``period`` seconds through
    the run (about 0.5 % of one core), so it never holds the load generator's
    interpreter lock.
    """

    def __init__(self, period: float = SAMPLE_PERIOD_S) -> None:
        self._period = period
        self._samples: list[float] = []
        self._before: tuple[int, ...] | None = None
        self._after: tuple[int, ...] | None = None
        self._load = [0.0, 0.0]
        self._sampler: subprocess.Popen[str] | None = None

    def __enter__(self) -> HostWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start sampling: call right before the measured load (after any warm-up)."""
        self._sampler = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.host", "--period", str(self._period)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            cwd=Path(__file__).parent.parent)
        _off_pinned_vcpu(self._sampler.pid)
        # Its first sample, taken before the load begins, also says it is running: a
        # load shorter than the sampler's start-up still gets one reading.
        assert self._sampler.stdout is not None
        if select.select([self._sampler.stdout], [], [], FIRST_SAMPLE_TIMEOUT_S)[0]:
            line = self._sampler.stdout.readline().strip()
            self._samples = [float(line)] if line else []
        self._load[0] = os.getloadavg()[0]
        self._before = cpu_times()

    def stop(self) -> None:
        """Stop sampling (nothing to do if it never started)."""
        if self._sampler is None or self._sampler.returncode is not None:
            return
        self._after = cpu_times()
        self._load[1] = os.getloadavg()[0]
        self._sampler.terminate()
        try:
            out, _ = self._sampler.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._sampler.kill()
            out, _ = self._sampler.communicate()
        self._samples += [float(line) for line in out.split()]

    def record(self) -> dict[str, Any]:
        probe = {**percentiles(self._samples), "samples": len(self._samples)}
        return {"cpu_probe_ms": probe,
                "steal_share": steal_share(self._before, self._after),
                "loadavg_1m": list(self._load)}


def _off_pinned_vcpu(pid: int) -> None:
    """A thread pinned to one vCPU (``ab --pin-stepping``) keeps its child processes
    off it: they inherit its affinity, and the probe must not share the stepping
    thread's vCPU in one contender only."""
    if not hasattr(os, "sched_getaffinity"):
        return
    mine = os.sched_getaffinity(0)
    rest = set(range(os.cpu_count() or 1)) - mine
    if len(mine) == 1 and rest:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, rest)


def describe(host: dict[str, Any] | None) -> str:
    """``probe 0.93 [1.31] ms steal 0.0 %`` for a run's printed line ('' without one)."""
    if not host or host["cpu_probe_ms"]["p50"] is None:
        return ""
    probe, steal = host["cpu_probe_ms"], host.get("steal_share")
    stolen = "-" if steal is None else f"{100 * steal:.1f} %"
    return f"probe {probe['p50']:.2f} [{probe['p90']:.2f}] ms steal {stolen}"


def per_cpu_seconds(loops: int = PROBE_LOOPS, cpus: list[int] | None = None) -> list[float]:
    """The probe's time on every vCPU this process may use (or on ``cpus``), pinned to
    each in turn.

    On the H200 machine each vCPU switches between two speeds about 2x apart on its own,
    within seconds, so one floating probe reads whichever vCPU it landed on; a sweep shows
    the whole machine (Linux only).
    """
    allowed = sorted(os.sched_getaffinity(0))
    times = []
    try:
        for cpu in allowed if cpus is None else cpus:
            os.sched_setaffinity(0, {cpu})
            times.append(probe_seconds(loops))
    finally:
        os.sched_setaffinity(0, allowed)
    return times


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.host [--period S] [--per-cpu] [--count N]``: print one probe
    time (s) per period, or with ``--per-cpu`` one line per sweep of every vCPU."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.host", description=main.__doc__)
    p.add_argument("--period", type=float, default=SAMPLE_PERIOD_S)
    p.add_argument("--loops", type=int, default=PROBE_LOOPS)
    p.add_argument("--per-cpu", action="store_true",
                   help="time the probe on each vCPU in turn (pinned), one line per sweep")
    p.add_argument("--count", type=int, default=None, help="stop after this many lines")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for line in itertools.count() if args.count is None else range(args.count):
        if line:
            time.sleep(args.period)
        if args.per_cpu:
            print(" ".join(f"{s:.7f}" for s in per_cpu_seconds(args.loops)), flush=True)
        else:
            print(f"{probe_seconds(args.loops):.7f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
