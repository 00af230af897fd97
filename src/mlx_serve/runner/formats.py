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
        kind = response_format.get("type")
        if kind in ("after_reasoning", "may_reason_first"):  # reasoning stays free
            from mlx_serve.runner import after_reasoning
            inner = compile_format(tokenizer, response_format["format"], vocab_size)
            end = int(response_format["think_end"])
            if kind == "after_reasoning":
                return after_reasoning.compile_after_reasoning(inner, end)
            return after_reasoning.compile_may_reason_first(
                inner, int(response_format["think_start"]), end)
        if kind in ("tool_calls", "answer_or_calls"):  # grammars for tool calls
            from mlx_serve.runner import call_grammar
            compile_calls = (call_grammar.compile_lazy_calls if kind == "tool_calls"
                             else call_grammar.compile_answer_or_calls)
            return compile_calls(tokenizer, response_format, vocab_size)
        return compile_response_format(tokenizer, response_format, vocab_size)
    except StructuredOutputError as exc:
        raise RequestError(f"invalid {param}: {exc}", param=param) from None
