"""What one token's text costs on this host, with no model and no other thread running.

The runner turns every generated token into text on the MLX thread: mlx-lm's streaming
detokenizer, the stop-string matcher, and the reply's delta (``TextPipeline.advance``).
This times exactly that over random token ids of a model's tokenizer, ``--streams``
requests at a time, with the runner's detokenizer and with mlx-lm's own in alternate
rounds, so that the per-token cost the phase probe reads in serving can be set against
the host's own speed for the same Python.

    python -m benchmarks.text_cost --model MODEL_DIR [--streams 128] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
from mlx_serve.runner.detokenizer import streaming_detokenizers
from mlx_serve.runner.text import TextPipeline


def time_advance(tokenizer: Any, streams: int, tokens: int, seed: int = 0,
                 runner_detokenizer: bool = True) -> dict[str, float]:
    """One round: ``streams`` fresh pipelines, ``tokens`` random tokens each, stepped
    together as a batch steps them; the last token of each ends its request. With
    ``runner_detokenizer`` the runner's detokenizer, else mlx-lm's own."""
    rng = random.Random(seed)
    new_detokenizer = streaming_detokenizers(tokenizer) if runner_detokenizer \
        else (lambda: tokenizer.detokenizer)
    vocab = len(getattr(tokenizer.detokenizer, "tokenmap", ())) or tokenizer.vocab_size
    ids = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(streams)]
    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=tokens), None, 0,
                                OutputOptions())
    pipes = [TextPipeline(new_detokenizer(), request, None) for _ in range(streams)]
    chars = 0
    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
    for step in range(tokens):
        finish = "length" if step == tokens - 1 else None
        for pipe, stream in zip(pipes, ids, strict=True):
            chars += len(pipe.advance(stream[step], finish).content)
    cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    calls = streams * tokens
    return {"calls": calls, "cpu_us_per_token": round(cpu / calls / 1e3, 3),
            "wall_us_per_token": round(wall / calls / 1e3, 3), "chars": chars}


def measure(model: Path, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    """Rounds of the runner's detokenizer and of mlx-lm's own, alternating."""
    tokenizer = load_tokenizer(model)
    runs = {"runner": [], "mlx_lm": []}
    for seed in range(rounds):
        for name in runs:
            runs[name].append(time_advance(tokenizer, streams, tokens, seed, name == "runner"))
    return {"model": str(model), "streams": streams, "tokens": tokens,
            "detokenizer": type(streaming_detokenizers(tokenizer)()).__name__,
            "mlx_lm_detokenizer": type(tokenizer.detokenizer).__name__,
            "rounds": runs["runner"], "mlx_lm_rounds": runs["mlx_lm"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.text_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="a model folder (its tokenizer)")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    result = measure(args.model, args.streams, args.tokens, args.rounds)
    print(f"{args.streams} streams x {args.tokens} tokens; us of CPU / wall a token")
    for i, (ours, theirs) in enumerate(zip(result["rounds"], result["mlx_lm_rounds"],
                                           strict=True)):
        print(f"round {i}: runner ({result['detokenizer']}) {ours['cpu_us_per_token']:.2f} / "
              f"{ours['wall_us_per_token']:.2f}; mlx-lm's ({result['mlx_lm_detokenizer']}) "
              f"{theirs['cpu_us_per_token']:.2f} / {theirs['wall_us_per_token']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
