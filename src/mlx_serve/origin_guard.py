"""Requests that web pages of other origins send are refused unless allowed.

A browser lets any page send a "simple" cross-origin POST (a form, or ``fetch`` with a
``text/plain`` body) without asking first, and the server reads such a body as JSON
whatever its content type: without this guard any page a user visits could make a
local server generate, fill its queue or store Responses, although it could not read
the replies. CORS alone does not stop that (it only keeps pages from reading what comes
back). Browsers name the sending page's origin in an ``Origin`` header on every such
request; clients that are not browsers (the SDKs, curl) send none. So a request that
changes something and names an origin that ``--allowed-origins`` does not allow gets a
403, as Ollama answers them. Reading requests (GET, HEAD) and CORS preflights pass: a
page cannot read their answers without CORS.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mlx_serve.errors import MLXServeError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class OriginNotAllowedError(MLXServeError):
    status_code = 403
    error_type = "invalid_request_error"
    code = "origin_not_allowed"


class ForeignOriginGuard:
    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allow_any = "*" in allowed_origins
        self.allowed = frozenset(o.encode("latin-1") for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.allow_any
                or scope["method"] in _SAFE_METHODS):
            await self.app(scope, receive, send)
            return
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if origin is None or origin in self.allowed:
            await self.app(scope, receive, send)
            return
        await _refuse(origin.decode("latin-1"), send)


async def _refuse(origin: str, send: Send) -> None:
    error = OriginNotAllowedError(
        f"requests from web pages of origin {origin!r} are not allowed; start the server "
        "with --allowed-origins (MLX_SERVE_ALLOWED_ORIGINS) naming it to allow them",
        param=None)
    body = json.dumps(error.to_dict()).encode()
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})  # its body was never read
    await send({"type": "http.response.body", "body": body})
