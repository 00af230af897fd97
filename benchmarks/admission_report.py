"""Print the admission probe's spans (``benchmarks/admission_probe``) as percentiles.

    python -m benchmarks.admission_report /tmp/admission.*
    python -m benchmarks.admission_report --skip 128 /tmp/admission.*   # past a warm-up

Each line of a probe file is one request: submitted -> taken by the actor, taken -> its
admitting step begins, that step begins -> first text, in milliseconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.metrics import percentiles

SPANS = ("submitted -> taken by the actor", "taken -> admitting step begins",
         "step begins -> first text")


def read_spans(paths: list[Path]) -> list[tuple[float, ...]]:
    return [tuple(float(x) for x in line.split())
            for path in paths for line in path.read_text().splitlines() if line.strip()]


def format_spans(rows: list[tuple[float, ...]]) -> str:
    lines = [f"{len(rows)} requests, ms", "| span | p50 | p90 | mean |", "|---|---|---|---|"]
    for i, name in enumerate(SPANS):
        p = percentiles([r[i] / 1e3 for r in rows])  # takes seconds, gives milliseconds
        lines.append(f"| {name} | {p['p50']:.1f} | {p['p90']:.1f} | {p['mean']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--skip", type=int, default=0, help="leave out the first N requests")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    rows = read_spans(args.files)[args.skip:]
    if not rows:
        raise SystemExit("no requests in these files")
    print(format_spans(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
