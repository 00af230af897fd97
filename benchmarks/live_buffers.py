"""Does a decode step cost more CPU while many MLX buffers are alive, or churning?

mlx_serve's prefix cache keeps each finished request's KV: one key and one value buffer
per layer (for a 1B llama at 256 tokens, 32 buffers of 256 KiB), up to its byte budget,
and once full it frees an entry for every one it stores. The engine harness keeps none.
This probe decodes with mlx-lm's ``BatchGenerator`` while ``N`` extra buffers are alive,
``N`` going up and back down (so that a drift over time shows as a difference between
the two passes), optionally replacing some of them every step, and reports the stepping
thread's CPU time and the wall time per decode step for each ``N``.

    python -m benchmarks.live_buffers --model DIR [--batch 16] [--counts 0,1024,4096] \\
        [--buffer-bytes 262144] [--churn 0] [--steps 200] [--cache-limit-bytes N]

``--cache-limit-bytes`` caps MLX's cache of freed buffers as the benchmarks' servers are
capped (``--mlx-cache-limit-bytes``): past the cap MLX returns a freed buffer to the
device's allocator, which on CUDA waits for the device.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.lock_probe import decoding_batch

EVAL_CHUNK = 256  # buffers made per evaluation: a small graph each time


class HeldBuffers:
    """Distinct evaluated MLX buffers, kept alive until dropped."""

    def __init__(self, buffer_bytes: int) -> None:
        self.elements = max(1, buffer_bytes // 2)  # bfloat16
        self.arrays: list[Any] = []
        self._made = 0

    def resize(self, count: int) -> None:
        del self.arrays[count:]
        while len(self.arrays) < count:
            self.arrays.extend(self._make(min(EVAL_CHUNK, count - len(self.arrays))))

    def replace(self, count: int) -> None:
        """Free the ``count`` oldest buffers and make as many new ones (a cache's churn)."""
        count = min(count, len(self.arrays))
        if count:
            del self.arrays[:count]
            self.arrays.extend(self._make(count))

    def _make(self, count: int) -> list[Any]:
        import mlx.core as mx

        made = [mx.full((self.elements,), self._made + i, dtype=mx.bfloat16)
                for i in range(count)]
        self._made += count
        mx.eval(made)
        return made


def decode(model: Any, held: HeldBuffers, batch: int, steps: int, prompt_tokens: int,
           churn: int) -> tuple[float, float]:
    """(thread CPU ms, wall ms) per decode step, over ``steps`` steps after the first."""
    gen = decoding_batch(model, batch, steps, prompt_tokens)
    done, cpu0, wall0 = 0, 0.0, 0.0
    try:
        while done <= steps:
            prompted, generated = gen.next()
            if not generated and not prompted:
                raise RuntimeError("the batch finished before the steps were done")
            if generated:
                if done == 0:  # time decoding only, from its first step
                    cpu0, wall0 = time.thread_time(), time.perf_counter()
                done += 1
                held.replace(churn)
        return ((time.thread_time() - cpu0) * 1e3 / steps,
                (time.perf_counter() - wall0) * 1e3 / steps)
    finally:
        gen.close()


def probe(model_path: str, counts: list[int], buffer_bytes: int, batch: int, steps: int,
          prompt_tokens: int = 128, churn: int = 0) -> list[dict[str, Any]]:
    from mlx_lm import load

    model = load(model_path)[0]
    held = HeldBuffers(buffer_bytes)
    decode(model, held, batch, min(steps, 20), prompt_tokens, 0)  # warm-up
    rows = []
    for direction, order in (("up", counts), ("down", counts[::-1])):
        for count in order:
            held.resize(count)
            cpu_ms, wall_ms = decode(model, held, batch, steps, prompt_tokens, churn)
            rows.append({"pass": direction, "buffers": count,
                         "held_mib": round(count * held.elements * 2 / 2**20, 1),
                         "churn_per_step": churn, "batch": batch,
                         "cpu_ms_per_step": round(cpu_ms, 3),
                         "wall_ms_per_step": round(wall_ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    held.resize(0)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.live_buffers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--counts", default="0,1024,4096", help="comma-separated buffer counts")
    p.add_argument("--buffer-bytes", type=int, default=256 * 1024)
    p.add_argument("--churn", type=int, default=0,
                   help="buffers freed and made anew after every decode step")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--cache-limit-bytes", type=int, default=None,
                   help="mx.set_cache_limit for the probe (default: MLX's own)")
    args = p.parse_args(argv)
    if args.cache_limit_bytes is not None:
        import mlx.core as mx

        mx.set_cache_limit(args.cache_limit_bytes)
    probe(args.model, [int(c) for c in args.counts.split(",")], args.buffer_bytes,
          args.batch, args.steps, args.prompt_tokens, args.churn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
