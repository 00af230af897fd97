"""A Response as its stream of events, output item by output item.

The items open as the model writes them, in the order the final Response lists them: the
reasoning (thinking models; its text as ``response.reasoning_text.delta`` events), the
message at the reply's first text (``response.output_text.delta``; none for a reply of
calls or reasoning alone, as at OpenAI), and each function call (its arguments as
``response.function_call_arguments.delta`` while they are written). The reasoning is
closed (``...done`` events) when the next item opens, the message and the calls when
theirs end or the reply does, and every id and output index in the events is the one the
final Response carries, so the SDK's stream helper rebuilds exactly that Response.
Reasoning that a model writes after its first text (rare) comes last, whole, in an item
of its own, where the final Response lists it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from mlx_serve.engine import RequestHandle
from mlx_serve.errors import MLXServeError
from mlx_serve.generation import Delta, Failure
from mlx_serve.metrics import RequestTracker
from mlx_serve.replies import Choice, ReplyShape, chat_logprob
from mlx_serve.responses_api import (
    ResponseBuilder,
    final_status,
    function_call_item,
    has_message,
    output_text,
    reasoning_parts,
)
from mlx_serve.responses_store import StreamKeeper
from mlx_serve.streaming import QuietPings, pings_until_output, tell_tracker
from mlx_serve.tool_calls import CallUpdate


class _EventWriter:
    """SSE frames of Responses events, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()


