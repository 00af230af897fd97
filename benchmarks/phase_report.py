"""Print the phase probe's lines (``benchmarks/phase_probe``) as one table per file.

    python -m benchmarks.phase_report /tmp/phases.*

Each row is one window of batch steps; each cell a phase's thread CPU ms / wall ms /
minor faults per batch step (inclusive of the phases inside it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def read_windows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_windows(windows: list[dict[str, Any]]) -> str:
    labels = sorted({label for w in windows for label in w["phases"]})
    lines = ["| steps | wall ms/step | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for w in windows:
        cells = []
        for label in labels:
            p = w["phases"].get(label)
            cells.append("-" if p is None else
                         f"{p['cpu_ms']:.2f} / {p['wall_ms']:.2f} / {p['faults']:.0f}")
        lines.append(f"| {w['steps']} | {w['wall_ms_per_step']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        raise SystemExit("usage: python -m benchmarks.phase_report FILE...")
    for path in paths:
        print(f"{path}: CPU ms / wall ms / minor faults per batch step\n")
        print(format_windows(read_windows(path)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
