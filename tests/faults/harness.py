"""Black-box helpers for the fault suite: drive a real server, record how each request ended.

Every client call here is bounded (``CLIENT_TIMEOUT``). A request's whole life is
recorded in a ``Reply`` so that a test can assert that it ended with exactly one terminal
event. Watching the server itself (health, state, fail points, log) is in
``server_watch``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import openai

from tests.http_helpers import strict_json
from tests.server_process import ServerProcess

CLIENT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # no request in this suite may take longer
# The same for the openai SDK, in its own type: newer releases run on httpx2, not httpx.
SDK_TIMEOUT = openai.Timeout(30.0, connect=5.0)
POLL_S = 0.01  # condition polling interval
MALLOC = "[metal::malloc] Resource limit (499000) exceeded"
# Holds every step at the first one until a test replaces the rule over HTTP (which
# releases the hang): the test can then put all its requests in flight before any fault.
GATE = "engine.step=hang"
SLOW_STEPS = "engine.step=sleep(25)"  # keeps work in flight long enough to act on it
NO_EOS = {"0": -100, "2": -100}  # the tiny model's end-of-sequence ids: run to max_tokens
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# Prompts for the tiny model: each gives a different greedy output.
PROMPTS = [f"Request {i}: tell me about topic {i * 7}, " + "and then some more " * (i % 4)
           for i in range(32)]


def chat_body(i: int, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    """A temperature-0 chat request on prompt ``i``."""
    return {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


# -- one request's record -------------------------------------------------------------------


@dataclass
class Reply:
    """How one request ended, as the client saw it."""

    body: dict[str, Any]
    stream: bool
    status: int | None = None
    text: str = ""
    finishes: list[str] = field(default_factory=list)  # non-null finish_reason values
    errors: list[dict[str, Any]] = field(default_factory=list)  # OpenAI error objects
    done: int = 0  # "[DONE]" events
    after_done: list[str] = field(default_factory=list)  # any data after the first [DONE]
    transport_error: str | None = None  # connection reset, timeout, ...
    scored_echoes: int = 0  # completion choices whose logprobs open with the echoed prompt's
    response_id: str | None = None  # a Responses request's finished response
    elapsed: float = 0.0
    ended_at: float = 0.0  # time.monotonic() when the client call returned

    @property
    def finish_reason(self) -> str | None:
        return self.finishes[0] if len(self.finishes) == 1 else None

    @property
    def error(self) -> dict[str, Any] | None:
        return self.errors[0] if len(self.errors) == 1 else None

    @property
    def completed(self) -> bool:
        return self.finish_reason is not None and not self.errors

    @property
    def outcome(self) -> tuple[str, str | None]:
        return self.text, self.finish_reason

    def describe(self) -> str:
        return (f"{'stream' if self.stream else 'json'} status={self.status} "
                f"finishes={self.finishes} errors={self.errors} done={self.done} "
                f"after_done={self.after_done} transport={self.transport_error} "
                f"text={self.text!r} user={self.body.get('user')}")


def assert_one_terminal(reply: Reply) -> None:
    """Exactly one terminal event: a finish_reason or an error, never both, never none."""
    info = reply.describe()
    assert reply.transport_error is None, f"the request did not end cleanly: {info}"
    assert reply.status is not None, info
    assert len(reply.finishes) + len(reply.errors) == 1, f"not one terminal event: {info}"
    for error in reply.errors:
        assert isinstance(error.get("message"), str) and error.get("type"), info
    if reply.stream and reply.status == 200:
        assert reply.done == 1 and not reply.after_done, f"[DONE] not last and single: {info}"
    if reply.errors:
        assert reply.finish_reason is None, info
    if reply.status != 200:
        assert reply.errors, f"HTTP {reply.status} without an OpenAI error object: {info}"


def assert_all_terminal(replies: Iterable[Reply]) -> None:
    for reply in replies:
        assert_one_terminal(reply)


# -- clients --------------------------------------------------------------------------------


def http_client(server: ServerProcess, timeout: httpx.Timeout = CLIENT_TIMEOUT
                ) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=server.base_url, timeout=timeout, limits=limits)


def sdk_client(server: ServerProcess) -> openai.AsyncOpenAI:
    # No retries: a retried 5xx would hide exactly what these tests look for.
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                              max_retries=0, timeout=SDK_TIMEOUT)


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], *,
                      on_content: anyio.Event | None = None,
                      path: str = "/v1/chat/completions") -> Reply:
    """POST a streaming request and read its SSE stream to the end, recording everything.

    ``on_content`` is set when the first non-empty text chunk arrives (the server has
    generated a token for this request).
    """
    body = {**body, "stream": True}
    reply = Reply(body, stream=True)
    start = time.monotonic()
    try:
        async with client.stream("POST", path, json=body) as resp:
            reply.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                _record_error_body(reply, resp)
                return reply
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments
                data = line[len("data:"):].strip()
                if reply.done:
                    reply.after_done.append(data)
                elif data == "[DONE]":
                    reply.done += 1
                else:
                    _record_chunk(reply, strict_json(data), on_content)
    except httpx.HTTPError as exc:
        reply.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        _ended(reply, start)
    return reply


def _ended(reply: Reply, start: float) -> None:
    reply.ended_at = time.monotonic()
    reply.elapsed = reply.ended_at - start


def _record_chunk(reply: Reply, chunk: dict[str, Any], on_content: anyio.Event | None) -> None:
    if "error" in chunk:
        reply.errors.append(chunk["error"])
        return
    for choice in chunk.get("choices", []):
        text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        if text:
            reply.text += text
            if on_content is not None:
                on_content.set()
        if choice.get("finish_reason") is not None:
            reply.finishes.append(choice["finish_reason"])
        _count_scored_echo(reply, choice)


def _count_scored_echo(reply: Reply, choice: dict[str, Any]) -> None:
    """A completion's echoed prompt with its scores opens with its first token, which
    has no log-probability."""
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if "text" in choice and values and values[0] is None:
        reply.scored_echoes += 1


def _record_error_body(reply: Reply, resp: httpx.Response) -> None:
    try:
        payload = strict_json(resp.text)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        reply.errors.append(payload["error"])


async def complete_chat(client: httpx.AsyncClient, body: dict[str, Any],
                        path: str = "/v1/chat/completions") -> Reply:
    """POST a non-streaming request with httpx; record the finish or the error object."""
    reply = Reply(body, stream=False)
    start = time.monotonic()
    try:
        resp = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        reply.transport_error = f"{type(exc).__name__}: {exc}"
        return reply
    finally:
        _ended(reply, start)
    reply.status = resp.status_code
    if resp.status_code != 200:
        _record_error_body(reply, resp)
        return reply
    payload = strict_json(resp.text)
    if "error" in payload:
        reply.errors.append(payload["error"])
    for choice in payload.get("choices", []):
        reply.text += choice.get("message", {}).get("content") or choice.get("text") or ""
        if choice.get("finish_reason") is not None:
            reply.finishes.append(choice["finish_reason"])
        _count_scored_echo(reply, choice)
    return reply


async def sdk_chat(client: openai.AsyncOpenAI, model: str, body: dict[str, Any]) -> Reply:
    """A non-streaming request through the official ``openai`` SDK."""
    reply = Reply(body, stream=False)
    start = time.monotonic()
    params = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
    try:
        result = await client.chat.completions.create(
            model=model, messages=body["messages"], max_tokens=body["max_tokens"], **params)
    except openai.APIStatusError as exc:
        reply.status = exc.status_code
        error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else None
        if isinstance(error, dict):
            reply.errors.append(error)
    except openai.APIError as exc:  # connection errors and timeouts
        reply.transport_error = f"{type(exc).__name__}: {exc}"
    else:
        reply.status = 200
        choice = result.choices[0]
        reply.text = choice.message.content or ""
        if choice.finish_reason is not None:
            reply.finishes.append(choice.finish_reason)
    finally:
        _ended(reply, start)
    return reply


async def gather(*calls: Callable[[], Awaitable[Reply]],
                 alongside: Iterable[Callable[[], Awaitable[Any]]] = ()) -> list[Reply]:
    """Run the calls concurrently (plus ``alongside`` tasks); replies in call order."""
    results: list[Reply | None] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
        for task in alongside:
            tg.start_soon(task)
    return [r for r in results if r is not None]


def call(client: httpx.AsyncClient, body: dict[str, Any], stream: bool, path: str = CHAT
         ) -> Callable[[], Awaitable[Reply]]:
    """A deferred request: streaming (SSE) or not, through httpx."""
    if stream:
        return lambda: stream_chat(client, body, path=path)
    return lambda: complete_chat(client, body, path)


def sdk_call(client: openai.AsyncOpenAI, model: str, body: dict[str, Any]
             ) -> Callable[[], Awaitable[Reply]]:
    """A deferred non-streaming request through the ``openai`` SDK."""
    return lambda: sdk_chat(client, model, body)


# -- expected outputs -----------------------------------------------------------------------


class Reference:
    """Fault-free outputs (text, finish_reason) of request bodies, from a clean server."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self._cache: dict[str, tuple[str, str | None]] = {}

    async def outcomes(self, bodies: list[dict[str, Any]], path: str = CHAT
                       ) -> list[tuple[str, str | None]]:
        plain = [{k: v for k, v in b.items() if k not in ("stream", "user")} for b in bodies]
        keys = [path + json.dumps(b, sort_keys=True) for b in plain]
        missing = {k: b for k, b in zip(keys, plain, strict=True) if k not in self._cache}
        if missing:
            async with http_client(self.server) as client:
                replies = await gather(*[call(client, b, False, path)
                                         for b in missing.values()])
            for key, reply in zip(missing, replies, strict=True):
                assert reply.completed, f"the reference server failed: {reply.describe()}"
                self._cache[key] = reply.outcome
        return [self._cache[k] for k in keys]

    async def outcome(self, body: dict[str, Any]) -> tuple[str, str | None]:
        return (await self.outcomes([body]))[0]


async def assert_serves(server: ServerProcess, reference: Reference, model: str) -> None:
    """The server answers fresh requests (SDK non-streaming, SSE streaming) exactly."""
    body = chat_body(31, max_tokens=8)
    expected = await reference.outcome(body)
    async with http_client(server) as client, sdk_client(server) as sdk:
        replies = [await sdk_chat(sdk, model, body), await stream_chat(client, body)]
    for reply in replies:
        assert_one_terminal(reply)
        assert reply.completed and reply.outcome == expected, reply.describe()


def assert_exact(replies: Iterable[Reply], expected: Iterable[tuple[str, str | None]]) -> None:
    """Every reply completed with exactly the fault-free (text, finish_reason)."""
    for reply, want in zip(replies, expected, strict=True):
        assert_one_terminal(reply)
        assert reply.completed, f"did not complete: {reply.describe()}"
        assert reply.outcome == want, f"output differs from the fault-free run:\n" \
            f"  got  {reply.outcome!r}\n  want {want!r}"
