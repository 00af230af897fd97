"""Where each thread's wall time goes: on a CPU, or waiting for the interpreter lock, for
MLX, for the event loop's poll or for something else.

``py-spy record --native --idle --threads`` samples every thread's Python and native
stack together; this module records such samples from a running process and sorts each
one by its innermost frames:

- ``interpreter lock``: waiting to take the lock, or (after a forced switch) for
  another thread to take it. py-spy folds libpython's own frames away, so these show as
  a condition wait right under a Python frame (or a Cython ``with gil`` block, as in
  uvloop), never under a lock object's acquire, MLX or an unnamed native frame;
- ``MLX event``: ``mlx::core::Event::wait`` or a CUDA synchronisation, waiting for
  the device (or, on MLX's CPU backend, for its compute thread) to finish an array;
- ``MLX eval``: a condition wait or a contended lock inside ``eval`` itself: on the
  CPU backend, waiting for the compute thread to take more work or to let go of its
  task queue;
- ``event loop poll``: ``epoll`` with nothing to do;
- ``write call``: inside a ``write`` (a socket's, mostly);
- ``other wait``: any other condition wait, contended lock or futex (idle pools,
  queues), or a blocking read, poll or sleep;
- ``on CPU``: everything else.

Native sampling pauses the whole process for each sample, which slows a process with
many threads (a server) more than one with few (the engine harness): read the shares
within a thread, not times per token, and keep the rate low (100 Hz). Sampling a
process (``--pid``) first reads each thread's time on a CPU by the kernel's count over
as long a window, and prints it beside py-spy's "on CPU": where the two disagree (by
more than 5 points, flagged), the pauses have shifted that thread's states and its
shares are not a reading. It keeps those counts beside the raw file
(``OUT.raw.kernel.json``) for ``--summarize`` and ``benchmarks.sample_compare``.

    python -m benchmarks.waits --pid PID --seconds 6 [--rate 100] [--raw OUT.raw]
    python -m benchmarks.waits --summarize OUT.raw [--threads 4]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.threads import thread_times

LOCK = "interpreter lock"
MLX_EVENT = "MLX event"
MLX_EVAL = "MLX eval"
POLL = "event loop poll"
WRITE = "write call"
OTHER_WAIT = "other wait"
ON_CPU = "on CPU"
# Where py-spy's on-CPU share and the kernel's agreed (server and engine stepping threads,
# H100 and CPU) they were within 3 points; the shifted readings were 8-47 points off.
KERNEL_AGREES_WITHIN = 0.05

_DEVICE_SYNC = ("Event::wait", "StreamSynchronize", "EventSynchronize")
_WAITS = ("cond_wait", "cond_timedwait", "acquire_lock", "futex", "sem_wait")
_NOT_THE_LOCK = ("(lib", "mlx::")  # a shared library's own wait: a lock, MLX, CUDA
_BLOCKING_CALLS = ("read", "recv", "recvfrom", "recvmsg", "poll", "ppoll", "select",
                   "pselect", "nanosleep", "clock_nanosleep", "accept", "accept4", "wait4")


def _name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def classify(frames: list[str]) -> str:
    """The state of one sample, from its frames outermost first (py-spy's raw order)."""
    inner = frames[-8:]
    names = [_name(f) for f in inner]
    if any(n in ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread") for n in names):
        return LOCK
    named = [f for f in frames if not f.startswith("0x")]  # libc's unnamed insides
    if (len(named) >= 2 and _name(named[-1]) in ("pthread_cond_timedwait", "pthread_cond_wait")
            and not any(k in named[-2] for k in _NOT_THE_LOCK)):
        return LOCK
    if any(s in n for n in names for s in _DEVICE_SYNC):
        return MLX_EVENT
    # A contended mutex: libc's unnamed slow path (the futex wait) under its lock call
    contended = (len(named) >= 1 and _name(named[-1]) == "pthread_mutex_lock"
                 and frames[-1].startswith("0x"))
    waiting = contended or any(w in n for n in names[-3:] for w in _WAITS)
    if waiting and any("mlx::core::eval_impl" in n for n in names):
        return MLX_EVAL
    if any("epoll" in n for n in names[-3:]):
        return POLL
    if _name(frames[-1]) in ("write", "send", "sendmsg", "writev"):
        return WRITE
    if waiting or any(n in _BLOCKING_CALLS for n in names[-2:]):
        return OTHER_WAIT
    return ON_CPU


@dataclass
class ThreadWaits:
    """One thread's samples by state, with the commonest stacks of each state."""

    name: str
    states: collections.Counter[str] = field(default_factory=collections.Counter)
    stacks: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))

    @property
    def samples(self) -> int:
        return sum(self.states.values())

    def share(self, state: str) -> float:
        return self.states[state] / self.samples if self.samples else 0.0


def raw_samples(lines: Iterable[str]) -> Iterator[tuple[str, list[str], int]]:
    """py-spy's raw (collapsed) output, ``thread (TID): NAME;frame;...;frame COUNT``, as
    (``thread (TID): NAME``, its frames outermost first, COUNT)."""
    for line in lines:
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        thread, *frames = stack.split(";")
        yield thread, frames, int(count)


