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

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from mlx_serve.engine import RequestHandle
from mlx_serve.errors import MLXServeError, RequestError, UnsupportedParameterError
from mlx_serve.generation import Delta, Failure, TokenLogprob
from mlx_serve.metrics import RequestTracker
from mlx_serve.protocol import (
    RESPONSES_NO_EFFECT,
    RESPONSES_UNSUPPORTED,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionDefinition,
    ItemReference,
    NamedToolChoice,
    ReasoningItem,
    ResponseFormat,
    ResponsesNamedToolChoice,
    ResponsesRequest,
    Tool,
    ToolCall,
)
from mlx_serve.replies import Choice, ReplyShape, chat_logprob
from mlx_serve.request_building import check_extra_fields
from mlx_serve.streaming import pings_until_output, tell_tracker
from mlx_serve.tool_calls import CallUpdate

# The one ``include`` served: each output text's token log-probabilities (with
# ``top_logprobs`` alternatives), as chat's logprobs give them.
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def as_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response; a 400 for what is not served."""
    check_extra_fields(body.model_extra, RESPONSES_UNSUPPORTED, RESPONSES_NO_EFFECT)
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
    return ChatCompletionRequest(
        messages=_messages(body), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, user=body.user,
        response_format=_response_format(body), tools=tools, tool_choice=choice,
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
        logprobs=logprobs or None, top_logprobs=(body.top_logprobs or 0) if logprobs else None)


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """Instructions and input items as chat messages. Reasoning opens an assistant
    message (its ``reasoning_content``, for the chat template to keep or drop), which the
    assistant's text then fills; a function call joins the assistant message before it
    (or opens one); a call's output is a tool message."""
    messages = [ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    for item in [ChatMessage(role="user", content=body.input)] \
            if isinstance(body.input, str) else body.input:
        last = messages[-1] if messages and messages[-1].role == "assistant" else None
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            if last is None:
                messages.append(last := ChatMessage(role="assistant", content=None))
            last.tool_calls = [*(last.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.output))
        elif isinstance(item, ReasoningItem):
            messages.append(ChatMessage(role="assistant", content=None,
                                        reasoning_content=reasoning_text(item)))
        elif isinstance(item, ItemReference):  # resolved from the store before this
            raise RequestError(f"item_reference '{item.id}' was not resolved", param="input")
        elif isinstance(item, ChatMessage):
            messages.append(item)
        else:
            text = item.content if isinstance(item.content, str) else \
                "".join(part.text for part in item.content)
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
        self.created = int(time.time())

    def message(self, text: str, status: str, logprobs: Sequence[TokenLogprob] = ()
                ) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant",
                "content": [_output_text(text, logprobs)] if text else []}

    def response(self, status: str, choice: Choice | None = None, prompt_tokens: int = 0,
                 error: MLXServeError | None = None) -> dict[str, Any]:
        body = self._body
        output = []
        incomplete = None
        if choice is not None:
            if choice.reasoning:
                output.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                               "summary": [], "content": [
                                   {"type": "reasoning_text",
                                    "text": "".join(choice.reasoning)}]})
            text = "".join(choice.content)
            output.append(self.message(text, "completed" if status == "completed"
                                       else "incomplete", choice.logprobs))
            output += [function_call_item(call) for call in choice.tool_calls]
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": error.code or error.error_type, "message": error.message}
            if error is not None else None,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "top_logprobs": body.top_logprobs,
            "model": self.model,
            "output": output, "parallel_tool_calls": True,
            "previous_response_id": body.previous_response_id, "store": self.store,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": "auto", "tools": [], "truncation": "disabled", "user": body.user,
            "metadata": (body.model_extra or {}).get("metadata") or {},
            "usage": _usage(choice, prompt_tokens) if choice is not None else None,
        }


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a Responses output item."""
    return {"id": f"fc_{call['id']}", "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def _output_text(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": [chat_logprob(t) for t in logprobs]}


def _usage(choice: Choice, prompt_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": choice.cached_tokens},
            "output_tokens": choice.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + choice.tokens}


def final_status(choice: Choice) -> str:
    return "incomplete" if choice.finish == "length" else "completed"


def whole_response(builder: ResponseBuilder, choice: Choice, prompt_tokens: int) -> dict:
    """A non-streamed Response from its collected choice."""
    return builder.response(final_status(choice), choice, prompt_tokens)


class _EventWriter:
    """SSE frames of Responses events, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()


