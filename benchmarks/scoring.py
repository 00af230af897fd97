"""Prompt scoring (completions' echo with logprobs) against plain one-token completions.

Evaluation harnesses score texts through mlx_serve by sending them as prompts with
``echo``, ``logprobs`` and ``max_tokens: 1`` (lm-evaluation-harness's loglikelihood
requests). Scoring needs the model's vocabulary projection at every prompt position,
where a plain completion needs it at the last one only. This measures what that costs
a server: one mlx_serve on 127.0.0.1 (its prefix cache off), the same fresh prompts sent
both ways in each round, closed loop at ``--concurrency``, the two kinds alternating
which goes first.

    python -m benchmarks.scoring --model default-f32 --requests 32 --concurrency 8 \\
        --prompt-tokens 100 --rounds 3

Prints each round's wall time per kind and their ratio (scored over plain), and the
median [min-max] of the ratios; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.contenders import resolve_model_path, resolve_native
from benchmarks.servers import BatchConfig, mlx_serve_command, spawn, stop_on_signals
from benchmarks.workload import build_prompts, load_tokenizer

KINDS = ("plain", "scored")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, default, default-f32 or a folder")
    p.add_argument("--requests", type=int, default=32, help="requests per kind and round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--logprobs", type=int, default=1, help="alternatives per scored token")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-batch-size", type=int, default=BatchConfig.prefill_batch_size)
    p.add_argument("--prefill-step-size", type=int, default=BatchConfig.prefill_step_size)
    p.add_argument("--blas", default="auto", choices=("auto", "openblas", "reference"))
    p.add_argument("--allocator", default="auto", choices=("auto", "jemalloc", "system"))
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


async def send_all(base_url: str, prompts: list[str], concurrency: int, extra: dict[str, Any],
                   timeout: float) -> float:
    """Wall seconds to get every prompt's reply, ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        async def one(prompt: str) -> None:
            async with gate:
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
                reply = await client.post("/v1/completions", json=body)
                if reply.status_code != 200:
                    raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    extras = {"plain": {}, "scored": {"echo": True, "logprobs": args.logprobs}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = resolve_model_path(args.model, Path(tmp))
        tokenizer = load_tokenizer(model)
        native = resolve_native(args.blas, args.allocator)
        batch = BatchConfig(prefill_batch_size=args.prefill_batch_size,
                            prefill_step_size=args.prefill_step_size)
        # No prefix cache: the second kind of a round would find the first one's prompts.
        server = spawn("mlx_serve", lambda port: mlx_serve_command(model, port, batch)
                       + native.mlx_serve_flags() + ["--prefix-cache-bytes", "0"],
                       Path(tmp), native.env(), stack)
        server.wait_ready(600)

        def run(kind: str, prompts: list[str]) -> float:
            return asyncio.run(send_all(server.base_url, prompts, args.concurrency,
                                        extras[kind], args.request_timeout))

        for kind in KINDS:  # warm both paths (first kernels, batch shapes) unmeasured
            run(kind, build_prompts(tokenizer, args.concurrency, args.prompt_tokens, -1))
        rounds = []
        for rnd in range(args.rounds):
            prompts = build_prompts(tokenizer, args.requests, args.prompt_tokens, rnd)
            order = KINDS if rnd % 2 == 0 else KINDS[::-1]
            seconds = {kind: run(kind, prompts) for kind in order}
            ratio = seconds["scored"] / seconds["plain"]
            rounds.append({"round": rnd, "order": list(order), "seconds": seconds,
                           "scored_over_plain": ratio})
            print(f"round {rnd}: plain {seconds['plain']:.2f} s, scored "
                  f"{seconds['scored']:.2f} s, scored/plain {ratio:.2f}", flush=True)
    ratios = [r["scored_over_plain"] for r in rounds]
    print(f"scored/plain time: {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} rounds "
          f"({args.requests} requests of {args.prompt_tokens} tokens, "
          f"{args.concurrency} in flight, logprobs {args.logprobs})")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
