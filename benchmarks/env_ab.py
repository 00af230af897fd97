"""mlx_serve against itself under different environments, interleaved: one knob's effect.

Starts one mlx_serve per variant on 127.0.0.1 (same model and batch settings, each with
its own extra environment variables), warms each with one burst and one unmeasured run
of the measured shape (``--no-warm-run`` to skip it), then for each round
and concurrency runs every variant on the same fresh prompts, in an order rotated every
round, and prints each run and, per concurrency, every variant's output tokens/s, TTFT
p50 and TPOT p50 relative to the first variant (median [min-max] over rounds). With
--isolate each server is started and warmed for its own run only, so one MLX process
holds the device at a time.

    python -m benchmarks.env_ab --model default-f32 --concurrency 1,8 --rounds 2 \\
        --variant OPENBLAS_NUM_THREADS=1 --variant OPENBLAS_NUM_THREADS=2
    python -m benchmarks.env_ab --model DIR --variant MLX_SERVE_DECODE_BATCH_SIZE=64 ...
    python -m benchmarks.env_ab --stalls --variant PYTHONPATH=COPY_A --variant PYTHONPATH=COPY_B

With --stalls each server logs its event-loop, interpreter-lock and garbage-collection
stalls (benchmarks/stalls.py) and every run reports its worst.

With --pin-stepping CPU every variant's MLX thread runs on that one vCPU and everything
else (the servers' other threads, the load generator) on the rest: on hosts whose vCPUs
run at different speeds, the variants otherwise differ by where the kernel put them
(``benchmarks/placement.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import environment
from benchmarks.ab import RESULTS_DIR
from benchmarks.contenders import (
    MODEL_HELP,
    resolve_model_path,
    resolve_native,
    rotated,
    warm_run_line,
)
from benchmarks.host import describe, describe_quiet, quiet
from benchmarks.loadgen import Target, warm_up
from benchmarks.placement import keep_off, pin_stepping
from benchmarks.report import (
    METRICS,
    cell,
    pair_spread,
    rounds_by_concurrency,
    tok_s_header,
    tok_s_line,
    tok_s_summary,
)
from benchmarks.server_load import measured_load
from benchmarks.servers import (
    BatchConfig,
    NativeLibs,
    ServerProcess,
    add_shape_args,
    mlx_serve_command,
    spawn,
    stop_on_signals,
)
from benchmarks.stalls import describe_stalls, read_stalls, with_stall_log
from benchmarks.threads import describe_threads
from benchmarks.workload import (
    Workload,
    add_length_mix_args,
    build_prompts,
    length_mix,
    load_tokenizer,
)
from mlx_serve.config import Settings, env_name, flag_name

# Of report.METRICS; the step figures say whether a slower variant ran emptier batches
# (fewer tokens a step) or slower steps, the CPU probe whether the host ran it slower.
SHOWN = ("output tok/s", "TTFT p50", "TPOT p50", "CPU ms/token", "CPU ms/token, main thread",
         "CPU ms/token, stepping thread", "CPU ms/token, text thread", "tokens/step",
         "ms/step", "MLX thread busy share", "CPU probe p50")


def parse_variant(text: str) -> dict[str, str]:
    """``A=1,B=2`` -> {"A": "1", "B": "2"}; ``-`` is the unchanged environment."""
    if text == "-":
        return {}
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"not NAME=VALUE[,NAME=VALUE...]: {text!r}")
    return dict(pairs)


def relative_table(runs: list[dict[str, Any]], variants: list[str]) -> str:
    """Each variant's figures over the first variant's, per concurrency."""
    lines = ["| conc | variant | " + " | ".join(SHOWN) + " |", "|---|---|" + "---|" * len(SHOWN)]
    by_conc = rounds_by_concurrency(runs, name="variant", summary=lambda run: run["summary"])
    for conc, rounds in by_conc.items():
        for variant in variants:
            cells = [cell(pair_spread(rounds, variant, variants[0], METRICS[m])) for m in SHOWN]
            lines.append(f"| {conc} | {variant} | " + " | ".join(cells) + " |")
    lines += ["", *tok_s_header("variant")]
    for conc, rounds in by_conc.items():
        for variant in variants[1:]:
            if (t := tok_s_summary(rounds, variant, variants[0])) is not None:
                lines.append(tok_s_line(conc, variant, t))
    return "\n".join(lines)


class _Variants:
    """Starts, waits for and warms the variants' servers; stops them on ``stack``."""

    def __init__(self, args: argparse.Namespace, model: str, workdir: Path,
                 native: NativeLibs, tokenizer: Any) -> None:
        self.args, self.model, self.workdir, self.native = args, model, workdir, native
        self.tokenizer = tokenizer
        self.batch = BatchConfig(args.decode_batch_size, args.prefill_batch_size,
                                 args.prefill_step_size)
        self.extra = {_name(env): (with_stall_log(env, traces=args.stalls == "traces")
                                   if args.stalls else env)
                      for env in args.variant}
        self.started = 0

    def start(self, names: list[str], stack: contextlib.ExitStack) -> dict[str, ServerProcess]:
        servers = {}
        for name in names:
            self.started += 1
            servers[name] = spawn(
                f"variant-{self.started}",
                lambda port, env=self.extra[name]: without_flags_set_in(
                    mlx_serve_command(self.model, port, self.batch), env),
                self.workdir, {**self.native.env(), **self.extra[name]}, stack)
        for i, server in enumerate(servers.values()):
            server.wait_ready(self.args.startup_timeout)
            warm_up(Target(server.base_url, self.args.api), self.tokenizer, self.args.prompt_tokens,
                    max(self.args.concurrency), 999_999 + i)
        return servers


