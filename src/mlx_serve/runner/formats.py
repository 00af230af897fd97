"""A request's ``response_format`` compiled for the served tokenizer, or a 400."""

from __future__ import annotations

from typing import Any

from mlx_serve.errors import RequestError, UnsupportedParameterError


def compile_format(tokenizer: Any, response_format: dict, vocab_size: int) -> object:
    """Compile an OpenAI ``response_format`` (any thread). Structured output needs an
    optional grammar library: without it, a format is an unsupported parameter."""
    try:
        from mlx_serve.runner.structured import StructuredOutputError, compile_response_format
    except ImportError:
        raise UnsupportedParameterError("structured output is not available",
                                        param="response_format") from None
    try:
        return compile_response_format(tokenizer, response_format, vocab_size)
    except StructuredOutputError as exc:
        raise RequestError(f"invalid response_format: {exc}",
                           param="response_format") from None
