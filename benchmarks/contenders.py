"""What every A/B run shares: the model, the native libraries, the contenders' order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.servers import NativeLibs
from mlx_serve.preload import find_jemalloc, find_openblas

# The GPU benchmarks' 1B llama has 16 layers. At one stream its step is bound by the CPU
# that builds and launches its graph, whose cost goes with the number of layers, not
# their width: ``deep`` has those 16 layers at the tiny model's width, so that this
# machine's CPU builds the same graph while the arithmetic stays small.
DEEP_LAYERS = 16
MODEL_HELP = "tiny | deep (tiny, 16 layers) | default (SmolLM2 4-bit) | default-f32 | a folder"


def resolve_model_path(spec: str, workdir: Path) -> str:
    """``tiny``: the tiny random model; ``deep``: the same with the 1B llama's 16 layers;
    ``default`` / ``default-f32``: SmolLM2 in 4-bit or dequantized to float32
    (mlx_serve's form with OpenBLAS); else a model folder."""
    if spec in ("tiny", "deep"):
        from mlx_serve.tiny_model import build_tiny_model

        shape = {"num_layers": DEEP_LAYERS} if spec == "deep" else {}
        return str(build_tiny_model(workdir / f"{spec}-model", **shape))
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