def without_flags_set_in(command: list[str], env: dict[str, str]) -> list[str]:
    """``command`` without the flags (and their values) that ``env`` sets as
    ``MLX_SERVE_*`` variables: a flag wins over its variable, so a variant such as
    ``MLX_SERVE_DECODE_BATCH_SIZE=64`` would otherwise change nothing."""
    flags = {flag_name(name) for name in Settings.model_fields if env_name(name) in env}
    kept: list[str] = []
    skip_value = False
    for word in command:
        if skip_value:
            skip_value = False
        elif word in flags:
            skip_value = True
        else:
            kept.append(word)
    return kept


def _name(env: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in env.items()) or "-"


def _workload(args: argparse.Namespace, conc: int, seed: int) -> Workload:
    count = max(args.min_requests, args.requests_per_stream * conc)
    return Workload(args.prompt_tokens, args.output_tokens, count, conc, seed, None,
                    args.run_time_limit, **length_mix(args))


def warm_runs(args: argparse.Namespace, tokenizer: Any,
              servers: dict[str, ServerProcess]) -> None:
    """One unmeasured run per server, the measured shape at the top concurrency: a
    process's first rounds are its slow ones (page faults, new batch shapes)."""
    workload = _workload(args, max(args.concurrency), 777_777)
    prompts = build_prompts(tokenizer, workload.num_requests, args.prompt_tokens,
                            workload.seed)
    for name, server in servers.items():
        summary = measured_load(server, Target(server.base_url, args.api, request_timeout=60.0),
                                workload, prompts)["summary"]
        print(warm_run_line(name, summary), flush=True)


def _measured_run(args: argparse.Namespace, name: str, server: ServerProcess,
                  servers: dict[str, ServerProcess], rest: set[int] | None,
                  workload: Workload, prompts: list[str]) -> tuple[dict[str, Any], Any]:
    """One measured run of variant ``name``'s server, its MLX thread pinned first where
    ``rest`` is given and the quiet before it measured where asked: (summary, quiet)."""
    if rest is not None:
        pin_stepping(server.pid, None, args.pin_stepping, rest)
    settled = (quiet(args.settle, {n: s.pid for n, s in servers.items()}
                     or {name: server.pid}) if args.settle else None)
    if settled:
        print(describe_quiet(settled), flush=True)
    target = Target(server.base_url, args.api, request_timeout=60.0,
                    health_probe=args.health_probe or None)
    began = time.time()
    summary = measured_load(server, target, workload, prompts)["summary"]
    if args.stalls:
        summary["stalls"] = read_stalls(server.log_path, began, time.time())
    return summary, settled


