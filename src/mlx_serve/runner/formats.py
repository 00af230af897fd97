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
        from mlx_serve.runner.structured import StructuredOutputError
    except ImportError:
        raise UnsupportedParameterError("structured output is not available",
                                        param=param) from None
    try:
        return _compiled(tokenizer, response_format, vocab_size)
    except StructuredOutputError as exc:
        raise RequestError(f"invalid {param}: {exc}", param=param) from None


def _compiled(tokenizer: Any, spec: dict, vocab_size: int) -> object:
    """A format by its type: OpenAI's and vLLM's (structured), tool calls' grammars
    (call_grammar) and formats that leave a reasoning span free (after_reasoning)."""
    from mlx_serve.runner import after_reasoning, call_grammar, structured

    kind = spec.get("type")
    if kind == "after_reasoning":
        return after_reasoning.AfterReasoningFormat(
            _compiled(tokenizer, spec["format"], vocab_size), int(spec["think_end"]))
    if kind == "may_reason_first":
        return after_reasoning.MayReasonFirstFormat(
            _compiled(tokenizer, spec["format"], vocab_size), int(spec["think_start"]),
            int(spec["think_end"]))
    if kind == "tool_calls":
        return call_grammar.compile_lazy_calls(tokenizer, spec, vocab_size)
    if kind == "answer_or_calls":
        return call_grammar.compile_answer_or_calls(tokenizer, spec, vocab_size)
    return structured.compile_response_format(tokenizer, spec, vocab_size)
