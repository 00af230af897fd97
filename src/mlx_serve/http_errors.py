"""The one place where exceptions become HTTP responses (OpenAI error objects)."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from mlx_serve.errors import MLXServeError

log = logging.getLogger(__name__)


def error_response(request: Request, exc: MLXServeError,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    server = getattr(request.app.state, "server", None)
    if server is not None:  # None only before the lifespan has started
        server.metrics.error(exc.status_code)
    headers = dict(headers or {})
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
        # The OpenAI SDKs prefer this one: spread over half to one and a half times the
        # wait, the clients that a full queue turned away come back apart, not together.
        headers["retry-after-ms"] = str(round(exc.retry_after * random.uniform(500, 1500)))
    if exc.should_retry is not None:
        headers["x-should-retry"] = "true" if exc.should_retry else "false"
    if exc.closes_connection:
        headers["Connection"] = "close"
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)


async def handle_mlx_serve_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MLXServeError)
    return error_response(request, exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = MLXServeError(_http_error_message(request, exc), code=None)
    error.status_code = exc.status_code
    error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(request, error, exc.headers)  # e.g. Allow on a 405


def _http_error_message(request: Request, exc: HTTPException) -> str:
    """Starlette's bare "Not Found" and "Method Not Allowed" from routing say which
    request they answer, as OpenAI's API does ("Invalid URL (POST /v1/embeddings)")."""
    target = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and exc.detail == HTTPStatus.NOT_FOUND.phrase:
        return f"Invalid URL ({target}): this server has no such endpoint"
    if exc.status_code == 405 and exc.detail == HTTPStatus.METHOD_NOT_ALLOWED.phrase:
        allowed = (exc.headers or {}).get("Allow")
        return (f"Method not allowed ({target})"
                + (f": this endpoint takes {allowed}" if allowed else ""))
    return str(exc.detail)


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    """The client left while its body was being read: no fault of ours, and no one to
    answer. Counted as aborted, as a stream the client leaves is."""
    log.info("client left before its %s %s request arrived whole", request.method,
             request.url.path)
    server = getattr(request.app.state, "server", None)
    if server is not None:
        server.metrics.aborted.inc()
    return Response(status_code=499)  # nginx's "client closed request"; never delivered


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(request, MLXServeError(f"internal server error: {type(exc).__name__}"))


EXCEPTION_HANDLERS = {
    MLXServeError: handle_mlx_serve_error,
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_client_disconnect,
    Exception: handle_unexpected,
}
