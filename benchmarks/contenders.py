"""What every A/B run shares: the model, the native libraries, the contenders' order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.servers import NativeLibs
from mlx_serve.preload import find_jemalloc, find_openblas


def resolve_model_path(spec: str, workdir: Path) -> str:
    """``tiny``: the tiny random model; ``default`` / ``default-f32``: SmolLM2 in 4-bit or
    dequantized to float32 (mlx_serve's form with OpenBLAS); else a model folder."""
    if spec == "tiny":
        from mlx_serve.tiny_model import build_tiny_model

        return str(build_tiny_model(workdir / "tiny-model"))
    if spec in ("default", "default-f32"):
        from mlx_serve.models import resolve_model

        return resolve_model(None, dequantize=spec == "default-f32")[0]
    return spec


def resolve_native(blas: str, allocator: str) -> NativeLibs:
    """The preloaded libraries every contender gets (``--blas``, ``--allocator``): the
    installed one for "auto", none when turned off, an exit when asked for but missing."""

    def pick(choice: str, off: str, find: Callable[[], str | None], package: str
             ) -> str | None:
        library = None if choice == off else find()
        if library is None and choice not in ("auto", off):
            raise SystemExit(f"{choice} not found (apt-get install {package})")
        return library

    return NativeLibs(pick(blas, "reference", find_openblas, "libopenblas0-pthread"),
                      pick(allocator, "system", find_jemalloc, "libjemalloc2"))


def rotated(targets: tuple[str, ...], rnd: int) -> tuple[str, ...]:
    """The contenders' order in round ``rnd``: each takes every position in turn.

    Position matters on the GPU machine: the server measured right after the engine
    harness (a process that has just used, then released, the GPU) was the slower one
    in every pair of one run, by up to 2x; a fixed order would bias every ratio.
    """
    k = rnd % len(targets)
    return targets[k:] + targets[:k]


def warm_run_line(name: str, summary: dict[str, Any]) -> str:
    """What a warm run (unmeasured, before round 0) did, for the log."""
    return (f"warm run {name} (not counted): {summary['completed']} ok, "
            f"{summary['failed']} failed, {summary['output_throughput']:.1f} tok/s")
