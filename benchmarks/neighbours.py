"""The engine harness beside busy neighbour processes: what other busy vCPUs cost its step.

A server's stepping thread runs while its event loop and the load generator keep other
vCPUs busy; the engine harness runs alone. On a host whose vCPUs share physical cores
or a power budget with each other, a busy neighbour slows a thread that does the same
work. This measures that directly, with no server in the way: the engine harness (one
kept process, the model loaded once) on the same workload alone and beside neighbour
processes, each variant in every position over the rounds, with quiet before every run.
It prints each variant's tok/s and its stepping thread's user CPU a step relative to the
harness alone in the same round, and how many vCPUs the machine kept busy.

Neighbours (``--variant``, repeatable; ``0`` is the harness alone):

- ``spin:N``: N processes, each running a pure-Python loop without pause (a busy event
  loop, always ready to run).
- ``pingpong:N``: N pairs of processes passing one byte back and forth over a socket
  pair (an event loop and a client: every message a wake-up on another vCPU).
- ``thread:W/P``: no other process, but a thread in the harness's own process that runs
  W microseconds of pure Python every P milliseconds (``beside_thread.py``): the
  interpreter lock shared in bursts, as with a server's event loop.
- ``offmain``: no neighbour, but the harness steps in a thread other than its process's
  main one, as mlx_serve's MLX thread does.

    python -m benchmarks.neighbours --model tiny --concurrency 64 --rounds 2 --settle 5 \\
        --variant 0 --variant spin:2 --variant pingpong:1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import environment
from benchmarks.ab import RESULTS_DIR
from benchmarks.contenders import MODEL_HELP, resolve_model_path, resolve_native, rotated
from benchmarks.engine_worker import EngineWorker, harness_command, job_files, job_result
from benchmarks.host import busy_vcpus, cpu_times, describe_quiet, quiet
from benchmarks.servers import BatchConfig, add_shape_args, stop_on_signals
from benchmarks.workload import Workload, build_prompts, load_tokenizer

_SPIN = """
print("ready", flush=True)
x = 0
while True:
    x = (x * 7 + 1) % 1000003
"""

# The child answers every byte; it ends when the parent's end of the pair closes.
_PINGPONG = """
import os, socket
a, b = socket.socketpair()
if os.fork() == 0:
    a.close()
    while b.recv(64):
        b.send(b"x")
    os._exit(0)
b.close()
print("ready", flush=True)
while True:
    a.send(b"x")
    a.recv(64)
"""

KINDS = {"spin": _SPIN, "pingpong": _PINGPONG}
READY_TIMEOUT_S = 30.0


Variant = tuple[str, str]  # (kind, its argument): ("spin", "2"), ("thread", "100/1")
ALONE: Variant = ("alone", "")


def parse_variant(text: str) -> Variant:
    """``0`` -> ALONE; ``spin:2`` -> ("spin", "2"); ``thread:100/1`` -> ("thread", "100/1")."""
    if text.strip() == "0":
        return ALONE
    if text.strip() == "offmain":
        return "offmain", ""
    kind, _, arg = text.partition(":")
    try:
        if kind == "thread":
            work, period = (float(v) for v in arg.split("/"))
            ok = work > 0 and period > 0
        else:
            ok = kind in KINDS and int(arg) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected 0, spin:N, pingpong:N (N >= 1), thread:W/P or offmain")
    return kind, arg


def variant_name(variant: Variant) -> str:
    kind, arg = variant
    return f"{kind}:{arg}" if arg else kind


def job_options(variant: Variant) -> dict[str, Any]:
    """What the harness's job carries for a variant that runs inside its process."""
    kind, arg = variant
    if kind == "offmain":
        return {"off_main": True}
    if kind != "thread":
        return {}
    work, period = (float(v) for v in arg.split("/"))
    return {"beside_thread": {"work_us": work, "period_ms": period}}


@contextlib.contextmanager
def neighbours(variant: Variant) -> Iterator[list[int]]:
    """Start the variant's neighbour processes, wait until each runs, stop them after;
    yields their pids (a pair's forked child is in its parent's process group)."""
    kind, arg = variant
    count = int(arg) if kind in KINDS else 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", KINDS[kind]],
                                          stdout=subprocess.PIPE, start_new_session=True))
        for proc in procs:
            _wait_ready(proc)
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:  # each in its own session: the group holds a pair's child too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def _wait_ready(proc: subprocess.Popen[bytes]) -> None:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(READY_TIMEOUT_S) or not proc.stdout.readline():
            raise RuntimeError(f"a neighbour process did not start ({proc.poll()})")


def run_engine(worker: EngineWorker, workdir: Path, workload: Workload,
               prompts: list[str], warmup: list[str], variant: Variant) -> dict[str, Any]:
    prompts_file, out = job_files(workdir, prompts, warmup)
    before, started = cpu_times(), time.monotonic()
    worker.run(workload, prompts_file, out, **job_options(variant))
    summary = job_result(out, worker.log_path)["summary"]
    summary["busy_vcpus"] = busy_vcpus(before, cpu_times(), time.monotonic() - started)
    return summary


