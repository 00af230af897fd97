"""What it costs the calling thread when the CPU touches MLX arrays, pattern by pattern.

On MLX's CUDA backend a buffer lives in device memory until the CPU reads it; the first
read moves it to managed memory (a new managed allocation and a copy), and a managed
page last written by the GPU faults when the CPU touches it. The stepping thread of a
batch generator does a few such touches every step (the sampled tokens, a finished
sequence's padding per layer, prompts built from Python lists), so this prints, for each
pattern, the calling thread's wall time, CPU time and minor page faults per call
(``getrusage(RUSAGE_THREAD)``), after a warm-up. On the CPU backend it shows the same
patterns without device memory, for comparison.

    python -m benchmarks.device_touch [--calls 300] [--batch 128]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import mlx.core as mx


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def measure(fn: Callable[[], object], calls: int) -> tuple[float, float, float]:
    """(wall us, thread CPU us, minor faults) per call of ``fn``, after 20 warm-up calls."""
    for _ in range(20):
        fn()
    mx.synchronize()
    faults, cpu, wall = _faults(), time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(calls):
        fn()
    mx.synchronize()
    return ((time.perf_counter_ns() - wall) / calls / 1e3,
            (time.thread_time_ns() - cpu) / calls / 1e3, (_faults() - faults) / calls)


def patterns(batch: int) -> dict[str, Callable[[], object]]:
    logits = mx.random.normal((batch, 32768))
    padding = [mx.zeros((batch,), dtype=mx.int32)]
    keep = list(range(batch))
    mx.eval(logits, padding[0])

    def sample() -> mx.array:
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens)
        return tokens

    def gathered_padding() -> mx.array:  # what BatchKVCache.filter leaves behind
        padding[0] = padding[0][mx.array(keep)]
        mx.eval(padding[0])
        return padding[0]

    return {
        "device op, result left on the device": sample,
        "device op, result read by the CPU (sampled tokens .tolist())": lambda: sample().tolist(),
        "the same result read again (already moved)": _reread(sample),
        "gathered padding read by the CPU (extract after filter)":
            lambda: gathered_padding().tolist(),
        "array from a Python list, used on the device": lambda: mx.eval(mx.array(keep) + 1),
        "the same after mx.clear_cache()": lambda: (mx.clear_cache(), mx.eval(mx.array(keep) + 1)),
    }


def _reread(make: Callable[[], mx.array]) -> Callable[[], object]:
    held = make()
    held.tolist()
    return held.tolist


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    print(f"MLX {mx.__version__}, default device {mx.default_device()}, batch {args.batch}")
    print("| pattern | wall us/call | thread CPU us/call | minor faults/call |")
    print("|---|---|---|---|")
    for name, fn in patterns(args.batch).items():
        wall, cpu, faults = measure(fn, args.calls)
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {faults:.2f} |")


if __name__ == "__main__":
    main()
