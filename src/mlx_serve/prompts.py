"""Chat messages -> prompt tokens through the model's chat template (tools included)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlx_serve.errors import RequestError, UnsupportedParameterError
from mlx_serve.prompt_encoder import PromptEncoder
from mlx_serve.protocol import (
    CHAT_TEMPLATE_KWARGS,
    AllowedToolsChoice,
    ChatCompletionRequest,
    ChatMessage,
)
from mlx_serve.strict_calls import call_schema


@dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    tools: list[dict] | None  # the tools offered to the model (for parsing its calls)
    split_reasoning: bool  # the model has thinking or tool-call markers to route apart
    initial_state: str  # "reasoning" when the template left a thinking span open
    # tool_choice "required" or a named function: the JSON schema the call must follow
    # (the prompt then ends inside an opened tool call)
    forced_call: dict | None = None
    # The request turned the template's thinking off (``enable_thinking`` or ``thinking``
    # false, or a reasoning_effort of none or minimal): the model is not to open a
    # reasoning span.
    thinking_off: bool = False


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


def with_allowed_tools(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """``tool_choice: allowed_tools``: the request as if it offered only the tools named,
    with the choice's mode (``auto`` or ``required``) as its ``tool_choice``. The others
    are left out of the prompt (OpenAI keeps them there, for its prompt cache), so the
    model cannot call them."""
    choice = body.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return body
    offered = {t.function.name for t in body.tools or ()}
    allowed = set()
    for tool in choice.allowed_tools.tools:
        function = tool.get("function")
        name = tool.get("name") or (function.get("name") if isinstance(function, dict) else None)
        if tool.get("type") != "function" or not isinstance(name, str) or name not in offered:
            raise RequestError(f"'tool_choice' allows {tool!r}, which is not a function in "
                               "'tools'", param="tool_choice")
        allowed.add(name)
    tools = [t for t in body.tools or () if t.function.name in allowed]
    return body.model_copy(update={"tools": tools, "tool_choice": choice.allowed_tools.mode})


def offered_tools(body: ChatCompletionRequest, tokenizer: Any) -> list[dict] | None:
    """The tools whose calls the reply may make (and are parsed): none with tool_choice
    "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    if not getattr(tokenizer, "has_tool_calling", False):
        raise UnsupportedParameterError(
            "this model's chat template does not support tool calling", param="tools")
    return _tool_dicts(body)


def prompt_tools(body: ChatCompletionRequest, tokenizer: Any) -> list[dict] | None:
    """The tools the chat template renders: the offered ones, and with tool_choice
    "none" the same, as OpenAI and vLLM keep them in the prompt (none is parsed)."""
    if body.tools and body.tool_choice == "none" and getattr(tokenizer, "has_tool_calling",
                                                               False):
        return _tool_dicts(body)
    return offered_tools(body, tokenizer)


def _tool_dicts(body: ChatCompletionRequest) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def forced_call_schema(body: ChatCompletionRequest, tokenizer: Any) -> dict | None:
    """For tool_choice "required" or a named function: the schema of the one call.

    A forced call is written as JSON, ``{"name", "arguments"}``, between the model's
    tool-call markers, whatever the model's own format (as vLLM forces a call with a
    JSON grammar), and read as JSON.
    """
    choice = body.tool_choice
    if choice in (None, "auto", "none") or not body.tools:
        if choice not in (None, "auto", "none"):
            raise RequestError("'tool_choice' forces a call but no 'tools' were given",
                               param="tool_choice")
        return None
    if not getattr(tokenizer, "tool_call_start", None):
        raise UnsupportedParameterError(
            "forcing a tool call needs a model with tool-call markers in its chat template",
            param="tool_choice")
    tools = [t.function for t in body.tools]
    assert not isinstance(choice, AllowedToolsChoice)  # with_allowed_tools made it a mode
    if not isinstance(choice, str):
        wanted = choice.function.get("name")
        tools = [f for f in tools if f.name == wanted]
        if not tools:
            raise RequestError(f"'tool_choice' names '{wanted}', which is not in 'tools'",
                               param="tool_choice")
    return call_schema(tools, enforce_all=True)


def template_kwargs(body: ChatCompletionRequest, tokenizer: Any) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    unknown = set(kwargs) - CHAT_TEMPLATE_KWARGS
    if unknown:
        raise RequestError(
            f"'chat_template_kwargs' may only hold {sorted(CHAT_TEMPLATE_KWARGS)}; "
            f"got {sorted(unknown)}", param="chat_template_kwargs")
    if body.reasoning_effort is not None:
        kwargs.update(effort_kwargs(body.reasoning_effort, tokenizer))
    return kwargs


