"""JSON bodies that can always be written, and large ones that leave the event loop alone.

Starlette's ``JSONResponse`` writes non-ASCII text as UTF-8, which fails on a lone UTF-16
surrogate: a model's Python or JSON tool-call arguments may escape half of a pair
(``"\\ud83d"``), and reading them makes such a string. Then the body is written as ASCII
JSON, whose ``\\ud83d`` escape any JSON reader takes (and pairs with the next half).

A whole reply with many tokens and logprob alternatives (16 choices of 2,000 tokens with
20 alternatives each is 42 MB) takes seconds to build and encode. ``json_reply`` does
that in a worker thread, encoding long lists a slice at a time: ``json.dumps`` holds the
interpreter lock for the whole of one call, and the event loop (streams, probes) gets it
back between slices, and the garbage collector stays off meanwhile (``collector_paused``).
On the 2-vCPU CPU machine, the slowest /health answer while such a reply was made fell
from 2.9-3.0 s to 0.09-0.22 s (``benchmarks/large_reply.py``).
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable
from typing import Any

import anyio
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response

# Tokens and logprob alternatives in a reply beyond which it is built off the event loop
# (about 1 MB of JSON; a reply without logprobs stays inline up to this many tokens).
LARGE_REPLY_ITEMS = 16_384
# Items of a long list encoded by one json.dumps call: a few ms of the lock at most.
SLICE_ITEMS = 256
_SEPARATORS = (",", ":")


class JSONResponse(StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return _ascii_json(content)


async def json_reply(items: int, build: Callable[[], Any], request_id: str) -> Response:
    """The reply ``build()`` makes; one of more than ``LARGE_REPLY_ITEMS`` items is built
    and encoded in a worker thread. ``x-request-id`` names it, as OpenAI's replies do
    (the SDKs show it as ``_request_id``)."""
    headers = {"x-request-id": request_id}
    if items <= LARGE_REPLY_ITEMS:
        return JSONResponse(build(), headers=headers)
    body = await anyio.to_thread.run_sync(_built_and_rendered, build)
    return Response(body, media_type="application/json", headers=headers)


def _built_and_rendered(build: Callable[[], Any]) -> bytes:
    with collector_paused:
        return render_in_slices(build())


class _CollectorPause:
    """The cyclic garbage collector off while any large reply is built and encoded.

    Such a reply is hundreds of thousands of small dicts (670,000 for 16 x 2,000 tokens
    with 20 alternatives), and the collector's passes over them held the interpreter lock
    for up to about 0.3 s at a time. They hold no cycles: reference counts free them. The
    collector comes back on when the last such reply is done, unless it was off before.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pauses = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._pauses == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._pauses += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._pauses -= 1
            if self._pauses == 0 and self._was_enabled:
                gc.enable()


collector_paused = _CollectorPause()


def render_in_slices(content: Any) -> bytes:
    """The bytes ``JSONResponse`` renders for ``content``, with each list longer than
    ``SLICE_ITEMS`` encoded that many items at a time."""
    pieces: list[str] = []
    _encode(content, pieces)
    try:
        return "".join(pieces).encode()
    except UnicodeEncodeError:  # a lone surrogate: ASCII JSON, as JSONResponse falls back
        return _ascii_json(content)


def _ascii_json(content: Any) -> bytes:
    return json.dumps(content, allow_nan=False, separators=_SEPARATORS).encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=_SEPARATORS)


def _encode(value: Any, out: list[str]) -> None:
    """Walk dicts and short lists down to the long lists in them; encode everything else
    in one call (a long list's items each go whole into their slice's call)."""
    if isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, list) and len(value) > SLICE_ITEMS:
        out.append("[")
        for start in range(0, len(value), SLICE_ITEMS):
            out.append(("," if start else "") + _dumps(value[start:start + SLICE_ITEMS])[1:-1])
        out.append("]")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        out.append(_dumps(value))
