"""The only place that touches MLX at serving time: model, tokenizer and batch steps."""

from mlx_serve.runner.batch import BatchLimits, Runner
from mlx_serve.runner.loading import load_runner

__all__ = ["BatchLimits", "Runner", "load_runner"]
