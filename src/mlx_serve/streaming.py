"""Reply events -> OpenAI replies: SSE chunks (streaming) or one JSON body.

Chunks are plain dicts serialised with ``json.dumps``: this is the per-token hot path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request

from mlx_serve.engine import RequestHandle
from mlx_serve.errors import MLXServeError
from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import Failure


@dataclass
class ReplyShape:
    """What differs between /v1/chat/completions and /v1/completions replies."""

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta: dict[str, str] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        body = {"id": self.id, "object": self._object(chunk=True), "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {"id": self.id, "object": self._object(chunk=True), "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage(completion_tokens)}

    def completion(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": self._object(chunk=False), "created": self.created,
                "model": self.model, "choices": [choice],
                "usage": self.usage(completion_tokens)}

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"


async def sse_events(
    handle: RequestHandle, shape: ReplyShape, failpoints: FailPoints, user: str | None
) -> AsyncIterator[str]:
    """The SSE ``data:`` payloads of one streamed reply, ending with ``[DONE]``.

    An error after the first chunk becomes an ``error`` object, then ``[DONE]``.
    Leaving early (client gone: sse-starlette cancels us) closes the handle, which
    tells the actor to drop the request.
    """
    users = (user,) if user is not None else ()
    completion_tokens = 0
    async with handle:
        try:
            if shape.chat:
                await failpoints.acheck("sse.send", users)
                yield json.dumps(shape.chunk("", None, first=True))
            async for event in handle:
                if isinstance(event, Failure):
                    yield json.dumps(event.error.to_dict())
                    break
                completion_tokens += event.token_count
                finish = event.finish_reason
                await failpoints.acheck("sse.send", users)
                if event.text or finish is None:
                    yield json.dumps(shape.chunk(event.text, None))
                if finish is not None:
                    yield json.dumps(shape.chunk(None if shape.chat else "", finish.value))
                    if shape.include_usage:
                        yield json.dumps(shape.usage_chunk(completion_tokens))
        except MLXServeError as exc:
            yield json.dumps(exc.to_dict())
        except Exception as exc:  # a fault in our own send path still ends the stream cleanly
            yield json.dumps(MLXServeError(f"streaming failed: {type(exc).__name__}").to_dict())
        yield "[DONE]"


async def collect(handle: RequestHandle, shape: ReplyShape, request: Request) -> dict:
    """Wait for a whole reply; a client that disconnects meanwhile cancels the request."""
    parts: list[str] = []
    completion_tokens = 0
    outcome: dict | MLXServeError = {}  # stays empty only if the client went away
    async with handle, anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        async for event in handle:
            if isinstance(event, Failure):
                outcome = event.error
                break
            parts.append(event.text)
            completion_tokens += event.token_count
            if event.finish_reason is not None:
                outcome = shape.completion("".join(parts), event.finish_reason.value,
                                           completion_tokens)
                break
        tg.cancel_scope.cancel()
    if isinstance(outcome, MLXServeError):
        raise outcome  # outside the task group, so it is not wrapped in a group
    return outcome


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
