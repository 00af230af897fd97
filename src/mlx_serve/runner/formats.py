"""A request's ``response_format`` compiled for the served tokenizer, or a 400."""

from __future__ import annotations

from typing import Any

from mlx_serve.errors import RequestError, UnsupportedParameterError


def compile_format(tokenizer: Any, response_format: dict, vocab_size: int) -> object:
    """Compile an OpenAI ``response_format`` or a vLLM constraint (any thread); a 400
    names the request field it came from (``param`` in the dict, else response_format).
    Structured output needs an optional grammar library: without it, a format is an
    unsupported parameter."""
    param = str(response_format.get("param", "response_format"))
    try:
        from mlx_serve.runner.structured import StructuredOutputError, compile_response_format
    except ImportError:
        raise UnsupportedParameterError("structured output is not available",
                                        param=param) from None
    try:
        if response_format.get("type") == "tool_calls":  # strict functions' calls
            from mlx_serve.runner.call_grammar import compile_lazy_calls
            return compile_lazy_calls(tokenizer, response_format, vocab_size)
        return compile_response_format(tokenizer, response_format, vocab_size)
    except StructuredOutputError as exc:
        raise RequestError(f"invalid {param}: {exc}", param=param) from None
