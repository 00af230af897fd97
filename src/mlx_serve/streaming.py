"""Reply events -> an SSE stream or one JSON body, for any number of choices."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request

from mlx_serve.engine import RequestHandle
from mlx_serve.errors import MLXServeError
from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import Failure
from mlx_serve.replies import Choice, ReplyShape


async def sse_events(
    handle: RequestHandle, shape: ReplyShape, choices: int, failpoints: FailPoints,
    user: str | None,
) -> AsyncIterator[str]:
    """The SSE ``data:`` payloads of one streamed reply, ending with ``[DONE]``.

    An error after the stream has started becomes an ``error`` object, then ``[DONE]``.
    Leaving early (client gone: sse-starlette cancels us) closes the handle, which tells
    the actor to drop the request's sequences.
    """
    users = (user,) if user is not None else ()
    state = [Choice(i) for i in range(choices)]
    async with handle:
        try:
            if shape.chat:
                await failpoints.acheck("sse.send", users)
                for i in range(choices):
                    yield json.dumps(shape.role_chunk(i))
            async for event in handle:
                if isinstance(event, Failure):
                    yield json.dumps(event.error.to_dict())
                    break
                choice = state[event.index]
                calls = shape.absorb(choice, event)
                chunk = shape.delta_chunk(choice, event, calls)
                if chunk is not None:
                    await failpoints.acheck("sse.send", users)
                    yield json.dumps(chunk)
            else:
                if shape.include_usage:
                    yield json.dumps(shape.usage_chunk(state))
        except MLXServeError as exc:
            yield json.dumps(exc.to_dict())
        except Exception as exc:  # a fault in our own send path still ends the stream cleanly
            yield json.dumps(MLXServeError(f"streaming failed: {type(exc).__name__}").to_dict())
        yield "[DONE]"


async def collect(handle: RequestHandle, shape: ReplyShape, choices: int, request: Request
                  ) -> dict:
    """Wait for a whole reply; a client that disconnects meanwhile cancels the request."""
    state = [Choice(i) for i in range(choices)]
    failure: MLXServeError | None = None
    async with handle, anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        async for event in handle:
            if isinstance(event, Failure):
                failure = event.error
                break
            shape.absorb(state[event.index], event)
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure  # outside the task group, so it is not wrapped in a group
    # Choices without a finish only happen when the client went away: nobody reads it.
    return shape.completion(state)


async def fail_fast(handle: RequestHandle, request: Request, window: float) -> None:
    """Before a stream starts, wait up to ``window`` for its first event.

    A request that fails before any output (admission faults show up within a step)
    then gets a plain HTTP error. After the window the stream starts anyway, kept alive
    with SSE comments, and later errors become ``error`` events.
    """
    first = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        with anyio.move_on_after(window):
            first = await handle.peek()
        tg.cancel_scope.cancel()
    if isinstance(first, Failure):
        handle.close()
        raise first.error


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
