"""What every endpoint reads from a request: the server's state, a bounded JSON body
validated into a model, the model name it asks for, and an engine that takes work."""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from mlx_serve.engine import Engine, EngineState
from mlx_serve.errors import (
    EngineUnavailableError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
)
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.server_state import ServerState

M = TypeVar("M", bound=BaseModel)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request, state: ServerState) -> Any:
    """Read the body, refusing it as soon as it passes ``max_body_bytes`` (413), when it
    has not arrived whole within ``body_timeout`` (408: uvicorn bounds no body's arrival,
    so a client that stops sending would hold its connection and buffer for ever), or
    when the bodies being read at once would pass their budget with it (429)."""
    settings = state.settings
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
    body = bytearray()
    try:
        with anyio.move_on_after(settings.body_timeout) as arrival:
            async for chunk in request.stream():
                state.bodies.take(len(chunk), len(body))
                body += chunk
                if len(body) > limit:
                    raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
        if arrival.cancelled_caught:
            raise RequestTimeoutError(
                f"the request body did not arrive whole within {settings.body_timeout:g} s")
        return _parsed(body)
    finally:
        state.bodies.give(len(body))


def _parsed(body: bytearray) -> Any:
    """The body's JSON. NaN, Infinity, numbers out of range and lone surrogates, which
    Python's json reads, are refused."""
    try:
        value = json.loads(body, parse_constant=_not_json, parse_float=_finite)
    except ValueError as exc:
        # Python's own refusal of a huge integer names sys.set_int_max_str_digits. (A
        # parse_int hook would say it sooner, but cost a Python call for every integer:
        # 2.5x the parse of a long token-id prompt, on the event loop.)
        why = ("a number has more digits than any field takes"
               if "integer string conversion" in str(exc) else str(exc))
        raise RequestError(f"malformed JSON body: {why}") from None
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(body):  # else no string can hold a lone surrogate
        _check_text(value)
    return value


# A UTF-16 surrogate written as an escape: a pair is one character, one alone is none.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_text(value: Any) -> None:
    """Refuse a string holding a lone surrogate, which no text encoding can write (the
    tokenizer raised on one, a 500)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"the JSON body holds a lone surrogate "
                                   f"(\\u{ord(node[exc.start]):04x}), which is no text") from None
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _not_json(name: str) -> Any:
    """NaN and Infinity, which Python's json reads: no JSON holds them, and a reply that
    echoes one (a Response's ``metadata``) could not be written."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        path, message = _telling_error(body, exc.errors())
        param = ".".join(str(p) for p in path) or None
        raise RequestError(f"invalid value for '{param}': {message}", param=param) from None


def _telling_error(body: Any, errors: list[Any]) -> tuple[tuple[int | str, ...], str]:
    """Of a body's errors, the one to report, with its place in the body.

    A value that fits none of a union's members has an error from each. The members whose
    ``type`` is another than the value's (or that need one it lacks) are not what the
    client meant; of the others,
    the error that went deepest into the body says most, and at one depth an error about
    the value (an empty list, say) more than one about its kind (not a string)."""
    located = [(*_body_path(body, error["loc"], error["type"] == "missing"), error)
               for error in errors]
    wrong = {member for _, member, error in located if member and error["loc"][-1] == "type"
             and error["type"] in ("literal_error", "missing")}
    meant = [entry for entry in located if entry[1] not in wrong] or located
    path, _, error = max(meant, key=lambda entry: (len(entry[0]),
                                                   not entry[2]["type"].endswith("_type")))
    return path, error["msg"]


def _body_path(body: Any, loc: tuple[int | str, ...], missing: bool
               ) -> tuple[tuple[int | str, ...], tuple[int | str, ...]]:
    """An error's location as the body's own keys and indexes, and the location of the
    union member it belongs to (empty if none). Pydantic names a union's member in the
    location (``input.str``, ``prompt.list[int]``), which the client never wrote; a
    missing field's name, the last part, is kept."""
    path: list[int | str] = []
    member: tuple[int | str, ...] = ()
    node = body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            member = loc[:i + 1]
            continue
        path.append(part)
    return tuple(path), member


def ready_engine(state: ServerState) -> Engine | RemoteEngine:
    engine = state.engine
    if engine.state not in (EngineState.READY, EngineState.RECOVERING):
        raise engine.unavailable_error()
    if engine.runner is None:
        raise EngineUnavailableError("the model is still loading")
    return engine


def check_model(state: ServerState, name: str | None) -> str:
    if name is not None and name != state.model_name:
        raise ModelNotFoundError(
            f"the model '{name}' does not exist; this server serves '{state.model_name}'",
            param="model",
        )
    return state.model_name
