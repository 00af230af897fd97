"""A/B runner: the engine limit, mlx_serve and mlx_lm.server on one model, interleaved.

One invocation builds or locates the model, starts both servers on 127.0.0.1 (free
ports, same model, same batch settings), waits for readiness (bounded), then for each
round and each concurrency runs engine, mlx_serve, mlx_lm (in an order rotated every
round: ``contenders.rotated``) on the same fresh prompts, and prints per-concurrency
ratios (median [min-max] over rounds). ``engine_b``, when named in ``--targets``, is a
second engine-harness process of its own: an A/A control, engine_b over engine says how
far two identical processes read apart on this host. Raw results go to
benchmarks/results/. Every started process is stopped on the way out, Ctrl-C and SIGTERM
included; every run is bounded in requests and time.

    python -m benchmarks.ab --model tiny --concurrency 1,4,16,64 --rounds 3
    python -m benchmarks.ab --quick                  # smoke run, under two minutes
    python -m benchmarks.ab --model tiny --rss-run 2000   # memory drift of mlx_serve
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import environment
from benchmarks.ab_config import ABConfig, build_parser, config_from_args
from benchmarks.contenders import resolve_model_path, resolve_native, rotated, warm_run_line
from benchmarks.engine_worker import (
    EngineWorker,
    harness_command,
    job_files,
    job_result,
    run_fresh,
)
from benchmarks.host import describe_quiet, quiet
from benchmarks.loadgen import Target, warm_up
from benchmarks.memory import rss_run
from benchmarks.placement import keep_off, machine_vcpus, pin_stepping
from benchmarks.report import (
    ENGINE,
    ENGINE_B,
    MLX_LM,
    OURS,
    format_ratios,
    format_runs,
    ratios,
)
from benchmarks.server_load import measured_load
from benchmarks.servers import (
    NativeLibs,
    ServerProcess,
    mlx_lm_command,
    mlx_serve_command,
    spawn,
    stop_on_signals,
)
from benchmarks.workload import Workload, build_prompts, chat_prompt_ids, load_tokenizer

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class ABRunner:
    def __init__(self, config: ABConfig, model_path: str, workdir: Path,
                 servers: dict[str, ServerProcess], native: NativeLibs,
                 stack: contextlib.ExitStack, vcpus: list[int] | None = None) -> None:
        self.config, self.model_path, self.workdir = config, model_path, workdir
        self.servers, self.native, self.stack = servers, native, stack
        # The kept engine-harness processes by contender, each started at its first run.
        self.engines: dict[str, EngineWorker] = {}
        self.tokenizer = load_tokenizer(model_path)
        self.runs: list[dict[str, Any]] = []
        # The vCPUs the quiet before a run sweeps with the probe: all of the machine's.
        self.vcpus = vcpus or machine_vcpus()
        self.rest = set(self.vcpus) - {config.pin_stepping}

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
                    settled = self.settle()
                    result = self.run_one(name, workload, prompts, warmup)
                    self.runs.append({"round": rnd, "concurrency": conc, "target": name,
                                      "result": result, "quiet_before": settled})
                    print(format_runs(self.runs[-1:]), flush=True)

    def settle(self) -> dict[str, Any] | None:
        """``--settle`` seconds of quiet, and what every loaded contender's process and
        the machine still did meanwhile (printed, and kept with the next run)."""
        if not self.config.settle:
            return None
        pids = {name: server.pid for name, server in self.servers.items()}
        pids.update({name: worker.pid for name, worker in self.engines.items()})
        record = quiet(self.config.settle, pids, self.vcpus)
        print(describe_quiet(record), flush=True)
        return record

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
        if name in ENGINES:
            return self.run_engine(name, workload, prompts, warmup)
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
        if cfg.pin_stepping is not None and server.name == OURS:
            self.pin(server.pid, None)
        return measured_load(server, target, workload, prompts, tuple(warmup))

    def run_engine(self, name: str, workload: Workload, prompts: list[str],
                   warmup: list[str]) -> dict[str, Any]:
        """The engine harness on these prompts: in ``name``'s kept process, or a fresh one."""
        cfg, log_path = self.config, self.workdir / f"{name}.log"
        def given(texts: list[str]) -> list[str] | list[list[int]]:
            # The servers run the chat template's tokens over chat: so must the harness.
            if cfg.api != "chat":
                return texts
            return [chat_prompt_ids(self.tokenizer, text) for text in texts]

        prompts_file, out = job_files(self.workdir, given(prompts), given(warmup))
        command = harness_command(self.model_path, cfg.batch, cfg.engine_one_array_logprobs,
                                  cfg.engine_early_decode_join)
        if cfg.engine_kept:
            worker = self.engines.get(name)
            if worker is None:
                worker = self.engines[name] = EngineWorker(
                    command, self.native.env(), log_path, cfg.startup_timeout)
                self.stack.callback(worker.stop)
            if cfg.pin_stepping is not None:  # the harness steps in its main thread
                self.pin(worker.pid, worker.pid)
            worker.run(workload, prompts_file, out)
        else:
            run_fresh(command, workload, prompts_file, out, self.native.env(), log_path)
        return job_result(out, log_path)

    def pin(self, pid: int, stepping_tid: int | None) -> None:
        cpu = self.config.pin_stepping
        assert cpu is not None
        pin_stepping(pid, stepping_tid, cpu, self.rest)

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
ENGINES = (ENGINE, ENGINE_B)


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
    vcpus = machine_vcpus()
    if config.pin_stepping is not None:
        if not config.engine_kept:
            raise SystemExit("--pin-stepping needs the kept engine process (no --isolate, "
                             "no --engine-process fresh)")
        keep_off(config.pin_stepping)  # the servers started below inherit the rest
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
            runner = ABRunner(config, model_path, workdir, servers, native, stack, vcpus)
            if rss_requests:
                report["rss"] = rss_run(servers[OURS], runner, rss_requests, rss_warmup)
            else:
                runner.warm_servers()
                runner.run_all()
    except KeyboardInterrupt:
        report["interrupted"] = True
        print("interrupted; every started server has been stopped", file=sys.stderr)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:  # a contender
        # failed (a server that did not start in time included): keep the runs measured
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"stopped: {report['error']}", file=sys.stderr)
    if runner is not None and runner.runs:
        report["runs"], report["ratios"] = runner.runs, ratios(runner.runs)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    stop_on_signals()
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
