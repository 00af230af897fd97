"""What a prefill costs: the model's forward pass alone against mlx-lm's prefill step.

Newcomers' prompts are prefilled inside a batch step, which then lasts as long as the
prefill; at 64-128 streams on the H200 a step that prefills 8 prompts of 128 tokens was
measured at about 70 ms against 8 ms for a decode step, and a newcomer's first token
waits for one or two of them. This separates where that time goes, in-process, with
``decoding`` sequences decoding beside the newcomers as in serving:

- ``forward``: the model on a ``[prompts, tokens - 1]`` batch with a fresh KV cache, then
  ``mx.eval`` of the cache (what mlx-lm's prompt processing evaluates: the last
  token's logits come from the first decode step), the arithmetic once its kernels
  are built;
- ``admitting_step``: the ``BatchGenerator.next()`` that prefills ``prompts``
  newcomers (mlx-lm's prompt processing: batch KV caches, ``mx.eval`` of the caches,
  ``mx.clear_cache()``), and ``to_first_tokens``: every call from their insertion until
  each has its first token (mlx-lm's own schedule: the prefill, the move into the decode
  batch, the decode step), against a decode-only ``next()`` before them.

Each is repeated ``rounds`` times after one unmeasured warm-up; the report gives wall ms
per call (median and range) and the calling thread's CPU ms.

    python -m benchmarks.prefill_step --model MODEL_DIR --prompts 8 --tokens 128 \\
        --decoding 56 --rounds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.decode_step import step_until_all_decode


def _timed(call: Callable[[], Any]) -> tuple[float, float]:
    """(wall ms, thread CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return 1e3 * (time.perf_counter() - wall), 1e3 * (time.thread_time() - cpu)


def _prompts(count: int, tokens: int, seed: int, vocab: int) -> list[list[int]]:
    return [[(seed * 7919 + i * 131 + j * 31) % (vocab - 1) + 1 for j in range(tokens)]
            for i in range(count)]


def time_forward(model: Any, prompts: int, tokens: int, seed: int, vocab: int
                 ) -> tuple[float, float]:
    """The model on a fresh cache, ``prompts`` x ``tokens - 1``, its cache evaluated."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    x = mx.array([p[:-1] for p in _prompts(prompts, tokens, seed, vocab)])
    mx.eval(x)
    cache = make_prompt_cache(model)

    def forward() -> None:
        model(x, cache=cache)
        mx.eval([c.state for c in cache])

    return _timed(forward)


def time_admitting_step(model: Any, prompts: int, tokens: int, decoding: int, seed: int,
                        vocab: int) -> dict[str, Any]:
    """A batch of ``decoding`` sequences decoding; then ``prompts`` newcomers inserted.
    Returns (wall, CPU) ms of the call that prefills them (``admitting_step``), of all
    the calls from their insertion until each newcomer has its first token
    (``to_first_tokens``, and how many calls that took), and of the median decode-only
    call before them (``decode_step``)."""
    from mlx_lm.generate import BatchGenerator

    size = decoding + prompts
    gen = BatchGenerator(model, completion_batch_size=size, prefill_batch_size=max(prompts, 8),
                         prefill_step_size=2048)
    try:
        if decoding:
            gen.insert(_prompts(decoding, tokens, seed + 1, vocab), max_tokens=[1 << 20] * decoding)
            step_until_all_decode(gen, decoding)
        decode = sorted(_timed(gen.next) for _ in range(5))
        waiting = set(gen.insert(_prompts(prompts, tokens, seed, vocab),
                                 max_tokens=[1 << 20] * prompts))
        calls: list[tuple[float, float]] = []
        while waiting:
            if len(calls) > 16:
                raise RuntimeError("the newcomers never got a token")
            wall, cpu = time.perf_counter(), time.thread_time()
            responses = gen.next()[1]
            calls.append((1e3 * (time.perf_counter() - wall), 1e3 * (time.thread_time() - cpu)))
            waiting -= {r.uid for r in responses}
    finally:
        gen.close()
    return {"admitting_step": calls[0], "decode_step": decode[len(decode) // 2],
            "to_first_tokens": (sum(w for w, _ in calls), sum(c for _, c in calls)),
            "calls_to_first_tokens": len(calls)}


def measure(model: Any, prompts: int, tokens: int, decoding: int, rounds: int, vocab: int
            ) -> dict[str, Any]:
    forward, admit, decode, first = [], [], [], []
    calls = []
    for r in range(rounds + 1):  # round 0 builds the kernels and is not counted
        f = time_forward(model, prompts, tokens, r, vocab)
        s = time_admitting_step(model, prompts, tokens, decoding, r, vocab)
        if r:
            forward.append(f)
            admit.append(s["admitting_step"])
            decode.append(s["decode_step"])
            first.append(s["to_first_tokens"])
            calls.append(s["calls_to_first_tokens"])
            print(f"round {r}  forward {f[0]:8.2f} ms (CPU {f[1]:.2f})  admitting step "
                  f"{s['admitting_step'][0]:8.2f} ms (CPU {s['admitting_step'][1]:.2f})  "
                  f"first tokens after {s['calls_to_first_tokens']} calls, "
                  f"{s['to_first_tokens'][0]:8.2f} ms  decode step {s['decode_step'][0]:7.2f} ms",
                  flush=True)

    def summary(rows: list[tuple[float, float]]) -> dict[str, float]:
        walls = [w for w, _ in rows]
        return {"wall_ms_p50": round(statistics.median(walls), 3),
                "wall_ms_min": round(min(walls), 3), "wall_ms_max": round(max(walls), 3),
                "cpu_ms_p50": round(statistics.median(c for _, c in rows), 3)}

    return {"prompts": prompts, "tokens": tokens, "decoding": decoding, "rounds": rounds,
            "forward": summary(forward), "admitting_step": summary(admit),
            "to_first_tokens": summary(first), "calls_to_first_tokens": max(calls),
            "decode_step": summary(decode)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="mlx-lm model folder")
    p.add_argument("--prompts", type=int, default=8, help="newcomers prefilled together")
    p.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--decoding", type=int, default=56, help="sequences decoding beside them")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    from mlx_lm import load

    model, tokenizer = load(args.model)[:2]
    vocab = min(len(tokenizer.get_vocab()), 30000)
    result = measure(model, args.prompts, args.tokens, args.decoding, args.rounds, vocab)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, **result}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
