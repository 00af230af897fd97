"""Print the phase probe's lines (``benchmarks/phase_probe``): per window, or per run.

    python -m benchmarks.phase_report /tmp/phases.*
    python -m benchmarks.phase_report --runs benchmarks/results/ab-....json /tmp/phases.*

Each window row is one window of batch steps; each cell a phase's thread CPU ms / wall
ms / minor faults per batch step (inclusive of the phases inside it), and its calls per
step where that is not one. The probe column is what the probe's wrapper costs a call in
that process: "own" is in each wrapped call's figures, "enclosing" in an enclosing
phase's figures for each wrapped call inside it (a phase of N calls a step reads about
N x own more than it costs unwrapped). With ``--runs`` (an ``ab`` or ``env_ab`` results file), the
windows that fall inside each measured run's span are pooled into one row per run,
whichever process wrote them (the contenders run one at a time); use short windows
(``MLX_PHASE_PROBE_EVERY=20``) so that few straddle a run's edges, which are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_windows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    cell = f"{p['cpu_ms']:.2f} / {p['wall_ms']:.2f} / {p['faults']:.0f}"
    # A phase not called exactly once a step says how often it was: a figure over that
    # is what one call costs (e.g. one step that prefilled).
    return cell if abs(p["calls"] - 1.0) < 0.005 else f"{cell} ({p['calls']:.2f} calls)"


def _probe_cell(probe_us: dict[str, float] | None) -> str:
    """The wrapper's own / enclosing wall us a call (lines from before it was measured
    have none)."""
    if not probe_us:
        return "-"
    return f"{probe_us['own_wall_us']:.1f} / {probe_us['enclosing_wall_us']:.1f}"


PROBE_HEADER = "probe us/call (own / enclosing)"


def format_windows(windows: list[dict[str, Any]]) -> str:
    labels = sorted({label for w in windows for label in w["phases"]})
    lines = [f"| steps | wall ms/step | {PROBE_HEADER} | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for w in windows:
        cells = [_cell(w["phases"].get(label)) for label in labels]
        lines.append(f"| {w['steps']} | {w['wall_ms_per_step']:.2f} | "
                     f"{_probe_cell(w.get('probe_us'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pooled(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows pooled into one: per-step figures weighted by each window's steps."""
    steps = sum(w["steps"] for w in windows)
    phases: dict[str, dict[str, float]] = {}
    for w in windows:
        for label, p in w["phases"].items():
            acc = phases.setdefault(label, {"calls": 0.0, "cpu_ms": 0.0, "wall_ms": 0.0,
                                            "faults": 0.0})
            for key in acc:
                acc[key] += p[key] * w["steps"] / steps
    probes = [w["probe_us"] for w in windows if w.get("probe_us")]
    probe_us = ({key: sum(p[key] for p in probes) / len(probes) for key in probes[0]}
                if probes else None)
    return {"steps": steps, "phases": phases, "probe_us": probe_us}


def _window_span(w: dict[str, Any]) -> tuple[float, float]:
    return w["time"] - w["steps"] * w["wall_ms_per_step"] / 1e3, w["time"]


def runs_of(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary) of each run in an ``ab`` or ``env_ab`` results file."""
    out = []
    for run in results["runs"]:
        summary = run["result"]["summary"] if "result" in run else run["summary"]
        who = run.get("target") or run.get("variant")
        out.append((f"round {run['round']} c={run['concurrency']} {who}", summary))
    return out


def by_run(results: dict[str, Any], windows: list[dict[str, Any]]
           ) -> list[tuple[str, dict[str, Any] | None]]:
    spans = [(w, _window_span(w)) for w in windows]
    rows = []
    for name, summary in runs_of(results):
        span = summary.get("span")
        inside = [w for w, (begun, ended) in spans
                  if span and span[0] <= begun and ended <= span[1]]
        rows.append((name, pooled(inside) if inside else None))
    return rows


def format_runs(rows: list[tuple[str, dict[str, Any] | None]]) -> str:
    labels = sorted({label for _, p in rows if p for label in p["phases"]})
    lines = [f"| run | steps | {PROBE_HEADER} | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for name, p in rows:
        if p is None:
            lines.append(f"| {name} | 0 | - |" + " - |" * len(labels))
            continue
        cells = [_cell(p["phases"].get(label)) for label in labels]
        lines.append(f"| {name} | {p['steps']} | {_probe_cell(p.get('probe_us'))} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phase_report",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="the probe's PATH.<pid> files")
    parser.add_argument("--runs", default=None, help="an ab or env_ab results JSON")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.files]
    print("CPU ms / wall ms / minor faults per batch step\n")
    if args.runs:
        windows = [w for path in paths for w in read_windows(path)]
        print(format_runs(by_run(json.loads(Path(args.runs).read_text()), windows)))
        return 0
    for path in paths:
        print(f"{path}\n\n{format_windows(read_windows(path))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
