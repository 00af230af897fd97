"""Chat messages -> prompt tokens through the model's chat template (tools included)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlx_serve.errors import RequestError, UnsupportedParameterError
from mlx_serve.protocol import CHAT_TEMPLATE_KWARGS, ChatCompletionRequest, ChatMessage


@dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    tools: list[dict] | None  # the tools offered to the model (for parsing its calls)
    split_reasoning: bool  # the model has thinking or tool-call markers to route apart
    initial_state: str  # "reasoning" when the template left a thinking span open


def _arguments(text: str) -> Any:
    # Templates render tool-call arguments with ``| tojson``: give them the object.
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name,
                          "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning or message.reasoning_content
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def offered_tools(body: ChatCompletionRequest, tokenizer: Any) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    if body.tool_choice == "required" or (body.tool_choice is not None
                                          and not isinstance(body.tool_choice, str)):
        raise UnsupportedParameterError(
            "'tool_choice' may be 'auto' or 'none' here; forcing a call is not supported yet",
            param="tool_choice")
    if not getattr(tokenizer, "has_tool_calling", False):
        raise UnsupportedParameterError(
            "this model's chat template does not support tool calling", param="tools")
    return [t.model_dump(exclude_none=True) for t in body.tools]


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    unknown = set(kwargs) - CHAT_TEMPLATE_KWARGS
    if unknown:
        raise RequestError(
            f"'chat_template_kwargs' may only hold {sorted(CHAT_TEMPLATE_KWARGS)}; "
            f"got {sorted(unknown)}", param="chat_template_kwargs")
    return kwargs


def render_chat(tokenizer: Any, body: ChatCompletionRequest) -> Rendered:
    if not getattr(tokenizer, "has_chat_template", True):
        raise RequestError("this model has no chat template; use /v1/completions")
    tools = offered_tools(body, tokenizer)
    kwargs = template_kwargs(body)
    messages = [message_dict(m) for m in body.messages]
    try:
        tokens = list(tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, **kwargs))
    except Exception as exc:  # template errors, e.g. a role the template refuses
        raise RequestError(f"the chat template rejected the messages: {exc}",
                           param="messages") from None
    thinking = bool(getattr(tokenizer, "has_thinking", False))
    initial = "normal"
    if thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
        initial = "reasoning"
    initial = getattr(tokenizer, "response_initial_state", None) or initial
    return Rendered(tokens, tools, thinking or tools is not None, initial)
