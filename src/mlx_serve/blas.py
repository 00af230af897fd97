"""OpenBLAS for MLX's Linux CPU backend.

The ``mlx[cpu]`` wheel bundles the reference BLAS (about 4 GFLOP/s for an f32 1024²
matmul on our 2-core machines). Preloading Debian's OpenBLAS (``libopenblas0-pthread``)
puts a real sgemm under MLX's float32 matmuls: about 30x faster there. Quantized
matmuls never reach BLAS, so the default model is served dequantized to float32 when
OpenBLAS is active. The library must be in place before the process starts, so the
CLI re-executes itself once with ``LD_PRELOAD`` set.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_REEXEC_MARK = "MLX_SERVE_OPENBLAS_REEXEC"


def find_openblas() -> str | None:
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def openblas_active() -> bool:
    """Whether OpenBLAS is mapped into this process (Linux only)."""
    try:
        return "openblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_with_openblas(argv: Sequence[str], wanted: bool | None) -> None:
    """On Linux, restart this command once with OpenBLAS preloaded, if available.

    ``wanted`` None means automatic: on Linux when the library exists. Returns normally
    when nothing needs to change (macOS, already active, not installed, or turned off).
    """
    if wanted is False or not sys.platform.startswith("linux") or openblas_active():
        return
    if os.environ.get(_REEXEC_MARK):
        return  # we already tried once; never loop
    library = find_openblas()
    if library is None:
        if wanted:
            log.warning("OpenBLAS requested but not found (apt-get install libopenblas0-pthread)")
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "mlx_serve", *argv], env)
