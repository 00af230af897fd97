"""How a busy Python thread slows MLX decoding: the interpreter lock, measured.

Decodes with mlx-lm's ``BatchGenerator`` for a number of steps, alternately alone and
beside a thread that spins in Python (as an event loop with work to do would), and
reports per batch size: the step time either way, the share of wall time spent inside
``mx.async_eval`` (where the next step's work is handed to MLX), and the spinning
thread's progress inside ``async_eval`` relative to its progress alone. Near 1.0 there
means MLX releases the lock while it encodes and launches a step; the step-time ratio
then shows what getting it back costs (each return from MLX may wait for the spinner to
reach Python's switch interval, 5 ms by default).

    python -m benchmarks.lock_probe --model MODEL_DIR [--batches 1,128] [--steps 200] \
        [--switch-interval 0.0005]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any


class Spinner:
    """A Python thread that counts while switched on."""

    def __init__(self) -> None:
        self.count = 0
        self.on = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._done:
            if self.on.is_set():
                self.count += 1
            else:
                self.on.wait(0.05)

    def solo_rate(self, seconds: float = 1.0) -> float:
        self.on.set()
        start = self.count
        time.sleep(seconds)
        self.on.clear()
        return (self.count - start) / seconds

    def stop(self) -> None:
        self._done = True
        self.on.set()


class _AsyncEvalTimer:
    """Wraps ``mx.async_eval``: time spent inside it, and the spinner's progress there."""

    def __init__(self, real: Any, spinner: Spinner) -> None:
        self._real, self._spinner = real, spinner
        self.seconds, self.counts = 0.0, 0

    def __call__(self, *args: Any) -> None:
        count, start = self._spinner.count, time.perf_counter()
        self._real(*args)
        self.seconds += time.perf_counter() - start
        self.counts += self._spinner.count - count


def decoding_batch(model: Any, batch: int, steps: int, prompt_tokens: int) -> Any:
    """mlx-lm's ``BatchGenerator`` with ``batch`` fixed prompts inserted, each allowed a
    few more tokens than ``steps``: decode steps to time once their prefill is done."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=8,
                         prefill_step_size=2048)
    prompts = [[(i * 7 + j) % 1000 + 10 for j in range(prompt_tokens)] for i in range(batch)]
    gen.insert(prompts, max_tokens=[steps + 8] * batch)
    return gen


def _decode(model: Any, spinner: Spinner, timer: _AsyncEvalTimer, solo: float, batch: int,
            steps: int, prompt_tokens: int, spin: bool) -> dict[str, Any]:
    gen = decoding_batch(model, batch, steps, prompt_tokens)
    done, started, counted = 0, 0.0, 0
    while done < steps:
        prompted, generated = gen.next()
        if not generated and not prompted:
            raise RuntimeError("the batch finished before the steps were done")
        if generated and not done:  # time decoding only, from its first step
            spinner.on.set() if spin else spinner.on.clear()
            started, counted = time.perf_counter(), spinner.count
            timer.seconds, timer.counts = 0.0, 0
        done += bool(generated)
    wall = time.perf_counter() - started
    spun = spinner.count - counted
    spinner.on.clear()
    gen.close()
    row = {"batch": batch, "spinner": spin,
           "step_ms": round(1000 * wall / (steps - 1), 3),  # intervals after the first
           "async_eval_share": round(timer.seconds / wall, 3)}
    if spin:
        row["spinner_rate"] = round(spun / wall / solo, 3)
        row["spinner_rate_inside_async_eval"] = (
            round(timer.counts / timer.seconds / solo, 3) if timer.seconds else None)
    return row


def probe(model_path: str, batches: list[int], steps: int, prompt_tokens: int = 128,
          solo_seconds: float = 1.0) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm import load

    model = load(model_path)[0]
    spinner = Spinner()
    solo = spinner.solo_rate(solo_seconds)
    real_async_eval = mx.async_eval
    timer = _AsyncEvalTimer(real_async_eval, spinner)
    mx.async_eval = timer  # type: ignore[assignment]
    try:
        rows = []
        for batch in batches:
            _decode(model, spinner, timer, solo, batch, steps, prompt_tokens, False)  # warm-up
            for spin in (False, True, False, True):
                rows.append(_decode(model, spinner, timer, solo, batch, steps, prompt_tokens,
                                    spin))
                print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        mx.async_eval = real_async_eval  # type: ignore[assignment]
        spinner.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lock_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--batches", default="1,128", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the probe (default: Python's 0.005 s)")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    probe(args.model, [int(b) for b in args.batches.split(",")], args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
