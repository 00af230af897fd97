"""Where and when a figure was measured: machine, versions, commit, command."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _mlx_device() -> str | None:
    try:
        out = subprocess.run([sys.executable, "-c",
                              "import mlx.core as mx; print(mx.default_device())"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe(argv: list[str], model_path: str) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.ab " + " ".join(argv),
        "model_path": model_path,
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "mlx_device": _mlx_device()},
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "mlx-serve", "uvicorn",
                                              "starlette", "httpx")},
        "git_commit": _git_commit(),
    }
