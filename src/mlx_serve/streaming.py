"""Reply events -> an SSE stream or one JSON body, for any number of choices."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from mlx_serve.engine import RequestHandle
from mlx_serve.errors import MLXServeError
from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import Delta, Failure, ReplyEvent
from mlx_serve.metrics import RequestTracker
from mlx_serve.replies import Choice, ReplyShape


class SSEResponse(StreamingResponse):
    """Server-sent events from an iterator of ready ``data:`` frames.

    sse-starlette spends most of a streamed token's event-loop time on its own per-send
    machinery; our frames are complete bytes already, so they are written as they come.
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], request_id: str) -> None:
        super().__init__(frames, headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no",
                                          "x-request-id": request_id})

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but the frames that end with ``[DONE]`` also end the body: the
        last bytes and the chunked body's terminator leave in one write, not two."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        ended = False
        async for frames in self.body_iterator:
            ended = isinstance(frames, bytes) and frames.endswith(DONE)
            await send({"type": "http.response.body", "body": frames, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"


def _frame(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def pings_until_output(handle: RequestHandle, ping_seconds: float
                             ) -> AsyncIterator[bytes]:
    """An SSE comment every ``ping_seconds`` until the request's first event is in, so
    that idle-timeout proxies keep the connection."""
    while True:
        with anyio.move_on_after(ping_seconds):
            await handle.peek()
            return
        yield PING


class QuietPings:
    """Comments for a stream whose events carry nothing to send for a while (a tool call
    in a format that is parsed only once complete), so idle-timeout proxies keep it.

    ``quiet`` is called for such an event, ``spoke`` after each write; the time is read
    only while the stream is quiet, never on the path of a written token.
    """

    __slots__ = ("_every", "_since")

    def __init__(self, every: float) -> None:
        self._every = every
        self._since: float | None = None

    def spoke(self) -> None:
        self._since = None

    def quiet(self) -> bytes | None:
        """A ping when the stream has been quiet for ``every`` seconds, else None."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since >= self._every:
            self._since = now
            return PING
        return None


def tell_tracker(tracker: RequestTracker | None, choices: list[Choice],
                 error: MLXServeError | None) -> None:
    """How a reply ended, for the metrics."""
    if tracker is not None:
        tracker.end([c.finish for c in choices], sum(c.tokens for c in choices),
                    error.status_code if error is not None else None)


@dataclasses.dataclass
class _StreamEnd:
    """How a streamed reply ended, as its writes go out."""

    error: MLXServeError | None = None
    done: bool = False  # [DONE] written


async def sse_events(
    handle: RequestHandle, shape: ReplyShape, choices: int, failpoints: FailPoints,
    user: str | None, ping_seconds: float, merge_text: bool = False,
    tracker: RequestTracker | None = None,
) -> AsyncIterator[bytes]:
    """The SSE frames of one streamed reply, ending with ``data: [DONE]``.

    Until the first output, a comment every ``ping_seconds`` keeps idle-timeout proxies
    from cutting the connection. An error after the stream has started becomes an
    ``error`` object, then ``[DONE]``. Leaving early (the client is gone) closes the
    handle, which tells the actor to drop the request's sequences. With ``merge_text``
    the plain-text deltas that queued up together go out as one chunk. ``tracker`` is
    told when the first output is in and, once, how the reply ended.
    """
    users = (user,) if user is not None else ()
    state = [Choice(i) for i in range(choices)]
    end = _StreamEnd()
    async with handle:
        try:
            async for ping in pings_until_output(handle, ping_seconds):
                yield ping
            if tracker is not None:
                tracker.first_output()
            if shape.chat:
                await failpoints.acheck("sse.send", users)
            for frame in _opening_frames(shape, choices, await handle.peek()):
                yield frame
            writes = _event_writes(handle, shape, state, merge_text, failpoints, users,
                                   ping_seconds, end)
            async with aclosing(writes):
                async for frames in writes:
                    yield frames
        except MLXServeError as exc:
            end.error = exc
            yield _frame(json.dumps(exc.to_dict()))
        except Exception as exc:  # a fault in our own send path still ends the stream cleanly
            end.error = MLXServeError(f"streaming failed: {type(exc).__name__}")
            yield _frame(json.dumps(end.error.to_dict()))
        finally:  # also when the client left: the generator is closed at a yield
            tell_tracker(tracker, state, end.error)
        if not end.done:
            yield DONE


async def _event_writes(
    handle: RequestHandle, shape: ReplyShape, state: list[Choice], merge_text: bool,
    failpoints: FailPoints, users: tuple[str, ...], ping_seconds: float, end: _StreamEnd,
) -> AsyncGenerator[bytes, None]:
    """One write for the events that are in; the reply's last write also carries its
    usage chunk and [DONE] (a short reply is mostly writes). A failure's error frame
    ends the writes."""
    quiet = QuietPings(ping_seconds)
    async for event in handle:
        # Everything that queued up meanwhile goes out in one write: when the event loop
        # falls behind, each write carries several tokens.
        pending = [event, *handle.take_ready()]
        frames, end.error = _event_frames(
            shape, state, merge_text_deltas(pending) if merge_text else pending)
        last = end.error is None and handle.ended
        if last:
            frames.extend(_closing_frames(shape, state))
        if frames:
            if failpoints:
                await failpoints.acheck("sse.send", users)
            yield b"".join(frames)
            quiet.spoke()
        elif (keep_alive := quiet.quiet()) is not None:
            yield keep_alive
        end.done = last
        if last or end.error is not None:
            return
    if end.error is None:  # the end came after the last events (an engine process's)
        yield b"".join(_closing_frames(shape, state))
        end.done = True


def _closing_frames(shape: ReplyShape, state: list[Choice]) -> list[bytes]:
    """What ends a reply that did not fail: the usage chunk when asked for, [DONE]."""
    usage = [_frame(json.dumps(shape.usage_chunk(state)))] if shape.include_usage else []
    return [*usage, DONE]


def _opening_frames(shape: ReplyShape, choices: int, first: ReplyEvent | None
                    ) -> list[bytes]:
    """The chat's role chunks, or a completion's echoed prompts: they come first (echoes
    with logprobs come as soon as their scores do, with the choice's first delta). A
    lone choice whose first event opens a tool call says content null, as OpenAI's."""
    if shape.chat:
        opens_call = (choices == 1 and isinstance(first, Delta) and not first.text
                      and not first.reasoning and bool(first.tool_calls or first.tool_text))
        content = None if opens_call else ""
        return [_frame(json.dumps(shape.role_chunk(i, content))) for i in range(choices)]
    echoes = {} if shape.echo_waits_for_scores else shape.echo
    return [_frame(json.dumps(shape.echo_chunk(i, prompt))) for i, prompt in echoes.items()]


def _event_frames(shape: ReplyShape, state: list[Choice], events: list[ReplyEvent]
                  ) -> tuple[list[bytes], MLXServeError | None]:
    """The SSE frames of events taken together, and the error of a failure among them
    (its error frame is the last: the stream ends there)."""
    frames = []
    for event in events:
        if isinstance(event, Failure):
            frames.append(_frame(json.dumps(event.error.to_dict())))
            return frames, event.error
        choice = state[event.index]
        if event.prompt_logprobs is not None and event.index in shape.echo:
            frames.append(_frame(json.dumps(shape.echo_chunk(
                event.index, shape.echo[event.index], event.prompt_logprobs))))
        chunk = shape.delta_chunk(choice, event, shape.absorb(choice, event))
        if chunk is not None:
            frames.append(_frame(chunk))
    return frames, None


def merge_text_deltas(events: list[ReplyEvent]) -> list[ReplyEvent]:
    """Join each choice's runs of plain-text deltas (the last may carry the finish).

    Choices of one request interleave step by step; each keeps its own order.
    """
    merged: list[ReplyEvent] = []
    open_at: dict[int, int] = {}  # choice -> position of its last unfinished text delta
    for event in events:
        at = open_at.pop(event.index, None)
        plain = (isinstance(event, Delta) and not event.reasoning and not event.tool_calls
                 and not event.tool_text and not event.logprobs and event.prompt_logprobs is None)
        if plain and at is not None:
            last = merged[at]
            assert isinstance(last, Delta) and isinstance(event, Delta)
            merged[at] = dataclasses.replace(
                event, text=last.text + event.text,
                token_count=last.token_count + event.token_count)
        else:
            at = len(merged)
            merged.append(event)
        if plain and event.finish_reason is None:  # type: ignore[union-attr]
            open_at[event.index] = at
    return merged


async def collect(handle: RequestHandle, shape: ReplyShape, choices: int, request: Request,
                  tracker: RequestTracker | None = None, into: list[Choice] | None = None
                  ) -> list[Choice]:
    """Wait for a whole reply's choices; a client that disconnects meanwhile cancels the
    request.

    A failure is raised (its HTTP error is counted where it becomes a response;
    ``tracker`` counts its time and tokens); ``tracker`` hears of every other ending.
    ``into``: the choices to fill (fresh ones by default)."""
    state = into if into is not None else [Choice(i) for i in range(choices)]
    failure: MLXServeError | None = None
    async with handle, anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        try:
            async for event in handle:
                if isinstance(event, Failure):
                    failure = event.error
                    break
                shape.absorb(state[event.index], event)
        finally:  # a client that left: what was made for it still counts, in the metrics
            for event in handle.take_ready():
                if not isinstance(event, Failure):
                    shape.absorb(state[event.index], event)
        tg.cancel_scope.cancel()
    if failure is not None:
        if tracker is not None:
            tracker.failed(sum(c.tokens for c in state))
        raise failure  # outside the task group, so it is not wrapped in a group
    tell_tracker(tracker, state, None)
    return state


async def fail_fast(handle: RequestHandle, request: Request, window: float,
                    tracker: RequestTracker | None = None) -> None:
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
        if tracker is not None:
            tracker.failed()
        raise first.error


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
