"""vLLM's serving metrics (benchmarks/benchmark_serving.py), computed the same way.

Per request (times in seconds from the moment the request was sent):

- TTFT: arrival of the first chunk carrying non-empty generated text.
- ITL: every gap between two successive chunks carrying non-empty text (pooled over all
  requests before taking percentiles).
- E2E latency: arrival of the end of the reply (``[DONE]`` or the whole JSON body).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, for requests with more than one token.

Per run: completed and failed requests, request throughput (completed / duration),
output tokens/s (completion tokens from ``usage`` / duration), duration being the first
send to the last completion. Percentiles use numpy's default (linear interpolation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds since it was sent."""

    ok: bool = False
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p95/p99 and mean in milliseconds; None when there is nothing to measure."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * 1000.0
    out: dict[str, float | None] = {"mean": round(float(arr.mean()), 3)}
    for p in PERCENTILES:
        out[f"p{p}"] = round(float(np.percentile(arr, p)), 3)
    return out


def cpu_per_token(summary: dict[str, Any], cpu_seconds: float | None) -> None:
    """Record a contender's CPU time over the run, in ms per output token (None when
    it could not be read: a server that has gone).

    Far steadier than throughput on a shared machine: it counts the work done, not how
    the scheduler spread it, so it shows one server's overhead next to another's.
    """
    summary["cpu_s"] = None if cpu_seconds is None else round(cpu_seconds, 4)
    tokens = summary.get("output_tokens") or 0
    summary["cpu_ms_per_token"] = (round(1000 * cpu_seconds / tokens, 4)
                                   if tokens and cpu_seconds is not None else None)


def run_span(summary: dict[str, Any], wall_start: float, duration: float) -> None:
    """Record when the measured run ran (epoch seconds, first send to last completion),
    so that what other tools logged meanwhile (``benchmarks.phase_report --runs``) can
    be matched to it."""
    summary["span"] = [round(wall_start, 3), round(wall_start + duration, 3)]


def step_figures(summary: dict[str, Any], steps: int | None,
                 prefill_steps: int | None = None) -> None:
    """Record how many batch steps a run took: tokens per step and ms per step.

    They tell the two ways a run can be slow apart: fewer tokens per step (the batch
    ran emptier: admission and scheduling) or longer steps (the same work, done
    slower: contention for the cores or the interpreter lock). ``prefill_steps``, the
    steps that also prefilled newcomers, tells how much of the step time went on them
    (each prefill is a model call of its own beside the decode).
    """
    summary["steps"] = steps
    summary["prefill_steps"] = prefill_steps
    summary["prefill_step_share"] = (round(prefill_steps / steps, 4)
                                     if steps and prefill_steps is not None else None)
    tokens = summary.get("output_tokens") or 0
    if steps and tokens:
        summary["tokens_per_step"] = round(tokens / steps, 3)
        summary["ms_per_step"] = round(1000 * summary["duration_s"] / steps, 4)
    else:
        summary["tokens_per_step"] = summary["ms_per_step"] = None


def busy_share(summary: dict[str, Any], busy_seconds: float | None) -> None:
    """Record the share of the run's wall time that mlx_serve's MLX thread spent in jobs.

    Near 1 the thread steps back to back and the engine sets the pace; well below it the
    thread waits for the event loop to hand it its next step.
    """
    duration = summary.get("duration_s") or 0
    summary["mlx_busy_share"] = (round(busy_seconds / duration, 4)
                                 if busy_seconds is not None and duration else None)


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """The run's summary, vLLM's definitions; latencies in ms."""
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    duration = max(duration, 1e-9)
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": round(duration, 4),
        "request_throughput": round(len(done) / duration, 4),
        "output_tokens": output,
        "output_throughput": round(output / duration, 3),
        "mean_output_tokens": round(output / len(done), 2) if done else 0,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        **{f"{name}_ms": percentiles(samples[name]) for name in LATENCY_METRICS},
        "errors": errors,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """A short human-readable table of one summary."""
    lines = [title] if title else []
    lines.append(
        f"completed {summary['completed']}  failed {summary['failed']}  "
        f"duration {summary['duration_s']:.2f} s  "
        f"req/s {summary['request_throughput']:.2f}  "
        f"output tok/s {summary['output_throughput']:.1f}  "
        f"(mean {summary['mean_output_tokens']} tok/req)"
    )
    if "client_cpu" in summary:
        lines.append(f"load generator CPU {summary['client_cpu']:.2f} cores")
    lines.append(f"{'ms':<6}" + "".join(f"{f'p{p}':>10}" for p in PERCENTILES))
    for name in LATENCY_METRICS:
        row = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<6}" + "".join(f"{_fmt(row[f'p{p}']):>10}"
                                                   for p in PERCENTILES))
    if summary.get("health"):
        h = summary["health"]
        lat = h["latency_ms"]
        priority = f", {h['probe_priority']} prober" if "probe_priority" in h else ""
        line = (f"/health probes {h['probes']} (failed {h['failed']}{priority}): "
                f"p50 {_fmt(lat['p50'])} ms  p99 {_fmt(lat['p99'])} ms")
        in_order = h.get("in_order_ms") or []
        if in_order:  # where the slowest was: in a short run, the start burst's probe
            slowest = max(range(len(in_order)), key=in_order.__getitem__)
            line += f"  max {in_order[slowest]:.1f} ms (probe {slowest + 1})"
        lines.append(line)
    for error, count in summary["errors"].items():
        lines.append(f"  error x{count}: {error}")
    return "\n".join(lines)


def report_run(result: dict, title: str, json_path: str | None) -> int:
    """Print a run's table, save its JSON if asked; exit status 1 if any request failed."""
    print(format_table(result["summary"], title))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0 if result["summary"]["failed"] == 0 else 1
