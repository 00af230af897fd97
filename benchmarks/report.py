"""A/B figures: per-round ratios between contenders, as median [min–max] over rounds.

Ratios are taken within a round (adjacent runs on the same prompts), then summarized
across rounds: on a noisy machine, ratios measured side by side are the figures that
count, never a lone absolute time. For the headline figure, output tok/s, the report also
gives how far the median can be trusted (a bootstrap interval over the rounds) and the
rounds pooled (every round's tok/s summed), which weighs a round by its speed.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.host import describe
from benchmarks.threads import describe_threads, role_cpu

ENGINE, OURS, MLX_LM = "engine", "mlx_serve", "mlx_lm"
# A second engine-harness process, identical to the first: an A/A control that says how
# far two processes doing the same work read apart on this host.
ENGINE_B = "engine_b"
# Every contender an A/B may name, the control last: the tables name the first three
# always (a ``-`` where one did not run) and the control only where it ran.
CONTENDERS = (ENGINE, OURS, MLX_LM, ENGINE_B)
PAIRS = ((OURS, ENGINE), (MLX_LM, ENGINE), (OURS, MLX_LM))
CONTROL_PAIRS = ((ENGINE_B, ENGINE),)
# With the control in a round, the two engine processes' tok/s together (their geometric
# mean) are a reference steadier than either alone: mlx_serve is also read against that.
BOTH_ENGINES = "engines"

Getter = Callable[[dict[str, Any]], float | None]

METRICS: dict[str, Getter] = {
    "output tok/s": lambda s: s["output_throughput"],
    "TTFT p50": lambda s: s["ttft_ms"]["p50"],
    "ITL p50": lambda s: s["itl_ms"]["p50"],
    "ITL p90": lambda s: s["itl_ms"]["p90"],
    "ITL p95": lambda s: s["itl_ms"].get("p95"),
    "ITL p99": lambda s: s["itl_ms"].get("p99"),
    "TPOT p50": lambda s: s["tpot_ms"]["p50"],
    "CPU ms/token": lambda s: s.get("cpu_ms_per_token"),
    # mlx_serve's MLX thread against the engine harness's own: the same job, stepping.
    "CPU ms/token, stepping thread": role_cpu("stepping"),
    # mlx_serve's event loop (the engine harness has none: no ratio to it).
    "CPU ms/token, main thread": role_cpu("main"),
    "CPU ms/token, text thread": role_cpu("text"),
    "tokens/step": lambda s: s.get("tokens_per_step"),
    "ms/step": lambda s: s.get("ms_per_step"),
    "prefill step share": lambda s: s.get("prefill_step_share"),
    # mlx_serve's MLX thread, in jobs this share of the run (none for the other two).
    "MLX thread busy share": lambda s: s.get("mlx_busy_share"),
    # The machine, not the contender: above 1, the host ran this contender's load slower.
    "CPU probe p50": lambda s: (s.get("host") or {}).get("cpu_probe_ms", {}).get("p50"),
}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def rounds_by_concurrency(runs: list[dict[str, Any]], name: str = "target",
                          summary: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                          ) -> dict[int, list[dict[str, Any]]]:
    """{concurrency: [{contender: summary} for each round]} from a flat list of runs."""
    get = summary or (lambda run: run["result"]["summary"])
    by_key: dict[tuple[int, int], dict[str, Any]] = {}
    for run in runs:
        by_key.setdefault((run["concurrency"], run["round"]), {})[run[name]] = get(run)
    out: dict[int, list[dict[str, Any]]] = {}
    for (conc, _), contenders in sorted(by_key.items()):
        out.setdefault(conc, []).append(contenders)
    return out


def pair_spread(rounds: list[dict[str, Any]], a: str, b: str, get: Getter
                ) -> dict[str, float] | None:
    """Median [min-max] over rounds of a's figure over b's, each taken within a round."""
    return spread([r for s in rounds if a in s and b in s
                   if (r := _ratio(get(s[a]), get(s[b]))) is not None])


def median_interval(values: list[float], level: float = 0.90, resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float]:
    """The ``level`` percentile interval of the median, by resampling ``values`` (the
    rounds) with replacement; seeded, so a saved run reprints the same interval."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1.0 - level) / 2
    return medians[int(tail * resamples)], medians[min(int((1 - tail) * resamples),
                                                       resamples - 1)]


