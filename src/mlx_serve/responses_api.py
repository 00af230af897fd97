"""OpenAI's Responses API (``POST /v1/responses``): a request becomes a chat request for
the same engine, and its reply a Response object or its stream of events.

Served: ``input`` as text, messages, function calls and their outputs, reasoning and
references to stored items, ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, function ``tools`` with ``tool_choice``, ``text.format`` (json_object and
json_schema through the same structured output as chat), ``user``, ``stream``, the
output text's logprobs (``include``, ``top_logprobs``), ``previous_response_id`` with
``store`` (``responses_store``), and ``reasoning.effort`` (chat's ``reasoning_effort``).
Server-side conversations, background responses, reasoning summaries and the like are
a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from mlx_serve.errors import MLXServeError, RequestError, UnsupportedParameterError
from mlx_serve.generation import TokenLogprob
from mlx_serve.protocol import (
    AllowedTools,
    AllowedToolsChoice,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    parts_text,
)
from mlx_serve.protocol_responses import (
    OUTPUT_LOGPROBS,
    RESPONSES_NO_EFFECT,
    RESPONSES_UNSUPPORTED,
    TEXT_UNSUPPORTED,
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    ReasoningItem,
    ResponsesAllowedToolsChoice,
    ResponsesNamedToolChoice,
    ResponsesRequest,
)
from mlx_serve.replies import Choice, chat_logprob
from mlx_serve.request_building import check_extra_fields


def as_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response; a 400 for what is not served."""
    check_extra_fields(body.model_extra, RESPONSES_UNSUPPORTED, RESPONSES_NO_EFFECT)
    if body.text is not None:
        check_extra_fields(body.text.model_extra, TEXT_UNSUPPORTED, frozenset(), "text.")
    if body.truncation == "auto":
        raise UnsupportedParameterError("'truncation': 'auto' is not supported (an input "
                                        "over the context is a 400)", param="truncation")
    unknown = set(body.include or ()) - {OUTPUT_LOGPROBS}
    if unknown:
        raise UnsupportedParameterError(f"'include' of {sorted(unknown)} is not supported "
                                        f"(only {OUTPUT_LOGPROBS!r})", param="include")
    if body.reasoning is not None and (body.reasoning.summary or body.reasoning.generate_summary):
        raise UnsupportedParameterError(
            "reasoning summaries are not made by this server (the reasoning's full text comes "
            "back as a reasoning item); leave 'reasoning.summary' out", param="reasoning.summary")
    logprobs = OUTPUT_LOGPROBS in (body.include or ())
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools] if body.tools else None
    choice: Any = body.tool_choice
    if isinstance(choice, ResponsesNamedToolChoice):
        choice = NamedToolChoice(type="function", function={"name": choice.name})
    elif isinstance(choice, ResponsesAllowedToolsChoice):
        choice = AllowedToolsChoice(type="allowed_tools", allowed_tools=AllowedTools(
            mode=choice.mode, tools=choice.tools))
    return ChatCompletionRequest(
        messages=_messages(body), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, stream=body.stream,
        user=body.user,
        response_format=_response_format(body), tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        logprobs=logprobs or None, top_logprobs=(body.top_logprobs or 0) if logprobs else None)


# The chat request's fields that a Responses request names otherwise, for its errors.
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
                   "response_format": "text.format", "messages": "input"}


def as_responses_error(exc: MLXServeError) -> MLXServeError:
    """An error of the chat request built from a Responses request, naming the Responses
    fields (in ``param`` and, quoted or followed by a space, in the message)."""
    if exc.param is None or exc.param.split(".")[0] not in RESPONSES_NAMES:
        return exc
    first, _, rest = exc.param.partition(".")
    exc.param = RESPONSES_NAMES[first] + ("." + rest if rest else "")
    for chat, responses in RESPONSES_NAMES.items():
        exc.message = (exc.message.replace(f"'{chat}'", f"'{responses}'")
                       .replace(f"{chat} (", f"{responses} ("))
    return exc