async def response_events(handle: RequestHandle, shape: ReplyShape, builder: ResponseBuilder,
                          ping_seconds: float, tracker: RequestTracker | None = None,
                          on_end: Callable[[dict[str, Any]], None] | None = None
                          ) -> AsyncIterator[bytes]:
    """The Responses stream: created, in progress, the message's text deltas, then
    completed (incomplete at max_output_tokens, failed on an error). ``on_end`` gets the
    final Response of a stream that completed or ended incomplete."""
    event = _EventWriter()
    where = {"item_id": builder.message_id, "output_index": 0, "content_index": 0}
    choice = Choice(0)
    error: MLXServeError | None = None
    pending: list[dict[str, Any]] = []  # log-probabilities not sent with a text delta yet
    async with handle:  # first: a client gone at any yield below closes the request
        try:
            yield event("response.created", response=builder.response("in_progress"))
            yield event("response.in_progress", response=builder.response("in_progress"))
            async for ping in pings_until_output(handle, ping_seconds):
                yield ping
            if tracker is not None:
                tracker.first_output()
            yield event("response.output_item.added", output_index=0,
                        item=builder.message("", "in_progress"))
            yield event("response.content_part.added", **where, part=_output_text(""))
            async for item in handle:
                if isinstance(item, Failure):
                    error = item.error
                    break
                for frame in _delta_events(event, where, shape, choice, item, pending):
                    yield frame
        except MLXServeError as exc:
            error = exc
        except Exception as exc:  # a fault in our own send path still ends the stream cleanly
            error = MLXServeError(f"streaming failed: {type(exc).__name__}")
        finally:
            tell_tracker(tracker, [choice], error)
    frames, final = _closing_events(event, builder, where, choice, shape.prompt_tokens, error)
    if on_end is not None and error is None:
        on_end(final)
    for frame in frames:
        yield frame


def _delta_events(event: _EventWriter, where: dict[str, Any], shape: ReplyShape,
                  choice: Choice, delta: Delta, pending: list[dict[str, Any]]) -> list[bytes]:
    """One delta's events: its text, and what it added to function calls. A token that
    completes no character yet (part of a UTF-8 sequence) has no text of its own: its
    log-probability waits in ``pending`` and goes with the next text."""
    frames = []
    updates = shape.absorb(choice, delta)
    pending += [chat_logprob(t) for t in delta.logprobs]
    if delta.text:
        frames.append(event("response.output_text.delta", **where, delta=delta.text,
                            logprobs=list(pending)))
        pending.clear()
    for update in updates:
        frames += _call_events(event, update, choice.tool_calls[update.position])
    return frames


def _call_events(event: _EventWriter, update: CallUpdate, call: dict[str, Any]
                 ) -> list[bytes]:
    """A function call's events: the item when it opens, its arguments as they are
    written, and the whole call when it is done. The message is item 0."""
    item = function_call_item(call)
    index = update.position + 1
    where = {"item_id": item["id"], "output_index": index}
    frames = []
    if update.opened:
        frames.append(event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}))
    if update.arguments:
        frames.append(event("response.function_call_arguments.delta", **where,
                            delta=update.arguments))
    if update.done:
        frames += [event("response.function_call_arguments.done", **where, name=item["name"],
                         arguments=item["arguments"]),
                   event("response.output_item.done", output_index=index, item=item)]
    return frames


def _closing_events(event: _EventWriter, builder: ResponseBuilder, where: dict[str, Any],
                    choice: Choice, prompt_tokens: int, error: MLXServeError | None
                    ) -> tuple[list[bytes], dict[str, Any]]:
    """The stream's last events, and the final Response they carry."""
    if error is not None:
        final = builder.response("failed", choice, prompt_tokens, error)
        return [event("response.failed", response=final)], final
    status = final_status(choice)
    final = builder.response(status, choice, prompt_tokens)
    # The events repeat the final Response's message (its logprobs built once, there).
    message = next(item for item in final["output"] if item["type"] == "message")
    text = "".join(choice.content)
    part = message["content"][0] if message["content"] else _output_text(text, choice.logprobs)
    return [
        event("response.output_text.done", **where, text=text, logprobs=part["logprobs"]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=0, item=message),
        event(f"response.{status}", response=final),
    ], final