def tok_s_summary(rounds: list[dict[str, Any]], a: str, b: str) -> dict[str, float] | None:
    """a's output tok/s over b's: the median over rounds, its 90 % interval and the
    rounds pooled (a's tok/s summed over b's)."""
    pairs = [(s[a]["output_throughput"], s[b]["output_throughput"]) for s in rounds
             if a in s and b in s and s[b]["output_throughput"]]
    if not pairs:
        return None
    per_round = [x / y for x, y in pairs]
    low, high = median_interval(per_round)
    return {"n": len(pairs), "median": statistics.median(per_round), "low": low,
            "high": high, "pooled": sum(x for x, _ in pairs) / sum(y for _, y in pairs)}


def with_both_engines(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds where both engine processes ran, each with ``BOTH_ENGINES`` added: the
    geometric mean of their output tok/s, so that a round's ratio to it is the geometric
    mean of its ratios to each."""
    out = []
    for s in rounds:
        if ENGINE in s and ENGINE_B in s:
            tok_s = math.sqrt(s[ENGINE]["output_throughput"] * s[ENGINE_B]["output_throughput"])
            out.append({**s, BOTH_ENGINES: {"output_throughput": tok_s}})
    return out


def contenders_in(runs: list[dict[str, Any]]
                  ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The contenders the tables name and the pairs they compare (see ``CONTENDERS``)."""
    if any(run["target"] == ENGINE_B for run in runs):
        return CONTENDERS, PAIRS + CONTROL_PAIRS
    return CONTENDERS[:-1], PAIRS


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """{concurrency: {metric: {"a/b": spread}}} from the flat list of runs."""
    names, pairs = contenders_in(runs)
    out: dict[str, Any] = {}
    for conc, rounds in rounds_by_concurrency(runs).items():
        table: dict[str, Any] = {
            metric: {f"{a}/{b}": pair_spread(rounds, a, b, get) for a, b in pairs}
            for metric, get in METRICS.items()}
        table["failed"] = {name: sum(s[name]["failed"] for s in rounds if name in s)
                           for name in names}
        table["health_p99_ms"] = {name: _max_health(rounds, name) for name in (OURS, MLX_LM)}
        table["tok_s"] = {f"{a}/{b}": tok_s_summary(rounds, a, b) for a, b in pairs}
        if ENGINE_B in names:
            table["tok_s"][f"{OURS}/{BOTH_ENGINES}"] = tok_s_summary(
                with_both_engines(rounds), OURS, BOTH_ENGINES)
        # Each contender's own tok/s over the rounds: how far apart the engine's own
        # rounds ran says how steady the host was (the ratios are only as good as that).
        table["own_tok_s"] = {name: spread([s[name]["output_throughput"] for s in rounds
                                            if name in s]) for name in names}
        out[str(conc)] = table
    return out


def _max_health(rounds: list[dict[str, Any]], name: str) -> float | None:
    values = [s[name]["health"]["latency_ms"]["p99"] for s in rounds
              if name in s and s[name].get("health")]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def cell(sp: dict[str, float] | None) -> str:
    """``median [min-max]`` of a spread, or ``-``."""
    if sp is None:
        return "-"
    return f"{sp['median']:.2f} [{sp['min']:.2f}-{sp['max']:.2f}]"


def format_ratios(table: dict[str, Any]) -> str:
    """Plain-text table; also valid Markdown."""
    first = next(iter(table.values()), {})
    # The pairs this table holds (a saved table from before the control has three).
    pairs = list(first.get("output tok/s", {f"{a}/{b}": None for a, b in PAIRS}))
    names = list(first.get("failed", (ENGINE, OURS, MLX_LM)))
    header = "| conc | metric | " + " | ".join(pairs) + " |"
    lines = [header, "|" + "---|" * (2 + len(pairs))]
    for conc, rows in table.items():
        for metric in METRICS:
            cells = [cell(rows.get(metric, {}).get(p)) for p in pairs]  # older tables lack some
            if all(c == "-" for c in cells):
                continue  # a figure none of the pairs has, e.g. only mlx_serve's
            lines.append(f"| {conc} | {metric} | {' | '.join(cells)} |")
    lines.append("")
    lines.append(f"| conc | failed requests ({' / '.join(names)}) "
                 "| /health p99 ms, worst round (mlx_serve / mlx_lm) |")
    lines.append("|---|---|---|")
    for conc, rows in table.items():
        f, h = rows["failed"], rows["health_p99_ms"]
        health = " / ".join("-" if h[n] is None else f"{h[n]:.1f}" for n in (OURS, MLX_LM))
        lines.append(f"| {conc} | {' / '.join(str(f[n]) for n in names)} | {health} |")
    return "\n".join(lines + _tok_s_lines(table) + _own_tok_s_lines(table, names))


def tok_s_header(label: str) -> list[str]:
    return [f"| conc | {label} | rounds | output tok/s, median | 90 % interval of the median "
            "| rounds pooled |", "|---|---|---|---|---|---|"]


def tok_s_line(conc: Any, label: str, t: dict[str, float]) -> str:
    """One row of ``tok_s_summary``: rounds, median, its 90 % interval, the rounds pooled."""
    return (f"| {conc} | {label} | {t['n']} | {t['median']:.2f} "
            f"| {t['low']:.2f}-{t['high']:.2f} | {t['pooled']:.2f} |")


def _tok_s_lines(table: dict[str, Any]) -> list[str]:
    """Output tok/s by pair, per concurrency."""
    return ["", *tok_s_header("pair"),
            *(tok_s_line(conc, pair, t) for conc, rows in table.items()
              for pair, t in rows.get("tok_s", {}).items() if t is not None)]


def _own_tok_s_lines(table: dict[str, Any], names: list[str]) -> list[str]:
    """Each contender's own output tok/s over the rounds, and how far apart its rounds ran."""
    lines = ["", f"| conc | own output tok/s, median [min-max], max/min: {' | '.join(names)} |",
             "|---|" + "---|" * len(names)]
    for conc, rows in table.items():
        cells = [_own_cell(rows["own_tok_s"].get(name)) for name in names]
        lines.append(f"| {conc} | {' | '.join(cells)} |")
    return lines


def _own_cell(sp: dict[str, float] | None) -> str:
    if sp is None or not sp["min"]:
        return "-"
    return (f"{sp['median']:.1f} [{sp['min']:.1f}-{sp['max']:.1f}], "
            f"{sp['max'] / sp['min']:.2f}x")


def format_runs(runs: list[dict[str, Any]]) -> str:
    """One line per run: the raw figures behind the ratios."""
    lines = []
    for run in runs:
        s = run["result"]["summary"]
        lines.append(
            f"round {run['round']} c={run['concurrency']:<3} {run['target']:<9} "
            f"ok {s['completed']:>4} fail {s['failed']:>3}  tok/s {s['output_throughput']:>8.1f}"
            f"  TTFT p50 {_num(s['ttft_ms']['p50'])}  ITL p50 {_num(s['itl_ms']['p50'])}"
            f"  mean out {s['mean_output_tokens']}  {describe(s.get('host'))}"
            f"  {describe_threads(s)}".rstrip())
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:8.2f}"


