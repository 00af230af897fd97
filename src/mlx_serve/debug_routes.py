"""Runtime fail-point control, mounted only with ``failpoints_http`` (loopback only).

The settings refuse ``failpoints_http`` unless ``host`` is loopback, but under plain
``uvicorn mlx_serve.app:app`` uvicorn's own ``--host`` decides where it listens: so each
request must come from a loopback address too, and carry the API key when one is set.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_serve.config import is_loopback
from mlx_serve.errors import MLXServeError, RequestError
from mlx_serve.failpoints import FailPointSpecError
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.routes import authorize


class NotLoopbackError(MLXServeError):
    status_code = 403
    error_type = "invalid_request_error"
    code = "forbidden"


def _allowed(request: Request) -> None:
    client = request.client
    if client is None or not is_loopback(client.host):
        raise NotLoopbackError("the fail-point endpoints answer loopback clients only")
    authorize(request, request.app.state.server)


async def get_failpoints(request: Request) -> Response:
    _allowed(request)
    return JSONResponse(request.app.state.server.failpoints.describe())


async def put_failpoint(request: Request) -> Response:
    _allowed(request)
    site = request.path_params["site"]
    action = (await request.body()).decode("utf-8", "replace").strip()
    try:
        request.app.state.server.failpoints.set(site, action)
    except FailPointSpecError as exc:
        raise RequestError(str(exc), param="action") from None
    _forward(request, site, action)
    return JSONResponse(request.app.state.server.failpoints.describe())


async def delete_failpoint(request: Request) -> Response:
    _allowed(request)
    request.app.state.server.failpoints.clear(request.path_params["site"])
    _forward(request, request.path_params["site"], None)
    return JSONResponse(request.app.state.server.failpoints.describe())


def _forward(request: Request, site: str, action: str | None) -> None:
    """An engine in its own process has its own fail points (None clears the site)."""
    engine = request.app.state.server.engine
    if isinstance(engine, RemoteEngine):
        engine.set_failpoint(site, action)


def debug_routes() -> list[Route]:
    return [
        Route("/_debug/failpoints", get_failpoints, methods=["GET"]),
        Route("/_debug/failpoints/{site:path}", put_failpoint, methods=["PUT"]),
        Route("/_debug/failpoints/{site:path}", delete_failpoint, methods=["DELETE"]),
    ]
