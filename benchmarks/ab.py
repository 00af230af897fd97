"""A/B runner: the engine limit, mlx_serve and mlx_lm.server on one model, interleaved.

One invocation builds or locates the model, starts both servers on 127.0.0.1 (free
ports, same model, same batch settings), waits for readiness (bounded), then for each
round and each concurrency runs engine, mlx_serve, mlx_lm (in an order rotated every
round: ``contenders.rotated``) on the same fresh prompts, and prints per-concurrency
ratios (median [min-max] over rounds). Raw results go to benchmarks/results/. Every
started process is stopped on the way out, Ctrl-C and SIGTERM included; every run is
bounded in requests and time.

    python -m benchmarks.ab --model tiny --concurrency 1,4,16,64 --rounds 3
    python -m benchmarks.ab --quick                  # smoke run, under two minutes
    python -m benchmarks.ab --model tiny --rss-run 2000   # memory drift of mlx_serve
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import environment
from benchmarks.contenders import (
    MODEL_HELP,
    resolve_model_path,
    resolve_native,
    rotated,
    warm_run_line,
)
from benchmarks.engine_worker import EngineWorker, harness_command, run_fresh
from benchmarks.loadgen import Target, warm_up
from benchmarks.memory import rss_run
from benchmarks.report import ENGINE, MLX_LM, OURS, format_ratios, format_runs, ratios
from benchmarks.server_load import measured_load
from benchmarks.servers import (
    BatchConfig,
    NativeLibs,
    ServerProcess,
    add_shape_args,
    mlx_lm_command,
    mlx_serve_command,
    spawn,
)
from benchmarks.workload import (
    Workload,
    add_length_mix_args,
    build_prompts,
    length_mix,
    load_tokenizer,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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

    @property
    def engine_kept(self) -> bool:
        """Isolated runs keep one MLX process on the device: the harness is fresh."""
        return self.keep_engine and not self.isolate

    def workload(self, concurrency: int, seed: int) -> Workload:
        n = max(self.min_requests, self.requests_per_stream * concurrency)
        return Workload(self.prompt_tokens, self.output_tokens, n, concurrency, seed,
                        self.rate, self.run_time_limit, self.long_output_tokens,
                        self.long_fraction)


class ABRunner:
    def __init__(self, config: ABConfig, model_path: str, workdir: Path,
                 servers: dict[str, ServerProcess], native: NativeLibs,
                 stack: contextlib.ExitStack) -> None:
        self.config, self.model_path, self.workdir = config, model_path, workdir
        self.servers, self.native, self.stack = servers, native, stack
        self.engine: EngineWorker | None = None  # started at its first run, if kept
        self.tokenizer = load_tokenizer(model_path)
        self.runs: list[dict[str, Any]] = []

    def prompts(self, workload: Workload) -> tuple[list[str], list[str]]:
        """Fresh prompts per (round, concurrency): no server ever sees one twice."""
        texts = build_prompts(self.tokenizer, workload.num_requests + 1,
                              workload.prompt_tokens, workload.seed)
        return texts[1:], texts[:1]

    def run_all(self) -> None:
        cfg = self.config
        if cfg.warm_run and not cfg.isolate:  # isolated runs start every process afresh
            self.warm_runs()
        started = time.monotonic()
        for rnd in range(cfg.rounds):
            if not round_may_start(rnd, len(cfg.targets), time.monotonic() - started,
                                   cfg.time_limit):
                print(f"time limit: {rnd} rounds", flush=True)
                break
            for conc in cfg.concurrencies:
                workload = cfg.workload(conc, cfg.seed + 1000 * rnd + conc)
                prompts, warmup = self.prompts(workload)
                for name in rotated(cfg.targets, rnd):
                    time.sleep(cfg.settle)
                    result = self.run_one(name, workload, prompts, warmup)
                    self.runs.append({"round": rnd, "concurrency": conc, "target": name,
                                      "result": result})
                    print(format_runs(self.runs[-1:]), flush=True)

    def warm_runs(self) -> None:
        """One unmeasured run per contender, the measured shape at the top concurrency."""
        cfg = self.config
        workload = cfg.workload(max(cfg.concurrencies), cfg.seed + 777_777)
        prompts, warmup = self.prompts(workload)
        for name in cfg.targets:
            summary = self.run_one(name, workload, prompts, warmup)["summary"]
            print(warm_run_line(name, summary), flush=True)

    def run_one(self, name: str, workload: Workload, prompts: list[str],
                warmup: list[str]) -> dict[str, Any]:
        if name == ENGINE:
            return self.run_engine(workload, prompts, warmup)
        if not self.config.isolate:
            return self.run_server(self.servers[name], workload, prompts, warmup)
        # Only this server holds the device during its run: with two MLX processes
        # loaded on one H200 (each sizing its buffer cache to the whole device), the
        # same server code measured up to 2x apart.
        with contextlib.ExitStack() as stack:
            server = start_server(name, self.config, self.model_path, self.workdir,
                                  self.native, stack)
            server.wait_ready(self.config.startup_timeout)
            self.warm(name, server)
            time.sleep(self.config.settle)
            return self.run_server(server, workload, prompts, warmup)

    def run_server(self, server: ServerProcess, workload: Workload, prompts: list[str],
                   warmup: list[str]) -> dict[str, Any]:
        cfg = self.config
        target = Target(server.base_url, cfg.api, cfg.stream, None, cfg.request_timeout,
                        cfg.health_probe)
        return measured_load(server, target, workload, prompts, tuple(warmup))

    def run_engine(self, workload: Workload, prompts: list[str],
                   warmup: list[str]) -> dict[str, Any]:
        """The engine harness on these prompts: in its kept process, or a fresh one."""
        prompts_file = self.workdir / "prompts.json"
        out = self.workdir / "engine.json"
        prompts_file.write_text(json.dumps({"prompts": prompts, "warmup": warmup}))
        out.unlink(missing_ok=True)  # never report an earlier run's result as this one's
        cfg, log_path = self.config, self.workdir / "engine.log"
        command = harness_command(self.model_path, cfg.batch, cfg.engine_one_array_logprobs,
                                  cfg.engine_early_decode_join)
        if cfg.engine_kept:
            if self.engine is None:
                self.engine = EngineWorker(command, self.native.env(), log_path,
                                           cfg.startup_timeout)
                self.stack.callback(self.engine.stop)
            self.engine.run(workload, prompts_file, out)
        else:
            run_fresh(command, workload, prompts_file, out, self.native.env(), log_path)
        if not out.exists():
            raise RuntimeError(f"the engine harness wrote no result; see {log_path}")
        return dict(json.loads(out.read_text()))

    def warm_servers(self) -> None:
        for name, server in self.servers.items():
            self.warm(name, server)

    def warm(self, name: str, server: ServerProcess) -> None:
        """One burst at the largest concurrency, short outputs, prompts of its own."""
        cfg = self.config
        target = Target(server.base_url, cfg.api, cfg.stream, None, cfg.request_timeout)
        summary = warm_up(target, self.tokenizer, cfg.prompt_tokens, max(cfg.concurrencies),
                          cfg.seed + 999_999)
        print(f"warm-up {name}: {summary['completed']} ok, {summary['failed']} failed",
              flush=True)


SERVER_COMMANDS = {OURS: mlx_serve_command, MLX_LM: mlx_lm_command}


def round_may_start(rnd: int, contenders: int, elapsed: float, limit: float | None) -> bool:
    """Whether round ``rnd`` starts: always before ``limit`` seconds, and the first
    cycle of the rotation always; after it, only to complete a cycle, so that every
    contender has gone first equally often (the first in a round can read several %
    apart from the second)."""
    return limit is None or elapsed < limit or rnd % max(contenders, 1) != 0 or rnd == 0


def start_server(name: str, config: ABConfig, model_path: str, workdir: Path,
                 native: NativeLibs, stack: contextlib.ExitStack) -> ServerProcess:
    """Start one server (not waiting for it) and register its stop on ``stack``."""

    def command(port: int) -> list[str]:
        argv = SERVER_COMMANDS[name](model_path, port, config.batch)
        if name == OURS:
            argv.extend(native.mlx_serve_flags())
        return argv

    return spawn(name, command, workdir, native.env(), stack)


def start_servers(config: ABConfig, model_path: str, workdir: Path, native: NativeLibs,
                  stack: contextlib.ExitStack) -> dict[str, ServerProcess]:
    """Start the servers the config names, register their stop, wait (bounded) for ready."""
    if config.isolate:
        return {}  # each is started for its own runs
    servers = {name: start_server(name, config, model_path, workdir, native, stack)
               for name in config.targets if name in SERVER_COMMANDS}
    for server in servers.values():
        server.wait_ready(config.startup_timeout)
        print(f"{server.name} ready on {server.base_url} (pid {server.pid})", flush=True)
    return servers


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_ab(config: ABConfig, rss_requests: int | None, argv: list[str],
           rss_warmup: int | None = None) -> dict[str, Any]:
    """The whole A/B (or the memory mode); an interrupt keeps what was measured so far."""
    started = time.monotonic()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ab-", dir=RESULTS_DIR))
    model_path = resolve_model_path(config.model, workdir)
    native = resolve_native(config.blas, config.allocator)
    if rss_requests:
        config = replace(config, targets=(OURS,), isolate=False)
    report: dict[str, Any] = {"meta": environment.describe(argv, model_path),
                              "config": asdict(config), "openblas": native.openblas,
                              "jemalloc": native.jemalloc,
                              "workdir": str(workdir)}
    if warning := environment.http_parser_warning(report["meta"]):
        print(warning, file=sys.stderr)
    runner: ABRunner | None = None
    try:
        with contextlib.ExitStack() as stack:  # stops every started server, always
            servers = start_servers(config, model_path, workdir, native, stack)
            runner = ABRunner(config, model_path, workdir, servers, native, stack)
            if rss_requests:
                report["rss"] = rss_run(servers[OURS], runner, rss_requests, rss_warmup)
            else:
                runner.warm_servers()
                runner.run_all()
    except KeyboardInterrupt:
        report["interrupted"] = True
        print("interrupted; every started server has been stopped", file=sys.stderr)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a contender failed: keep the rest
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"stopped: {report['error']}", file=sys.stderr)
    if runner is not None and runner.runs:
        report["runs"], report["ratios"] = runner.runs, ratios(runner.runs)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


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
    p.add_argument("--targets", default=f"{ENGINE},{OURS},{MLX_LM}")
    p.add_argument("--mlx-cache-limit-bytes", type=int, default=None,
                   help="cap MLX's buffer cache in the engine harness and mlx_serve "
                        "(needed when the device's memory is shared, e.g. a large model)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds of quiet before every measured run (same for all)")
    p.add_argument("--isolate", action="store_true",
                   help="start each server for its own run only (warmed each time), so one "
                        "MLX process holds the device at a time")
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
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, < 2 minutes")
    p.add_argument("--rss-run", type=int, default=None, metavar="N",
                   help="memory mode: N requests against mlx_serve, RSS drift")
    p.add_argument("--rss-warmup", type=int, default=None, metavar="N",
                   help="memory mode: warm-up requests before the first reading "
                        "(default N/10; enough to fill the prefix cache separates a leak "
                        "from the cache filling)")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/)")
    return p


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
        health_probe=args.health_probe or None, targets=tuple(args.targets.split(",")),
        blas=args.blas, allocator=args.allocator, rate=args.rate, settle=args.settle,
        isolate=args.isolate,
        engine_one_array_logprobs=args.engine_one_array_logprobs,
        engine_early_decode_join=args.engine_early_decode_join,
        keep_engine=args.engine_process == "kept", warm_run=args.warm_run,
        time_limit=args.time_limit, **length_mix(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    # A shell may start us with SIGINT ignored (background jobs): take it back, so Ctrl-C
    # and SIGTERM both end the run through the servers' stop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    report = run_ab(config, args.rss_run, argv, args.rss_warmup)
    out = Path(args.out) if args.out else RESULTS_DIR / f"ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    if "ratios" in report:
        print()
        print(format_ratios(report["ratios"]))
    print(f"\nwall {report['wall_s']} s; results in {out}")
    if report.get("interrupted"):
        return 130
    if report.get("error"):
        return 1
    # mlx_lm.server's failures are a finding; ours or the engine's fail the run.
    ours_failed = sum(r["result"]["summary"]["failed"] for r in report.get("runs", [])
                      if r["target"] != MLX_LM)
    ours_failed += report.get("rss", {}).get("failed", 0)
    return 1 if ours_failed else 0


if __name__ == "__main__":
    sys.exit(main())
