"""The one constraint on a request's reply, compiled: a forced tool call's schema,
``response_format``, vLLM's structured-output fields, or strict functions' calls."""

from __future__ import annotations

from typing import Any

import anyio

from mlx_serve.errors import RequestError
from mlx_serve.guided import guided_format
from mlx_serve.prompts import Rendered
from mlx_serve.protocol import ChatCompletionRequest, CompletionRequest
from mlx_serve.strict_calls import calls_format, json_calls


async def compile_format(body: ChatCompletionRequest | CompletionRequest, runner: Any,
                         forced_call: dict | None = None, calls: dict | None = None,
                         reasoning: dict | None = None) -> tuple[object | None, str]:
    """The one constraint on a request's reply, compiled: a forced tool call's schema,
    ``response_format`` or vLLM's structured-output fields. Two at once are a 400, and
    so is one with ``ignore_eos`` or ``min_tokens`` (a format ends its reply with an
    end-of-sequence token, when its grammar does). ``calls`` (``strict_calls.json_calls``)
    keeps tool calls possible beside a JSON ``response_format`` and holds strict
    functions' calls to their schemas. ``reasoning`` (``reasoning_markers``): the
    reply's reasoning span, which a format leaves free. With the compiled format comes the
    request field it came from, for a fault mid-reply to name."""
    asked: list[tuple[str, dict]] = []
    if forced_call is not None:
        asked.append(("tool_choice", {"type": "json_schema", "json_schema": {  # the tools'
            "name": "tool_call", "schema": forced_call}, "param": "tools"}))  # schemas
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        asked.append(("response_format", fmt.model_dump(exclude_none=True)))
    if (guided := guided_format(body)) is not None:
        asked.append((guided["param"], guided))
    if not asked:  # strict calls only: free text is not constrained, so any EOS rule works
        return await _compiled(runner, calls_format(calls, None))
    if len(asked) > 1:
        raise RequestError(f"'{asked[0][0]}' and '{asked[1][0]}' cannot be combined",
                           param=asked[1][0])
    if body.ignore_eos or body.min_tokens:
        param = "ignore_eos" if body.ignore_eos else "min_tokens"
        raise RequestError(f"'{param}' cannot be combined with a response format or a "
                           "forced tool call", param=param)
    name, spec = asked[0]
    if name == "response_format":
        spec = calls_format(calls, spec) or spec
    if reasoning is not None:  # the reasoning stays free, as with vLLM's reasoning parsers
        spec = {**reasoning, "format": spec, "param": spec.get("param", name)}
    return await _compiled(runner, spec)


async def _compiled(runner: Any, spec: dict | None) -> tuple[object | None, str]:
    if spec is None:
        return None, "response_format"
    return (await anyio.to_thread.run_sync(runner.compile_response_format, spec),
            str(spec.get("param", "response_format")))


def reasoning_markers(tokenizer: Any, rendered: Rendered) -> dict | None:
    """Where the reply's reasoning span is, for a format to wait for its end: its end
    marker when the template opened it; its start and end markers when the model may
    open it itself; None when the model has none, or a marker is several tokens."""
    if not getattr(tokenizer, "has_thinking", False) or rendered.initial_state not in (
            "reasoning", "normal"):
        return None
    try:
        start, end = tokenizer.think_start_id, tokenizer.think_end_id
    except (AttributeError, ValueError):  # one of several tokens
        return None
    if end is None:
        return None
    if rendered.initial_state == "reasoning":
        return {"type": "after_reasoning", "think_end": end}
    if start is None or rendered.thinking_off:  # thinking off: the format from the start
        return None
    return {"type": "may_reason_first", "think_start": start, "think_end": end}


def held_calls(body: ChatCompletionRequest, rendered: Rendered, tokenizer: Any
                ) -> dict | None:
    """The calls a grammar may hold (``strict_calls.json_calls``): with tools offered and
    no call forced, beside no vLLM structured-output field (which holds the whole reply,
    calls included)."""
    if rendered.tools is None or rendered.forced_call is not None or guided_format(body):
        return None
    fmt = body.response_format
    json_answer = fmt is not None and fmt.type in ("json_object", "json_schema")
    return json_calls([t.function for t in body.tools or ()], tokenizer, json_answer)
