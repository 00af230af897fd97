"""Print the admission probe's spans (``benchmarks/admission_probe``) as percentiles.

    python -m benchmarks.admission_report /tmp/admission.*
    python -m benchmarks.admission_report --skip 128 /tmp/admission.*   # past a warm-up
    python -m benchmarks.admission_report --runs benchmarks/results/ab-....json /tmp/admission.*

Each line of a probe file is one request: the HTTP request enters the application ->
submitted to the engine (nan where no HTTP request submitted it), submitted -> taken by
the actor, taken -> its admitting step begins, that step begins -> first text, first
text -> handed out on the event loop, handed out -> its stream's first frame written
(nan where there was none), in milliseconds, then when it was submitted (epoch seconds).
With ``--runs`` (an ``ab`` or ``env_ab`` results file) the requests submitted inside
each measured run's span are reported as one row per run.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.metrics import percentiles
from benchmarks.phase_report import runs_of

SPANS = ("entered the application -> submitted", "submitted -> taken by the actor",
         "taken -> admitting step begins", "step begins -> first text", "first text -> handed out",
         "handed out -> first frame written")


def read_spans(paths: list[Path]) -> list[tuple[float, ...]]:
    return [tuple(float(x) for x in line.split())
            for path in paths for line in path.read_text().splitlines() if line.strip()]


def _stats(rows: list[tuple[float, ...]], i: int) -> dict[str, float | None]:
    # Takes seconds, gives milliseconds; a span a request did not have (nan) is left out.
    return percentiles([r[i] / 1e3 for r in rows if not math.isnan(r[i])])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_spans(rows: list[tuple[float, ...]]) -> str:
    lines = [f"{len(rows)} requests, ms", "| span | p50 | p90 | mean |", "|---|---|---|---|"]
    for i, name in enumerate(SPANS):
        p = _stats(rows, i)
        lines.append(f"| {name} | {_ms(p['p50'])} | {_ms(p['p90'])} | {_ms(p['mean'])} |")
    return "\n".join(lines)


def by_run(results: dict[str, Any], rows: list[tuple[float, ...]]
           ) -> list[tuple[str, list[tuple[float, ...]]]]:
    """Each run's name and the requests submitted inside its span (rows with a time)."""
    out = []
    for name, summary in runs_of(results):
        span = summary.get("span")
        out.append((name, [r for r in rows
                           if span and span[0] <= r[-1] <= span[1]]))
    return out


def format_runs(runs: list[tuple[str, list[tuple[float, ...]]]]) -> str:
    """One row per run that has requests: each span's p50 / p90, ms."""
    lines = ["| run | requests | " + " | ".join(f"{s}, p50 / p90 ms" for s in SPANS) + " |",
             "|---|---|" + "---|" * len(SPANS)]
    for name, rows in runs:
        if rows:
            cells = [f"{_ms(p['p50'])} / {_ms(p['p90'])}"
                     for p in (_stats(rows, i) for i in range(len(SPANS)))]
            lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--skip", type=int, default=0, help="leave out the first N requests")
    p.add_argument("--runs", type=Path, help="an ab or env_ab results file: one row per run")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    rows = read_spans(args.files)[args.skip:]
    if not rows:
        raise SystemExit("no requests in these files")
    if args.runs:
        print(format_runs(by_run(json.loads(args.runs.read_text()), rows)))
    else:
        print(format_spans(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