class _OutputItems:
    """Which output items a stream has opened, at which indexes, and their events."""

    def __init__(self, builder: ResponseBuilder, shape: ReplyShape) -> None:
        self.builder, self.shape = builder, shape
        self.event = _EventWriter()
        self.choice = Choice(0)
        self.opened = 0  # output items opened so far
        self.reasoning_at: int | None = None
        self.reasoning_open = False
        self.message_at: int | None = None
        self.call_at: dict[int, int] = {}  # a call's position in the reply: its index
        self.pending: list[dict[str, Any]] = []  # logprobs not sent with a text delta yet

    def message_where(self) -> dict[str, Any]:
        return {"item_id": self.builder.message_id, "output_index": self.message_at,
                "content_index": 0}

    def delta(self, delta: Delta) -> list[bytes]:
        """One delta's events. A token that completes no character yet (part of a UTF-8
        sequence) has no text of its own: its log-probability goes with the next text."""
        frames: list[bytes] = []
        updates = self.shape.absorb(self.choice, delta)
        # Reasoning after the answer began (text or a call) comes whole at the end, as the
        # item of its own that the final Response lists last.
        if delta.reasoning and self.message_at is None and not self.call_at:
            if self.reasoning_at is None:
                frames += self._open_reasoning()
            frames.append(self.event(
                "response.reasoning_text.delta", item_id=self.builder.reasoning_id,
                output_index=self.reasoning_at, content_index=0, delta=delta.reasoning))
        self.pending += [chat_logprob(t) for t in delta.logprobs]
        if delta.text:
            frames += self.open_message()
            frames.append(self.event("response.output_text.delta", **self.message_where(),
                                     delta=delta.text, logprobs=list(self.pending)))
            self.pending.clear()
        for update in updates:
            frames += self._call_events(update)
        return frames

    def _open_reasoning(self) -> list[bytes]:
        self.reasoning_at, self.reasoning_open = self.opened, True
        self.opened += 1
        return [self.event("response.output_item.added", output_index=self.reasoning_at,
                           item=self.builder.reasoning("", "in_progress"))]

    def _close_reasoning(self, status: str = "completed") -> list[bytes]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        text = reasoning_parts(self.choice)[0]
        where = {"item_id": self.builder.reasoning_id, "output_index": self.reasoning_at}
        return [self.event("response.reasoning_text.done", **where, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=self.reasoning_at,
                           item=self.builder.reasoning(text, status))]

    def _late_reasoning(self, final: dict[str, Any]) -> list[bytes]:
        """Reasoning written after the reply's answer began (not streamed as it came: a
        message or call was open), as the item the final Response lists last, whole."""
        item = final["output"][-1]
        if item["type"] != "reasoning" or item["id"] != self.builder.late_reasoning_id:
            return []
        at, text = self.opened, item["content"][0]["text"]
        where = {"item_id": item["id"], "output_index": at}
        return [self.event("response.output_item.added", output_index=at,
                           item=self.builder.reasoning("", "in_progress", late=True)),
                self.event("response.reasoning_text.delta", **where, content_index=0,
                           delta=text),
                self.event("response.reasoning_text.done", **where, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=at, item=item)]

    def open_message(self) -> list[bytes]:
        """The message item's opening, once, at its first text: after the reasoning."""
        if self.message_at is not None:
            return []
        frames = self._close_reasoning()
        self.message_at = self.opened
        self.opened += 1
        frames += [self.event("response.output_item.added", output_index=self.message_at,
                              item=self.builder.message("", "in_progress")),
                   self.event("response.content_part.added", **self.message_where(),
                              part=output_text(""))]
        return frames

    def _call_events(self, update: CallUpdate) -> list[bytes]:
        """A function call's events: the item when it opens, its arguments as they are
        written, and the whole call when it is done. Calls follow the reasoning."""
        frames = self._close_reasoning() if update.opened else []
        if update.opened:
            self.call_at[update.position] = self.opened
            self.opened += 1
        call = self.choice.tool_calls[update.position]
        index = self.call_at[update.position]
        where = {"item_id": f"fc_{call['id']}", "output_index": index}
        if not (update.opened or update.done):  # most updates: a piece of arguments
            return [self.event("response.function_call_arguments.delta", **where,
                               delta=update.arguments)] if update.arguments else []
        item = function_call_item(call, self.choice.call_complete(update.position))
        if update.opened:
            frames.append(self.event("response.output_item.added", output_index=index,
                                     item={**item, "arguments": "", "status": "in_progress"}))
        if update.arguments:
            frames.append(self.event("response.function_call_arguments.delta", **where,
                                     delta=update.arguments))
        if update.done:
            frames += [self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return frames

    def cut_off(self) -> dict[str, Any]:
        """The Response as far as it got when its stream stopped without an end (its
        client left): ``cancelled``, its open items ``incomplete``."""
        after = self.message_at is not None and any(
            at < self.message_at for at in self.call_at.values())
        final = self.builder.response("cancelled", self.choice, self.shape.prompt_tokens,
                                      message_after_calls=after)
        if self.message_at is None:  # a message the stream never announced
            final["output"] = [i for i in final["output"] if i["type"] != "message"]
        return final

    def closing(self, error: MLXServeError | None) -> tuple[list[bytes], dict[str, Any]]:
        """The stream's last events, and the final Response they carry."""
        builder, choice, prompt_tokens = self.builder, self.choice, self.shape.prompt_tokens
        if error is not None:
            final = builder.response("failed", choice, prompt_tokens, error)
            if self.message_at is None:  # a message the stream never announced
                final["output"] = [i for i in final["output"] if i["type"] != "message"]
            return [self.event("response.failed", response=final)], final
        status = final_status(choice)
        if not has_message(choice):  # calls or reasoning alone
            final = builder.response(status, choice, prompt_tokens)
            ended_in = next((i for i in final["output"] if i["type"] == "reasoning"), None)
            return self._close_reasoning(ended_in["status"] if ended_in else "completed") + [
                *self._late_reasoning(final),
                self.event(f"response.{status}", response=final)], final
        frames = self.open_message()  # a reply of nothing at all: an empty message
        assert self.message_at is not None
        after = any(at < self.message_at for at in self.call_at.values())
        final = builder.response(status, choice, prompt_tokens, message_after_calls=after)
        # The events repeat the final Response's message (its logprobs built once, there).
        message = next(item for item in final["output"] if item["type"] == "message")
        text = "".join(choice.content)
        part = message["content"][0] if message["content"] else output_text(text)
        where = self.message_where()
        return frames + [
            self.event("response.output_text.done", **where, text=text,
                       logprobs=part["logprobs"]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=self.message_at,
                       item=message),
            *self._late_reasoning(final),
            self.event(f"response.{status}", response=final),
        ], final


async def response_events(handle: RequestHandle, shape: ReplyShape, builder: ResponseBuilder,
                          ping_seconds: float, tracker: RequestTracker | None = None,
                          keeper: StreamKeeper | None = None) -> AsyncIterator[bytes]:
    """The Responses stream: created, in progress, the output items' events, then
    completed (incomplete at max_output_tokens, failed on an error). ``keeper`` gets the
    Response in progress at once, then the final one whatever its status: ``cancelled``,
    with what was made, if the stream stops before its end (its client left)."""
    items = _OutputItems(builder, shape)
    event = items.event
    error: MLXServeError | None = None
    created = builder.response("in_progress")
    if keeper is not None:  # its id is found from the first event on
        keeper.begin(created)
    try:
        async with handle:  # first: a client gone at any yield below closes the request
            try:
                yield event("response.created", response=created)
                yield event("response.in_progress", response=created)
                async for ping in pings_until_output(handle, ping_seconds):
                    yield ping
                if tracker is not None:
                    tracker.first_output()
                quiet = QuietPings(ping_seconds)
                async for item in handle:
                    if isinstance(item, Failure):
                        error = item.error
                        break
                    frames = items.delta(item)
                    if frames:
                        yield b"".join(frames)
                        quiet.spoke()
                    elif (keep_alive := quiet.quiet()) is not None:
                        yield keep_alive
            except MLXServeError as exc:
                error = exc
            except Exception as exc:  # a fault in our own send path still ends it cleanly
                error = MLXServeError(f"streaming failed: {type(exc).__name__}")
            finally:
                tell_tracker(tracker, [items.choice], error)
        frames, final = items.closing(error)
        if keeper is not None:  # a failed one too: its client has its id, as at OpenAI
            keeper.end(final)
        for frame in frames:
            yield frame
    except BaseException:  # GeneratorExit or a cancellation: the stream stopped short
        if keeper is not None:
            keeper.end(items.cut_off())  # a no-op once the final one was kept
        raise
