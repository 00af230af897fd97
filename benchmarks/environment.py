"""Where and when a figure was measured: machine, versions, commit, command."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlx_serve.http_stack import interpreter_lock_on


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


ROOT = Path(__file__).resolve().parent.parent


def _git_dirty() -> bool | None:
    """Whether src/ or benchmarks/ differ from the commit (a copied tree may carry a
    stale .git: the commit alone would then name code that did not run)."""
    try:
        out = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "benchmarks"],
                             capture_output=True, timeout=10, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(out.returncode)


def source_digest() -> str:
    """A digest of the server's and the benchmarks' Python sources as they are on disk."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("src/mlx_serve/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _mlx_device() -> str | None:
    try:
        out = subprocess.run([sys.executable, "-c",
                              "import mlx.core as mx; print(mx.default_device())"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def describe(argv: list[str], model_path: str, module: str = "benchmarks.ab"
             ) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": f"python -m {module} " + " ".join(argv),
        "model_path": model_path,
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "interpreter_lock": interpreter_lock_on(),
                    "mlx_device": _mlx_device()},
        # httptools and uvloop: what uvicorn serves with (h11 and asyncio without them).
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "mlx-serve", "uvicorn",
                                              "httptools", "uvloop", "starlette", "httpx")},
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "source_digest": source_digest(),
    }


def http_parser_warning(meta: dict[str, Any]) -> str | None:
    """A warning when mlx_serve will parse HTTP with h11 here (see ``describe``)."""
    if meta["versions"].get("httptools") is not None:
        return None
    return ("warning: httptools is not installed here, so mlx_serve's uvicorn parses HTTP "
            "with h11 (pure Python), unlike an install of mlx-serve from PyPI")
