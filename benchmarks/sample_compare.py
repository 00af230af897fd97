"""Two threads' native samples, function by function: where one step's CPU goes in a
server's stepping thread against the engine harness's.

Reads two raw files that ``benchmarks.waits`` (py-spy's native sampling) wrote. Each
sample its thread spent on a CPU is put under ``(in async_eval)`` when MLX's
``async_eval`` (``--per``) is on its stack, else under the innermost Python function
it ran in. Each thread's counts are then divided by its own ``async_eval`` count: where
that call costs both threads the same per step (the same model and batch), the figures
share a unit, and their differences say which functions make one step longer than the
other. Each difference comes with its size in standard deviations of the sampling
noise (the counts taken as Poisson), since a few samples either way are noise.

    python -m benchmarks.sample_compare SERVER.raw mlx ENGINE.raw MainThread [--top 25]

py-spy's pauses can shift a thread's states, and then its samples are not a reading:
``benchmarks.waits --pid`` keeps the kernel's count of each thread's time on a CPU
beside the raw file, and this tool first says, for each of the two threads, whether
py-spy's "on CPU" share agrees with it.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.waits import (
    ON_CPU,
    classify,
    disagrees,
    kernel_share,
    load_kernel,
    parse_raw,
    raw_samples,
    thread_name,
)


def on_cpu_functions(lines: Iterable[str], thread: str, per: str) -> collections.Counter[str]:
    """The thread named ``thread``'s on-CPU samples by function, those with ``per`` on
    their stack under ``(in PER)``."""
    counts: collections.Counter[str] = collections.Counter()
    for name, frames, count in raw_samples(lines):
        if thread_name(name) != thread or classify(frames) != ON_CPU:
            continue
        if any(per in f for f in frames):
            key = f"(in {per})"
        else:
            python = [f for f in frames if ".py:" in f]
            key = _function(python[-1]) if python else "(native only)"
        counts[key] += count
    return counts


def kernel_check(raw: Path, lines: list[str], thread: str) -> str:
    """One line: whether py-spy's on-CPU share of ``thread`` in ``raw`` agrees with the
    kernel's count that ``benchmarks.waits --pid`` kept beside it."""
    found = [t for t in parse_raw(lines).values() if thread_name(t.name) == thread]
    if not found:
        raise ValueError(f"no thread named {thread!r} in {raw}")
    t = max(found, key=lambda t: t.samples)
    share = kernel_share(load_kernel(raw), t)
    if share is None:
        return (f"{raw} {thread}: no kernel count beside it (benchmarks.waits --pid "
                "keeps one); its samples are unchecked")
    verdict = ("DISAGREE: the pauses shifted its states, so this comparison is not a "
               "reading" if disagrees(share, t) else "agree")
    return (f"{raw} {thread}: py-spy {t.share(ON_CPU):.1%} on CPU, the kernel "
            f"{share:.1%}: {verdict}")


def _function(frame: str) -> str:
    """``Linear.__call__ (mlx/nn/layers/linear.py:74)`` -> ``Linear.__call__ (linear.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


@dataclass(frozen=True)
class Row:
    function: str
    a: int
    b: int
    a_share: float  # samples over the thread's own reference count
    b_share: float
    sigmas: float  # the difference over its standard deviation


def compare(a: collections.Counter[str], b: collections.Counter[str], per: str) -> list[Row]:
    """Every function of either thread, biggest difference first."""
    ref = f"(in {per})"
    a_ref, b_ref = a[ref], b[ref]
    if not a_ref or not b_ref:
        raise ValueError(f"no on-CPU samples in {per} in one of the threads")
    rows = []
    for function in set(a) | set(b):
        if function == ref:
            continue
        a_share, b_share = a[function] / a_ref, b[function] / b_ref
        sd = math.sqrt(a[function] / a_ref**2 + b[function] / b_ref**2)
        rows.append(Row(function, a[function], b[function], a_share, b_share,
                        (a_share - b_share) / sd if sd else 0.0))
    return sorted(rows, key=lambda r: -abs(r.a_share - r.b_share))


def format_compare(rows: list[Row], a_ref: int, b_ref: int, per: str, top: int) -> str:
    a_rest = sum(r.a_share for r in rows)
    b_rest = sum(r.b_share for r in rows)
    out = [f"on-CPU samples in {per}: {a_ref} / {b_ref}",
           f"the rest of the step over {per}: {a_rest:.3f} / {b_rest:.3f}; "
           f"the first's step over the second's, if {per} costs both the same: "
           f"{(1 + a_rest) / (1 + b_rest):.3f}",
           "   first  second  first/ref second/ref  diff  sigmas  function"]
    for r in rows[:top]:
        out.append(f"{r.a:8d} {r.b:7d} {r.a_share:9.3f} {r.b_share:10.3f} "
                   f"{r.a_share - r.b_share:+6.3f} {r.sigmas:+7.1f}  {r.function}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=Path, help="raw samples, e.g. a server's")
    p.add_argument("first_thread", help="its stepping thread's name (mlx_serve: mlx)")
    p.add_argument("second", type=Path, help="raw samples, e.g. the engine harness's")
    p.add_argument("second_thread", help="its stepping thread's name (MainThread)")
    p.add_argument("--per", default="async_eval", help="the reference call")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    first = args.first.read_text().splitlines()
    second = args.second.read_text().splitlines()
    print(kernel_check(args.first, first, args.first_thread))
    print(kernel_check(args.second, second, args.second_thread))
    a = on_cpu_functions(first, args.first_thread, args.per)
    b = on_cpu_functions(second, args.second_thread, args.per)
    ref = f"(in {args.per})"
    print(format_compare(compare(a, b, args.per), a[ref], b[ref], args.per, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
