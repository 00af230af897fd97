"""The only place that touches MLX at serving time: model, tokenizer and batch steps."""

from mlx_serve.file_limit import import_mlx_lm

import_mlx_lm()  # first, before any module below imports it: see file_limit.py

from mlx_serve.runner.batch import BatchLimits, Runner  # noqa: E402
from mlx_serve.runner.loading import load_runner  # noqa: E402

__all__ = ["BatchLimits", "Runner", "load_runner"]
