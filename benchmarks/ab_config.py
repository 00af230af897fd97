"""The A/B runner's settings (``ABConfig``) and the command-line flags that make them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.contenders import MODEL_HELP
from benchmarks.report import CONTENDERS, ENGINE, ENGINE_B, MLX_LM, OURS
from benchmarks.servers import BatchConfig, add_shape_args
from benchmarks.workload import Workload, add_length_mix_args, length_mix


@dataclass(frozen=True)
class ABConfig:
    model: str = "tiny"
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    rounds: int = 3
    prompt_tokens: int = 128
    output_tokens: int = 128
    requests_per_stream: int = 4  # a run sends max(min_requests, this * concurrency)
    min_requests: int = 16
    batch: BatchConfig = BatchConfig()
    api: str = "completions"
    stream: bool = True
    seed: int = 0
    run_time_limit: float = 120.0
    request_timeout: float = 60.0
    startup_timeout: float = 120.0
    health_probe: float | None = 0.2
    targets: tuple[str, ...] = (ENGINE, OURS, MLX_LM)
    blas: str = "auto"  # auto: OpenBLAS for all three when installed (mlx_serve's default)
    allocator: str = "auto"  # auto: jemalloc for all three when installed (the same)
    rate: float | None = None  # open loop (Poisson arrivals); concurrency is then the cap
    long_output_tokens: int | None = None  # a share of long replies among short ones
    long_fraction: float = Workload.long_fraction
    settle: float = 0.0  # seconds of quiet before every measured run
    isolate: bool = False  # start each server for its own run only: one MLX process at a time
    # The engine harness steps with mlx_serve's decode step, not mlx-lm's own: the ratio
    # is then the server's overhead alone.
    engine_one_array_logprobs: bool = False
    # ... and mlx_serve's prefill schedule (a prompt joins decoding a step sooner).
    engine_early_decode_join: bool = False
    # One engine-harness process, the model loaded once, for every engine run (as the
    # servers stay loaded); False (or isolate) starts one per run.
    keep_engine: bool = True
    # No new round starts after this many seconds of measured rounds, once each contender
    # has gone first equally often (None: all ``rounds``).
    time_limit: float | None = None
    # Before the first round, every contender serves one unmeasured run of the measured
    # shape at the largest concurrency: a short burst leaves each process to meet most
    # batch sizes and cache lengths (kernels, graphs, buffers) first in round 0.
    warm_run: bool = True
    # Every contender's stepping thread on this vCPU, everything else on the rest
    # (``placement.py``); None leaves placement to the kernel.
    pin_stepping: int | None = None

    @property
    def engine_kept(self) -> bool:
        """Isolated runs keep one MLX process on the device: the harness is fresh."""
        return self.keep_engine and not self.isolate

    def workload(self, concurrency: int, seed: int) -> Workload:
        n = max(self.min_requests, self.requests_per_stream * concurrency)
        return Workload(self.prompt_tokens, self.output_tokens, n, concurrency, seed,
                        self.rate, self.run_time_limit, self.long_output_tokens,
                        self.long_fraction)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help=MODEL_HELP)
    p.add_argument("--blas", choices=("auto", "openblas", "reference"), default="auto",
                   help="BLAS for all three contenders (auto: OpenBLAS when installed)")
    p.add_argument("--allocator", choices=("auto", "jemalloc", "system"), default="auto",
                   help="memory allocator for all three contenders (auto: jemalloc when "
                        "installed, as mlx_serve does)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated list")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: Poisson arrivals per second (concurrency is the cap)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=None,
                   help="no new round after this many seconds of rounds, once every "
                        "contender has gone first equally often (many short rounds: "
                        "--rounds 100 --time-limit 300)")
    add_shape_args(p)
    add_length_mix_args(p)
    p.add_argument("--requests-per-stream", type=int, default=4,
                   help="a run sends max(--min-requests, this x concurrency) requests")
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--run-time-limit", type=float, default=120.0, help="seconds per run")
    p.add_argument("--health-probe", type=float, default=0.2, help="seconds; 0 disables")
    p.add_argument("--targets", type=parse_targets, default=f"{ENGINE},{OURS},{MLX_LM}",
                   help=f"comma-separated contenders out of {', '.join(CONTENDERS)}; "
                        f"{ENGINE_B} is a second engine-harness process, an A/A control")
    p.add_argument("--mlx-cache-limit-bytes", type=int, default=None,
                   help="cap MLX's buffer cache in the engine harness and mlx_serve "
                        "(needed when the device's memory is shared, e.g. a large model)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds of quiet before every measured run (same for all)")
    p.add_argument("--isolate", action="store_true",
                   help="start each server for its own run only (warmed each time), so one "
                        "MLX process holds the device at a time")
    _add_engine_harness_args(p)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, < 2 minutes")
    _add_memory_mode_args(p)
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/)")
    return p


def _add_engine_harness_args(p: argparse.ArgumentParser) -> None:
    """How the engine harness runs, and where the stepping threads run."""
    p.add_argument("--engine-one-array-logprobs", action="store_true",
                   help="the engine harness steps with mlx_serve's decode step instead of "
                        "mlx-lm's own (the ratio is then the server's overhead alone)")
    p.add_argument("--engine-early-decode-join", action="store_true",
                   help="the engine harness moves prefilled prompts into decoding a step "
                        "sooner, as mlx_serve does (mlx-lm's own schedule otherwise)")
    p.add_argument("--engine-process", choices=("kept", "fresh"), default="kept",
                   help="kept: one engine-harness process loads the model once and runs "
                        "every engine run, as the servers stay loaded (default); fresh: a "
                        "process per run (always so with --isolate)")
    p.add_argument("--warm-run", action=argparse.BooleanOptionalAction, default=True,
                   help="one unmeasured run per contender before round 0, the measured "
                        "shape at the largest concurrency (default on; off with --isolate)")
    p.add_argument("--pin-stepping", type=int, default=None, metavar="CPU",
                   help="pin the engine harness's and mlx_serve's stepping threads to this "
                        "vCPU before every run, and everything else (their other threads, "
                        "mlx_lm.server, the load generator) to the other vCPUs (Linux; "
                        "not with --isolate or --engine-process fresh)")


def _add_memory_mode_args(p: argparse.ArgumentParser) -> None:
    """Memory mode: RSS drift over many requests instead of A/B rounds."""
    p.add_argument("--rss-run", type=int, default=None, metavar="N",
                   help="memory mode: N requests against mlx_serve, RSS drift")
    p.add_argument("--rss-warmup", type=int, default=None, metavar="N",
                   help="memory mode: warm-up requests before the first reading "
                        "(default N/10; enough to fill the prefix cache separates a leak "
                        "from the cache filling)")


def parse_targets(text: str) -> tuple[str, ...]:
    """``--targets``: known contenders, each once."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if unknown := [n for n in names if n not in CONTENDERS]:
        raise argparse.ArgumentTypeError(
            f"unknown contender {', '.join(unknown)}: choose from {', '.join(CONTENDERS)}")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("name each contender once, at least one")
    return names