def effort_kwargs(effort: str, tokenizer: Any) -> dict[str, Any]:
    """``reasoning_effort`` as the chat template's own setting: its ``reasoning_effort``
    (gpt-oss-style templates), else its thinking switch (Qwen-style ``enable_thinking``:
    off for "none" and "minimal"). A template with neither cannot honour it: a 400, as
    OpenAI answers it for a model that does not reason."""
    template = getattr(tokenizer, "chat_template", None)
    source = template if isinstance(template, str) else str(template or "")
    if "reasoning_effort" in source:
        return {"reasoning_effort": effort}
    if "enable_thinking" in source:
        return {"enable_thinking": effort not in ("none", "minimal")}
    raise UnsupportedParameterError(
        "'reasoning_effort' is not supported with this model (its chat template has no "
        "reasoning setting)", param="reasoning_effort")


@dataclass(frozen=True)
class ChatText:
    """A chat rendered by its template, before it is encoded."""

    text: str
    tools: list[dict] | None
    kwargs: dict[str, Any]


def render_chat(tokenizer: Any, encode: PromptEncoder, body: ChatCompletionRequest
                ) -> Rendered:
    chat = chat_text(tokenizer, body)
    # What apply_chat_template(tokenize=True) does, through the lock-keeping encoder.
    return rendered_chat(tokenizer, encode, body, chat,
                         encode(chat.text, add_special_tokens=False))


def chat_text(tokenizer: Any, body: ChatCompletionRequest) -> ChatText:
    """The chat's prompt as its template renders it (no tokens yet)."""
    if not getattr(tokenizer, "has_chat_template", True):
        raise RequestError("this model has no chat template; use /v1/completions")
    tools = offered_tools(body, tokenizer)
    kwargs = template_kwargs(body, tokenizer)
    messages = [message_dict(m) for m in body.messages]
    if body.continue_final_message and body.add_generation_prompt:  # as vLLM
        raise RequestError("'continue_final_message' needs 'add_generation_prompt': false",
                           param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=prompt_tools(body, tokenizer),
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False, **kwargs)
    except Exception as exc:  # template errors, e.g. a role the template refuses
        raise RequestError(f"the chat template rejected the messages: {exc}",
                           param="messages") from None
    if body.continue_final_message:
        text = open_final_message(text, messages[-1]["content"])
    return ChatText(text, tools, kwargs)


def rendered_chat(tokenizer: Any, encode: PromptEncoder, body: ChatCompletionRequest,
                  chat: ChatText, tokens: list[int]) -> Rendered:
    """The rendered chat, given its text's tokens (``add_special_tokens`` false)."""
    thinking = bool(getattr(tokenizer, "has_thinking", False))
    initial = "normal"
    if thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
        initial = "reasoning"
    initial = getattr(tokenizer, "response_initial_state", None) or initial
    forced = forced_call_schema(body, tokenizer)
    if forced is not None and body.continue_final_message:
        raise RequestError("a forced tool call starts a new reply; it cannot continue the "
                           "final message", param="continue_final_message")
    if forced is not None:  # open the call in the prompt; the schema does the rest
        opening = (tokenizer.think_end + "\n" if initial == "reasoning" else "")
        tokens = tokens + encode(opening + tokenizer.tool_call_start, add_special_tokens=False)
        initial = "tool"
    return Rendered(tokens, chat.tools, thinking or chat.tools is not None, initial, forced,
                    thinking_off=False in (chat.kwargs.get("enable_thinking"),
                                           chat.kwargs.get("thinking")))


def open_final_message(text: str, content: Any) -> str:
    """The rendered chat cut right after the final message's text, so that the reply
    continues it (vLLM's ``continue_final_message``, as transformers cuts it: a template
    may trim the message's edges, and then the cut follows the trimmed text)."""
    if not isinstance(content, str) or not content.strip():
        raise RequestError("'continue_final_message' needs a final message with text",
                           param="continue_final_message")
    at = text.rfind(content.strip())
    if at < 0:
        raise RequestError("the chat template changes the final message's text, so it "
                           "cannot be continued", param="continue_final_message")
    kept = content.lstrip()
    if text[at:at + len(kept)] != kept:  # the template trimmed its trailing space
        kept = content.strip()
    return text[:at + len(kept)]
