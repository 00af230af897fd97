"""Loading a model folder into a Runner, on the MLX thread."""

from __future__ import annotations

import logging

import mlx.core as mx

from mlx_serve.failpoints import FailPoints
from mlx_serve.runner.batch import DEFAULT_CONTEXT_LENGTH, BatchLimits, Runner

log = logging.getLogger(__name__)


def load_runner(
    path: str, *, limits: BatchLimits, failpoints: FailPoints, max_context: int | None = None,
    prefix_cache_bytes: int = 0, cache_limit_bytes: int | None = None,
    one_array_logprobs: bool = True, early_decode_join: bool = True,
) -> Runner:
    """Load a model and build its runner. Call on the MLX thread."""
    from mlx_lm import load

    failpoints.check("startup.load")
    if cache_limit_bytes is not None:
        # MLX keeps freed buffers for reuse up to its memory limit by default: a server
        # that once ran a large batch would hold that memory from other processes.
        mx.set_cache_limit(cache_limit_bytes)
        log.info("MLX buffer cache limited to %d bytes", cache_limit_bytes)
    model, tokenizer, config = load(path, return_config=True)  # type: ignore[misc]
    trained = config.get("max_position_embeddings")
    if max_context and trained and max_context > trained:
        log.warning("--max-context %d is past the %d positions the model was made for: "
                    "replies that long may be nonsense", max_context, trained)
    context = max_context or trained or DEFAULT_CONTEXT_LENGTH
    vocab = config.get("vocab_size") or len(tokenizer.get_vocab())
    return Runner(model, tokenizer, context_length=int(context), vocab_size=int(vocab),
                  limits=limits, failpoints=failpoints, prefix_cache_bytes=prefix_cache_bytes,
                  one_array_logprobs=one_array_logprobs,
                  early_decode_join=early_decode_join, model_path=str(path))
