"""Native libraries preloaded into the server on Linux: OpenBLAS and jemalloc.

The ``mlx[cpu]`` wheel bundles the reference BLAS (about 4 GFLOP/s for an f32 1024²
matmul on our 2-core machines). Preloading Debian's OpenBLAS (``libopenblas0-pthread``)
puts a real sgemm under MLX's float32 matmuls: about 30x faster there. Quantized
matmuls never reach BLAS, so the default model is served dequantized to float32 when
OpenBLAS is active.

Building each step's graph, MLX allocates and frees many small C++ objects; with the C
library's malloc that was a fifth of the stepping thread's time on the CPU. Debian's
jemalloc (``libjemalloc2``) made the tiny model's serving 1.14-1.31x faster at 1 and 4
streams for 3 % less to 6 % more resident memory, and a 1B model's on an H200 (CUDA)
1.37x faster at one stream; tcmalloc was as fast but held 40 %
more, mimalloc less consistent (benchmarks/MEASUREMENTS.md).

A library must be in place before the process starts, so the CLI re-executes itself
once with ``LD_PRELOAD`` set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
JEMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
)
_REEXEC_MARK = "MLX_SERVE_PRELOAD_REEXEC"


def _first_existing(paths: Sequence[str]) -> str | None:
    return next((p for p in paths if Path(p).exists()), None)


def find_openblas() -> str | None:
    """Debian's OpenBLAS, if installed (Linux only)."""
    return _first_existing(OPENBLAS) if sys.platform.startswith("linux") else None


def find_jemalloc() -> str | None:
    """Debian's jemalloc, if installed (Linux only)."""
    return _first_existing(JEMALLOC) if sys.platform.startswith("linux") else None


def _mapped(name: str) -> bool:
    """Whether a library whose path contains ``name`` is mapped here (Linux only)."""
    try:
        return name in Path("/proc/self/maps").read_text()
    except OSError:
        return False


class _SymbolInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _global_provider(symbol: str) -> str | None:
    """The file of the library that the process-wide lookup of ``symbol`` finds (the
    executable's, a preloaded library's), symlinks resolved; None where none has it."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
        info = _SymbolInfo()
        if not address or not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
            return None
    except (AttributeError, OSError):  # not there, or no dladdr (not glibc)
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname)) if info.dli_fname else None


def openblas_active() -> bool:
    """Whether MLX's float32 matmuls get OpenBLAS: mlx's CPU wheel calls ``cblas_sgemm``
    of its own bundled reference BLAS unless a library in the process-wide scope (the
    preloaded one) provides it. Not whether some OpenBLAS is mapped: numpy maps its own,
    under other symbol names, which MLX never calls."""
    provider = _global_provider("cblas_sgemm")
    return provider is not None and "openblas" in provider


def jemalloc_active() -> bool:
    return _mapped("libjemalloc")


def wanted_preloads(openblas: bool | None, jemalloc: bool | None) -> list[str]:
    """The libraries to add to this process: asked for (True) or automatic (None: when
    installed), and not mapped yet. A library asked for but missing is logged."""
    chosen = []
    for wanted, active, paths, package in (
        (openblas, openblas_active, OPENBLAS, "libopenblas0-pthread"),
        (jemalloc, jemalloc_active, JEMALLOC, "libjemalloc2"),
    ):
        if wanted is False or active():
            continue
        library = _first_existing(paths)
        if library is not None:
            chosen.append(library)
        elif wanted:
            log.warning("%s requested but not found (apt-get install %s)", package, package)
    return chosen


def reexec_with_preloads(argv: Sequence[str], openblas: bool | None,
                         jemalloc: bool | None, module: str = "mlx_serve") -> None:
    """On Linux, restart ``python -m module argv`` once with the wanted libraries preloaded.

    Returns normally when nothing needs to change (not Linux, already mapped, not
    installed, turned off, or this is the restarted process).
    """
    if not sys.platform.startswith("linux") or os.environ.get(_REEXEC_MARK):
        return  # the restarted process never restarts again
    libraries = wanted_preloads(openblas, jemalloc)
    if not libraries:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*libraries, *filter(None, [env.get("LD_PRELOAD")])])
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
