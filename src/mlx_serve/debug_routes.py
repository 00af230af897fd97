"""Runtime fail-point control, mounted only with ``failpoints_http`` (loopback only)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_serve.errors import RequestError
from mlx_serve.failpoints import FailPointSpecError
from mlx_serve.remote_engine import RemoteEngine


async def get_failpoints(request: Request) -> Response:
    return JSONResponse(request.app.state.server.failpoints.describe())


async def put_failpoint(request: Request) -> Response:
    site = request.path_params["site"]
    action = (await request.body()).decode("utf-8", "replace").strip()
    try:
        request.app.state.server.failpoints.set(site, action)
    except FailPointSpecError as exc:
        raise RequestError(str(exc), param="action") from None
    _forward(request, site, action)
    return JSONResponse(request.app.state.server.failpoints.describe())


async def delete_failpoint(request: Request) -> Response:
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
