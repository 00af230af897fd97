"""The ASGI application: ``create_app(settings)``, and ``app`` for ``uvicorn mlx_serve.app:app``.

The lifespan owns the engine's task group: the actor starts with the app and, at
shutdown, drains (in-flight requests finish up to ``drain_timeout``) before it is
cancelled, which fails whatever is left with a terminal error.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from mlx_serve.body_budget import BodyBudget
from mlx_serve.config import LOG_FORMAT, Settings, describe_invalid, unknown_environment
from mlx_serve.engine import Engine, EngineState
from mlx_serve.engine_setup import (
    engine_config,
    freeze_startup_heap,
    make_loader,
    mlx_thread,
    warm_structured_output,
)
from mlx_serve.failpoints import FailPoints
from mlx_serve.file_limit import raise_open_files_limit
from mlx_serve.http_errors import EXCEPTION_HANDLERS
from mlx_serve.http_stack import log_http_stack, log_interpreter_lock
from mlx_serve.intake_turns import IntakeTurns
from mlx_serve.metrics import ServerMetrics
from mlx_serve.mlx_thread import MLXThread
from mlx_serve.models import DEFAULT_MODEL_ID
from mlx_serve.origin_guard import ForeignOriginGuard
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.responses_store import ResponseStore
from mlx_serve.routes import ROUTES
from mlx_serve.server_state import ServerState

log = logging.getLogger("mlx_serve")

FATAL_EXIT_CODE = 70  # EX_SOFTWARE: a supervisor should restart us
FATAL_EXIT_GRACE = 1.0  # seconds for in-flight error replies under plain uvicorn
ABORT_GRACE = 5.0  # seconds for the actor to end after an abort
# Seconds the shutdown waits for the MLX thread's job in hand (a step, a model still
# loading) before leaving without it; after a second signal, hardly at all.
MLX_STOP_WAIT = 10.0
STOP_NOW_WAIT = 0.5


def served_model_name(settings: Settings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model is None:
        return DEFAULT_MODEL_ID
    return os.path.basename(os.path.normpath(settings.model)) or settings.model


async def _settle_after_load(engine: Engine | RemoteEngine) -> None:
    """Once the model is loaded: warm what the first requests would wait for, then take
    everything loaded so far out of the garbage collector's way."""
    await engine.ready.wait()
    if engine.runner is None:
        return
    if isinstance(engine, Engine):  # an engine process warms its own
        await warm_structured_output(engine.runner)
    log.info("froze %d startup objects out of the garbage collector's view",
             freeze_startup_heap())


async def _run_engine(state: ServerState) -> None:
    try:
        await state.engine.run()
    except Exception:
        pass  # already logged by the actor; its state says failed
    if state.engine.state is EngineState.FAILED and state.settings.exit_on_fatal:
        log.critical("engine failed for good; exiting with status %d", FATAL_EXIT_CODE)
        if state.request_exit is not None:
            state.request_exit(FATAL_EXIT_CODE)  # graceful: the error replies go out first
        else:  # plain uvicorn cannot exit non-zero: give the replies a moment, then go
            await anyio.sleep(FATAL_EXIT_GRACE)
            os._exit(FATAL_EXIT_CODE)