def parse_raw(lines: Iterable[str]) -> dict[str, ThreadWaits]:
    """Every thread's samples by state (see ``raw_samples``)."""
    threads: dict[str, ThreadWaits] = {}
    for name, frames, count in raw_samples(lines):
        thread = threads.setdefault(name, ThreadWaits(name))
        state = classify(frames) if frames else ON_CPU
        thread.states[state] += count
        innermost = " < ".join(_name(f)[:50] for f in frames[::-1][:4])
        thread.stacks[state][innermost] += count
    return threads


def thread_name(name: str) -> str:
    """The thread's own name in py-spy's ``thread (TID): NAME``."""
    return name.split(": ", 1)[-1]


def thread_id(name: str) -> int | None:
    """The kernel's thread id in py-spy's ``thread (TID): NAME``."""
    try:
        return int(name.split("(", 1)[1].split(")", 1)[0])
    except (IndexError, ValueError):
        return None


def kernel_on_cpu(pid: int, seconds: float) -> dict[int, float]:
    """Each thread's share of ``seconds`` on a CPU by the kernel's own count (schedstat),
    read without pausing anything: what py-spy's "on CPU" shares should come close to.
    Pausing for native samples can shift the states around MLX's waits: on the CPU
    machine, 16-layer tiny model at one stream, the engine harness's stepping thread
    read 48.3 % on CPU by py-spy and 85.6 % by the kernel, a server's 79.6 % and 87.6 %."""
    before = thread_times(pid)
    time.sleep(seconds)
    after = thread_times(pid)
    if not before or not after:
        return {}
    return {tid: (cpu - before[tid][1]) / seconds
            for tid, (_, cpu) in after.items() if tid in before}


def kernel_file(raw: Path) -> Path:
    """Where ``--pid`` keeps the kernel's counts beside the raw samples it took."""
    return raw.with_name(raw.name + ".kernel.json")


def load_kernel(raw: Path) -> dict[int, float] | None:
    """The kernel's on-CPU shares kept beside ``raw``, by thread id; None if none were."""
    path = kernel_file(raw)
    if not path.exists():
        return None
    return {int(tid): share for tid, share in json.loads(path.read_text()).items()}


def kernel_share(kernel: dict[int, float] | None, thread: ThreadWaits) -> float | None:
    """``thread``'s on-CPU share by the kernel's count, if ``kernel`` holds its id."""
    tid = thread_id(thread.name)
    return kernel.get(tid) if kernel and tid is not None else None


def disagrees(share: float, thread: ThreadWaits) -> bool:
    """Whether py-spy's on-CPU share of ``thread`` is too far from the kernel's
    (``share``) to read."""
    return abs(share - thread.share(ON_CPU)) > KERNEL_AGREES_WITHIN


def format_waits(threads: dict[str, ThreadWaits], top: int = 4, stacks: int = 1,
                 kernel: dict[int, float] | None = None) -> str:
    """The ``top`` threads with most samples (py-spy samples every thread each time, so
    ties are usual: the busiest by time on CPU come first), each state's share, and
    with ``kernel`` each thread's share on a CPU by the kernel's count beside."""
    ranked = sorted(threads.values(), key=lambda t: (-t.samples, -t.states[ON_CPU]))
    out = []
    for t in ranked[:top]:
        out.append(f"{t.samples:6d} samples  {t.name}")
        share = kernel_share(kernel, t)
        if share is not None:
            out.append(f"        {share:6.1%}  on a CPU by the kernel's count, "
                       "just before the samples")
            if disagrees(share, t):
                out.append("        (py-spy's \"on CPU\" disagrees with the kernel's count: "
                           "the pauses shifted this thread's states, so do not read them)")
        for state, n in t.states.most_common():
            out.append(f"        {n / t.samples:6.1%}  {state}")
            for stack, k in t.stacks[state].most_common(stacks):
                out.append(f"                  {k:5d}  {stack}")
    return "\n".join(out)


def py_spy() -> str:
    """The py-spy beside this interpreter (a dev dependency), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("py-spy not found: pip install py-spy")
    return found


def record(pid: int, seconds: float, rate: int, raw: Path) -> Path:
    """Sample ``pid`` with native stacks for ``seconds``; the raw file's path."""
    cmd = [py_spy(), "record", "--native", "--idle", "--threads", "-r", str(rate),
           "-d", str(max(1, round(seconds))), "-f", "raw", "-o", str(raw),
           "-p", str(pid)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--pid", type=int, help="process to sample")
    which.add_argument("--summarize", type=Path, help="a raw file py-spy wrote before")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rate", type=int, default=100, help="samples a second")
    p.add_argument("--raw", type=Path, help="keep the raw samples here")
    p.add_argument("--threads", type=int, default=4, help="threads to print")
    args = p.parse_args(argv)
    if args.summarize:
        raw = args.summarize
        kernel = load_kernel(raw)
    else:
        raw = args.raw or Path(tempfile.mkdtemp(prefix="waits-")) / "samples.raw"
        kernel = kernel_on_cpu(args.pid, args.seconds)
        record(args.pid, args.seconds, args.rate, raw)
        kernel_file(raw).write_text(json.dumps(kernel))
    print(f"{raw}")
    print(format_waits(parse_raw(raw.read_text().splitlines()), top=args.threads,
                       kernel=kernel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