def figures(summary: dict[str, Any]) -> dict[str, float | None]:
    detail = summary.get("stepping_detail") or {}
    probe = (summary.get("host") or {}).get("cpu_probe_ms") or {}
    return {"tok/s": summary["output_throughput"], "user ms/step": detail.get("user_ms"),
            "ms/step": summary.get("ms_per_step"), "busy vCPUs": summary.get("busy_vcpus"),
            "CPU probe p50": probe.get("p50"),
            "thread busy share": (summary.get("beside_thread") or {}).get("busy_share")}


def report(runs: list[dict[str, Any]], names: list[str]) -> str:
    """Per variant: its figures' medians, and tok/s and user ms/step over the harness
    alone in the same round (median [min-max])."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["variant"]] = figures(run["summary"])
    lines = ["variant | tok/s | over alone | user ms/step | over alone | ms/step | "
             "busy vCPUs | CPU probe p50 ms"]
    for name in names:
        rows = [r[name] for r in by_round.values() if name in r]
        lines.append(" | ".join([name, _median(rows, "tok/s"),
                                 _over(by_round, name, "tok/s"),
                                 _median(rows, "user ms/step"),
                                 _over(by_round, name, "user ms/step"),
                                 _median(rows, "ms/step"), _median(rows, "busy vCPUs"),
                                 _median(rows, "CPU probe p50")]))
    return "\n".join(lines)


def _median(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def _over(by_round: dict[int, dict[str, dict[str, Any]]], name: str, key: str) -> str:
    values = [r[name][key] / r["alone"][key] for r in by_round.values()
              if name in r and "alone" in r and r[name].get(key) and r["alone"].get(key)]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.neighbours", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument("--variant", action="append", type=parse_variant, default=None,
                   help="0, spin:N, pingpong:N, thread:W/P or offmain (repeatable; default: 0 "
                   "and spin:2)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds of quiet before every measured run")
    p.add_argument("--mlx-cache-limit-bytes", type=int, default=None)
    p.add_argument("--time-limit", type=float, default=120.0, help="per run, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blas", default="auto")
    p.add_argument("--allocator", default="auto")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/)")
    add_shape_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_signals()
    variants = list(dict.fromkeys(args.variant or [ALONE, ("spin", "2")]))
    if ALONE not in variants:
        variants.insert(0, ALONE)
    runs = _measure(args, variants)
    table = report(runs, [variant_name(v) for v in variants])
    print(table)
    out = Path(args.out) if args.out else RESULTS_DIR / f"neighbours-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = environment.describe(sys.argv[1:] if argv is None else argv, args.model,
                                "benchmarks.neighbours")
    out.write_text(json.dumps({"meta": meta, "runs": runs, "table": table}, indent=1))
    print(f"results: {out}")
    return 0


def _measure(args: argparse.Namespace, variants: list[Any]) -> list[dict[str, Any]]:
    """One engine harness process; every round runs each variant's neighbours beside it,
    in an order rotated every round."""
    names = [variant_name(v) for v in variants]
    batch = BatchConfig(args.decode_batch_size, args.prefill_batch_size,
                        args.prefill_step_size, args.mlx_cache_limit_bytes)
    native = resolve_native(args.blas, args.allocator)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="neighbours-") as tmp, \
            contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        model_path = resolve_model_path(args.model, workdir)
        tokenizer = load_tokenizer(model_path)
        worker = EngineWorker(harness_command(model_path, batch, False), native.env(),
                              workdir / "engine.log", 300.0)
        stack.callback(worker.stop)
        # One unmeasured run first: the first kernels and batch shapes (on CUDA, compiled
        # at first use) are paid there, not in round 0's first variant.
        warm = _workload(args, args.seed + 777_777)
        texts = build_prompts(tokenizer, warm.num_requests + 1, warm.prompt_tokens, warm.seed)
        summary = run_engine(worker, workdir, warm, texts[1:], texts[:1], ALONE)
        print(f"warm run (not counted): {summary['output_throughput']:.1f} tok/s", flush=True)
        for rnd in range(args.rounds):
            workload = _workload(args, args.seed + 1000 * rnd)
            texts = build_prompts(tokenizer, workload.num_requests + 1,
                                  workload.prompt_tokens, workload.seed)
            for name in rotated(tuple(names), rnd):
                variant = variants[names.index(name)]
                settled = quiet(args.settle, {"engine": worker.pid})
                print(describe_quiet(settled), flush=True)
                with neighbours(variant):
                    summary = run_engine(worker, workdir, workload, texts[1:], texts[:1],
                                         variant)
                runs.append({"round": rnd, "variant": name, "summary": summary,
                             "quiet_before": settled})
                print(f"round {rnd} {name}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in figures(summary).items() if v is not None),
                    flush=True)
    return runs


def _workload(args: argparse.Namespace, seed: int) -> Workload:
    return Workload(args.prompt_tokens, args.output_tokens,
                    args.concurrency * args.requests_per_stream, args.concurrency, seed,
                    time_limit=args.time_limit)

if __name__ == "__main__":
    sys.exit(main())
