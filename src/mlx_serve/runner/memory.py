"""MLX's allocator figures: read on the MLX thread now and then, kept for any thread."""

from __future__ import annotations

import time

import mlx.core as mx

# Read at most this often while the batch steps (and whenever it empties).
MEMORY_SAMPLE_INTERVAL_S = 0.25


class MLXMemory:
    """The last figures read, in bytes. Reading them never calls into MLX: its
    allocator takes a lock that a running step may hold (a CUDA allocation can wait for
    the device), and the binding keeps the interpreter lock while it waits, which would
    stall the event loop and /health."""

    def __init__(self) -> None:
        self.figures: dict[str, int] = {}
        self._sampled = 0.0
        self.sample()

    def due(self) -> bool:
        return time.monotonic() - self._sampled >= MEMORY_SAMPLE_INTERVAL_S

    def sample(self) -> None:
        """Read MLX's allocator counters. Call on the MLX thread."""
        self.figures = {"active_bytes": mx.get_active_memory(),
                        "cache_bytes": mx.get_cache_memory(),
                        "peak_bytes": mx.get_peak_memory()}
        self._sampled = time.monotonic()