def failed_response_code(error: MLXServeError) -> str:
    """A failed Response's ``error.code``, one of the values OpenAI's type for it lists
    (the error's own code, ``engine_dead`` say, stays in its message's words)."""
    if error.status_code == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= error.status_code < 500 else "server_error"


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """Instructions and input items as chat messages. Reasoning opens an assistant
    message (its ``reasoning_content``, for the chat template to keep or drop), which the
    assistant's text then fills; a function call joins the assistant message before it
    (or opens one); a call's output is a tool message."""
    messages = [ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    calls: set[str] = set()  # the call ids so far: an output answers one of them
    for item in [ChatMessage(role="user", content=body.input)] \
            if isinstance(body.input, str) else body.input:
        last = messages[-1] if messages and messages[-1].role == "assistant" else None
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            calls.add(item.call_id)
            if last is None:
                messages.append(last := ChatMessage(role="assistant", content=None))
            last.tool_calls = [*(last.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:  # OpenAI's words
                raise RequestError("No tool call found for function call output with "
                                   f"call_id {item.call_id}.", param="input")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.text()))
        elif isinstance(item, ReasoningItem):
            messages.append(ChatMessage(role="assistant", content=None,
                                        reasoning_content=reasoning_text(item)))
        elif isinstance(item, ItemReference):  # resolved from the store before this
            raise RequestError(f"item_reference '{item.id}' was not resolved", param="input")
        elif isinstance(item, ChatMessage):
            messages.append(item)
        else:
            text = parts_text(item.content)
            if (item.role == "assistant" and last is not None and last.content is None
                    and not last.tool_calls):  # the text after its reasoning
                last.content = text
            else:
                messages.append(ChatMessage(role=item.role, content=text))
    return messages


def reasoning_text(item: ReasoningItem) -> str:
    """A reasoning item's text: its full text where it has it, else its summary. Only
    encrypted reasoning (another server's) cannot be read here: a 400."""
    if item.content:
        return "".join(part.text for part in item.content)
    if item.encrypted_content is not None and not item.summary:
        raise UnsupportedParameterError("encrypted reasoning cannot be read by this server; "
                                        "send the reasoning's text", param="input")
    return "\n\n".join(part.text for part in item.summary)


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema={
        "name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict})


class ResponseBuilder:
    """The Response object of one request, in the states a stream reports it in."""

    def __init__(self, body: ResponsesRequest, model: str, request_id: str,
                 store: bool = False) -> None:
        self._body = body
        self.store = store  # whether the finished response is kept
        self.model = model
        self.id = request_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"  # one id in the stream and the result
        self.late_reasoning_id = f"rs_{uuid.uuid4().hex}"  # reasoning after the message
        self.created = int(time.time())
        self._completed_at: int | None = None  # one time in the stream and the result

    def _completed(self, status: str) -> int | None:
        if status == "completed" and self._completed_at is None:
            self._completed_at = int(time.time())
        return self._completed_at if status == "completed" else None

    def message(self, text: str, status: str, logprobs: Sequence[TokenLogprob] = ()
                ) -> dict[str, Any]:
        # Once under way a message holds its text part, an empty reply's too: the stream
        # opened one (content_part.added) before the first token.
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant",
                "content": [output_text(text, logprobs)] if text or status != "in_progress"
                else []}

    def reasoning(self, text: str, status: str, late: bool = False) -> dict[str, Any]:
        return {"id": self.late_reasoning_id if late else self.reasoning_id,
                "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else [],
                "status": status}

    def response(self, status: str, choice: Choice | None = None, prompt_tokens: int = 0,
                 error: MLXServeError | None = None, message_after_calls: bool = False
                 ) -> dict[str, Any]:
        """``message_after_calls``: a stream opened the message after the calls (text
        written after them), and the output lists the items in the stream's order."""
        body = self._body
        output: list[dict[str, Any]] = []
        incomplete = None
        if choice is not None:
            output = self._output(choice, status, message_after_calls)
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": failed_response_code(error),
                      "message": as_responses_error(error).message}
            if error is not None else None,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "top_logprobs": body.top_logprobs,
            "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": self.store,
            # What sampled it, as OpenAI echoes them: the defaults where none was sent.
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None},
            "completed_at": self._completed(status),
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": _echoed(body.tool_choice) or "auto",
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "truncation": "disabled", "user": body.user,
            "metadata": body.metadata or {},
            "usage": _usage(choice, prompt_tokens) if choice is not None else None,
        }


    def _output(self, choice: Choice, status: str, message_after_calls: bool
                ) -> list[dict[str, Any]]:
        """The reasoning, the message and the function calls, as OpenAI lists them: no
        message item for a reply of calls or reasoning alone with no text. Reasoning
        written after the reply's first text follows them, in an item of its own; an
        item the reply ended in is ``incomplete`` when the reply was cut off."""
        early, late = reasoning_parts(choice)
        cut = status != "completed"
        calls = [function_call_item(call, choice.call_complete(i))
                 for i, call in enumerate(choice.tool_calls)]
        output = [self.reasoning(early, "incomplete" if cut and not late and not calls
                                 and not any(choice.content) else "completed")
                  ] if early else []
        tail = [self.reasoning(late, "incomplete" if cut else "completed", late=True)
                ] if late else []
        if not has_message(choice):
            return output + calls + tail
        message = self.message("".join(choice.content), "incomplete" if cut else "completed",
                               choice.logprobs)
        return output + (calls + [message] if message_after_calls else [message] + calls
                         ) + tail


def reasoning_parts(choice: Choice) -> tuple[str, str]:
    """A reply's reasoning before its answer (its first text or call), and after it."""
    split = choice.reasoning_before_answer
    if split is None:
        return "".join(choice.reasoning), ""
    return "".join(choice.reasoning[:split]), "".join(choice.reasoning[split:])


def has_message(choice: Choice) -> bool:
    """Whether a Response lists a message: when the reply wrote text, or nothing else."""
    return any(choice.content) or not (choice.tool_calls or choice.reasoning)


def _echoed(value: Any) -> Any:
    """A request's setting as the Response echoes it: as sent."""
    return value.model_dump() if isinstance(value, BaseModel) else value


def function_call_item(call: dict[str, Any], complete: bool = True) -> dict[str, Any]:
    """A chat tool call as a Responses output item (``incomplete`` when cut off)."""
    return {"id": f"fc_{call['id']}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed" if complete else "incomplete"}


def output_text(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [chat_logprob(t) for t in logprobs]}


def _usage(choice: Choice, prompt_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            # No cache write is reported apart: finished requests' KV is kept as it is.
            "input_tokens_details": {"cached_tokens": choice.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": choice.tokens,
            "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens},
            "total_tokens": prompt_tokens + choice.tokens}


def final_status(choice: Choice) -> str:
    return "incomplete" if choice.finish == "length" else "completed"


def whole_response(builder: ResponseBuilder, choice: Choice, prompt_tokens: int) -> dict:
    """A non-streamed Response from its collected choice."""
    return builder.response(final_status(choice), choice, prompt_tokens)