def config_from_args(args: argparse.Namespace) -> ABConfig:
    if args.quick:
        return ABConfig(model="tiny", concurrencies=(1, 8), rounds=2, prompt_tokens=64,
                        output_tokens=32, requests_per_stream=2, min_requests=8,
                        batch=BatchConfig(8, 8, 512), run_time_limit=30.0, blas=args.blas,
                        allocator=args.allocator, warm_run=False)
    return ABConfig(
        model=args.model, concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
        rounds=args.rounds, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, requests_per_stream=args.requests_per_stream,
        min_requests=args.min_requests,
        batch=BatchConfig(args.decode_batch_size, args.prefill_batch_size,
                          args.prefill_step_size, args.mlx_cache_limit_bytes),
        api=args.api, stream=args.stream, run_time_limit=args.run_time_limit,
        health_probe=args.health_probe or None, targets=args.targets,
        blas=args.blas, allocator=args.allocator, rate=args.rate, settle=args.settle,
        isolate=args.isolate,
        engine_one_array_logprobs=args.engine_one_array_logprobs,
        engine_early_decode_join=args.engine_early_decode_join,
        keep_engine=args.engine_process == "kept", warm_run=args.warm_run,
        time_limit=args.time_limit, pin_stepping=args.pin_stepping, **length_mix(args))