def run(args: argparse.Namespace) -> dict[str, Any]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="env-ab-", dir=RESULTS_DIR))
    model = resolve_model_path(args.model, workdir)
    tokenizer = load_tokenizer(model)
    variants = _Variants(args, model, workdir, resolve_native("auto", "auto"), tokenizer)
    names = [_name(env) for env in args.variant]
    meta = environment.describe(sys.argv[1:], model, "benchmarks.env_ab")
    if warning := environment.http_parser_warning(meta):
        print(warning, file=sys.stderr)
    runs: list[dict[str, Any]] = []
    # Pinning: this process, and so every server started below, keeps off the vCPU.
    rest = keep_off(args.pin_stepping) if args.pin_stepping is not None else None
    with contextlib.ExitStack() as stack:  # stops every started server, always
        # With --isolate each server runs alone, started for its run: one MLX process
        # holds the device at a time.
        servers = {} if args.isolate else variants.start(names, stack)
        if args.warm_run and not args.isolate:  # isolated runs start every server afresh
            warm_runs(args, tokenizer, servers)
        for rnd in range(args.rounds):
            for conc in args.concurrency:
                workload = _workload(args, conc, 1000 * rnd + conc)
                prompts = build_prompts(tokenizer, workload.num_requests, args.prompt_tokens,
                                        workload.seed)
                for name in rotated(tuple(names), rnd):
                    with contextlib.ExitStack() as alone:
                        server = (variants.start([name], alone)[name] if args.isolate
                                  else servers[name])
                        summary, settled = _measured_run(args, name, server, servers, rest,
                                                         workload, prompts)
                    runs.append({"round": rnd, "concurrency": conc, "variant": name,
                                 "summary": summary, "quiet_before": settled})
                    print(f"round {rnd} c={conc:<4} {name:<32} tok/s "
                          f"{summary['output_throughput']:9.1f}  TTFT p50 "
                          f"{summary['ttft_ms']['p50'] or 0:8.2f}  TPOT p50 "
                          f"{summary['tpot_ms']['p50'] or 0:7.2f}  failed {summary['failed']}  "
                          f"{describe(summary.get('host'))}  {describe_threads(summary)}  "
                          f"{describe_stalls(summary.get('stalls'))}",
                          flush=True)
    print(relative_table(runs, names))
    return {"meta": meta, "argv": sys.argv[1:], "model": model, "variants": names,
            "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.env_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", type=parse_variant, action="append", required=True,
                   help="NAME=VALUE[,NAME=VALUE...] for one server ('-': as is); repeat")
    p.add_argument("--model", default="tiny",
                   help=MODEL_HELP)
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")],
                   default=[1, 16])
    p.add_argument("--rounds", type=int, default=2)
    add_shape_args(p)
    add_length_mix_args(p)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--health-probe", type=float, default=0.0, help="seconds; 0 disables")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--run-time-limit", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds of quiet before every measured run (what the machine and "
                        "the servers did meanwhile is printed)")
    p.add_argument("--stalls", action="store_true",
                   help="log each server's event-loop, lock and GC stalls (benchmarks/stalls.py)"
                        " and report the worst of each run")
    p.add_argument("--stall-traces", action="store_const", dest="stalls", const="traces",
                   help="--stalls, and each stall logs where it happened (in the server logs)")
    p.add_argument("--isolate", action="store_true",
                   help="start each server for its own run only (one MLX process at a time)")
    p.add_argument("--pin-stepping", type=int, default=None, metavar="CPU",
                   help="run every variant's MLX thread on this vCPU and all else on the "
                        "others (Linux)")
    p.add_argument("--warm-run", action=argparse.BooleanOptionalAction, default=True,
                   help="one unmeasured run per server before round 0, the measured shape "
                        "at the largest concurrency (default on; off with --isolate)")
    p.add_argument("--out", default=None, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.variant) < 2:
        raise SystemExit("give at least two --variant")
    stop_on_signals()
    report = run(args)
    out = Path(args.out) if args.out else RESULTS_DIR / "env-ab.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
