"""mlx-lm's decode step against mlx_serve's one-array step, in-process, alternating.

For each batch size: fill a BatchGenerator with that many 128-token prompts (no stop
tokens, so the batch stays full), then time ``steps`` decode steps, wall and the calling
thread's CPU, once with mlx-lm's ``GenerationBatch._step`` and once with
``one_array_step``; ``rounds`` times, alternating. Also checks that both produced the
same tokens.

    python -m benchmarks.decode_step --model MODEL_DIR --batches 1,64,128 \\
        --steps 100 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def step_until_all_decode(gen: Any, count: int) -> None:
    """Step ``gen`` through its prefills until one step gives each of its ``count``
    sequences a token; bounded, so a batch that never fills raises."""
    for _ in range(2 * count + 64):
        if len(gen.next()[1]) == count:
            return
    raise RuntimeError(f"the batch of {count} sequences never filled")


def time_steps(model: Any, batch: int, steps: int, one_array: bool,
               vocab: int) -> dict[str, Any]:
    """Decode ``steps`` steps of a full batch; ms per step (wall, thread CPU), tokens."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, StopSequences
    from mlx_lm.sample_utils import greedy_sampler

    from mlx_serve.runner.decode_step import use_one_array_step

    mx.random.seed(0)
    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=8)
    if one_array and not use_one_array_step(gen):
        raise RuntimeError("this mlx-lm has no one-array decode step")
    prompts = [[(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(128)]
               for i in range(batch)]
    gen.insert(prompts, max_tokens=[1 << 30] * batch, samplers=[greedy_sampler] * batch,
               logits_processors=[[] for _ in prompts],
               stop_sequences=[StopSequences([])] * batch)
    tokens: list[list[int]] = []
    try:
        step_until_all_decode(gen, batch)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            tokens.append([r.token for r in gen.next()[1]])
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        gen.close()
    return {"ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
            "tokens": tokens}


def compare(model: Any, batches: list[int], steps: int, rounds: int, vocab: int
            ) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        for rnd in range(rounds):
            stock = time_steps(model, batch, steps, False, vocab)
            ours = time_steps(model, batch, steps, True, vocab)
            row = {"batch": batch, "round": rnd, "same_tokens": stock["tokens"] == ours["tokens"]}
            for name, run in (("mlx_lm", stock), ("one_array", ours)):
                row[name] = {k: round(v, 3) for k, v in run.items() if k != "tokens"}
            rows.append(row)
            print(f"batch {batch:4d} round {rnd}  mlx-lm step {stock['ms_per_step']:7.2f} ms "
                  f"(CPU {stock['cpu_ms_per_step']:.2f})  one-array {ours['ms_per_step']:7.2f} "
                  f"ms (CPU {ours['cpu_ms_per_step']:.2f})  same tokens {row['same_tokens']}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--batches", default="1,64,128")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    from mlx_lm import load

    model, tokenizer = load(args.model)[:2]
    vocab = min(len(tokenizer.get_vocab()), 30000)
    rows = compare(model, [int(b) for b in args.batches.split(",")], args.steps,
                   args.rounds, vocab)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "rows": rows}, fh, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