async def drain_engine(engine: Engine | RemoteEngine, timeout: float) -> bool:
    """Let the requests in flight finish for up to ``timeout`` seconds, then give what is
    left a terminal error; whether the engine has ended. The wait after the abort is
    bounded too: an engine that cannot answer (a model still loading, a frozen engine
    process) must not keep the server from stopping, and one still loading its model
    has no request in flight to wait for: it is left at once."""
    engine.begin_drain()
    if not engine.ready.is_set():
        log.info("the model is still loading: nothing in flight, stopping without it")
        engine.abort()
        return False
    with anyio.move_on_after(timeout) as drain:
        await engine.finished.wait()
    if drain.cancelled_caught:
        log.warning("drain timeout: aborting the requests still in flight")
    engine.abort()  # whatever is left gets a terminal error, stuck step or not
    with anyio.move_on_after(ABORT_GRACE) as grace:
        await engine.finished.wait()
    if grace.cancelled_caught:
        log.error("the engine did not end within %.0f s of the abort; stopping without it",
                  ABORT_GRACE)
    return not grace.cancelled_caught


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    failpoints = FailPoints.from_spec(settings.failpoints)
    _log_somewhere(settings.log_level)
    raise_open_files_limit()  # every connection is a file
    if unknown := unknown_environment(os.environ):
        log.warning("ignored environment variables that name no setting: %s",
                    ", ".join(unknown))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        log_http_stack()
        log_interpreter_lock()
        _log_settings(settings)
        mlx: MLXThread | None = None
        engine: Engine | RemoteEngine
        if settings.engine_process:  # the engine and its MLX thread run in a child
            engine = RemoteEngine(settings)
        else:
            mlx = mlx_thread(settings)
            engine = Engine(make_loader(settings, failpoints), engine_config(settings), mlx)
        responses = ResponseStore(settings.responses_store_bytes)
        bodies = BodyBudget(settings.max_body_bytes_in_flight)
        state = ServerState(settings, engine, failpoints, served_model_name(settings),
                            ServerMetrics(engine, responses, bodies), responses=responses,
                            bodies=bodies, intake=IntakeTurns(settings.intake_per_pass))
        app.state.server = state
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run_engine, state)
                tg.start_soon(_settle_after_load, engine)
                yield
                if not state.drained:  # plain uvicorn: no drain has run yet
                    state.stop_now = not await drain_engine(engine, settings.drain_timeout)
                if state.stop_now and isinstance(engine, RemoteEngine):
                    engine.stop_grace = STOP_NOW_WAIT
                tg.cancel_scope.cancel()
        finally:
            failpoints.release()  # no MLX job may stay blocked on a hang fail point
            if mlx is not None:
                mlx.stop(timeout=STOP_NOW_WAIT if state.stop_now else MLX_STOP_WAIT)

    from mlx_serve.debug_routes import debug_routes

    routes = ROUTES + (debug_routes() if settings.failpoints_http else [])
    return Starlette(routes=routes, middleware=_middleware(settings),
                     exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)


def _middleware(settings: Settings) -> list[Middleware]:
    # CORS only when asked for: its middleware sits on every streamed chunk's send, and a
    # server open to every web page's scripts should be a choice (Ollama's default too).
    # The guard looks at each request's head only, and refuses what pages of origins not
    # allowed send without asking (origin_guard.py).
    middleware = [Middleware(ForeignOriginGuard, allowed_origins=settings.origins)]
    if settings.origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.origins,
                                     allow_methods=["GET", "POST", "DELETE"],
                                     allow_headers=["*"]))
    return middleware


def _log_settings(settings: Settings) -> None:
    """What a deployer checks first, in one line."""
    log.info("serving %s as %r: decode batch %d, prefill %d prompts x %d tokens, queue %d, "
             "API key %s, engine %s", settings.model or "the embedded default model",
             served_model_name(settings), settings.decode_batch_size,
             settings.prefill_batch_size, settings.prefill_step_size, settings.max_queue,
             "required" if settings.api_key else "not required",
             "in a child process" if settings.engine_process else "in this process")


def _log_somewhere(level: str) -> None:
    """Under plain uvicorn nothing configures our logger (uvicorn configures its own):
    its info lines (the model loaded, its context, the HTTP stack) went nowhere. Give it
    a handler at ``level`` where neither it nor the root logger has one."""
    if log.handlers or logging.getLogger().handlers:
        return  # mlx-serve's basicConfig, a test runner, or the deployment's own
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
    log.setLevel(level.upper())


def __getattr__(name: str) -> Any:
    # ``uvicorn mlx_serve.app:app`` reads settings from MLX_SERVE_* at import, lazily, so
    # that importing this module for create_app() has no side effects.
    if name == "app":
        try:
            return create_app()
        except ValidationError as exc:  # the settings' faults, not a traceback
            print(f"mlx_serve: invalid MLX_SERVE_* settings:\n{describe_invalid(exc)}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    raise AttributeError(name)