def pooled_runs(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of several saved A/Bs as one, each round keeping its own pairs.

    A round is named (report, round), so that ratios are still taken within a round and
    the spread is over every round of every report (runs on different machines or at
    different times, which the median then weighs equally).
    """
    return [{**run, "round": (i, run["round"])}
            for i, report in enumerate(reports) for run in report["runs"]]


def _describe(report: dict[str, Any]) -> str:
    meta = report.get("meta", {})
    dirty = " plus uncommitted changes" if meta.get("git_dirty") else ""
    return (f"{meta.get('date')}  {meta.get('command')}\n"
            f"machine: {meta.get('machine')}\n"
            f"code: commit {meta.get('git_commit')}{dirty}, sources {meta.get('source_digest')}")


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.report RESULTS.json [MORE.json ...] [--runs]``: reprint a
    saved A/B; given several, their rounds pooled into one table."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    p.add_argument("results", nargs="+")
    p.add_argument("--runs", action="store_true", help="also list every run")
    args = p.parse_args(argv)
    reports = []
    for path in args.results:
        with open(path) as fh:
            reports.append(json.load(fh))
    for report in reports:
        print(_describe(report))
    runs = reports[0]["runs"] if len(reports) == 1 else pooled_runs(reports)
    if args.runs:
        print(format_runs(runs))
    if len(reports) > 1:
        print(f"every round of the {len(reports)} runs above, pooled:")
    print(format_ratios(ratios(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
