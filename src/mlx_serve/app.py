"""The ASGI application: ``create_app(settings)``, and ``app`` for ``uvicorn mlx_serve.app:app``.

The lifespan owns the engine's task group: the actor starts with the app and, at
shutdown, drains (in-flight requests finish up to ``drain_timeout``) before it is
cancelled, which fails whatever is left with a terminal error.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.applications import Starlette

from mlx_serve.config import Settings
from mlx_serve.engine import Engine, EngineConfig, EngineState
from mlx_serve.failpoints import FailPoints
from mlx_serve.http_errors import EXCEPTION_HANDLERS
from mlx_serve.mlx_thread import MLXThread
from mlx_serve.models import DEFAULT_MODEL_ID, resolve_model
from mlx_serve.preload import jemalloc_active, openblas_active
from mlx_serve.routes import ROUTES
from mlx_serve.server_state import ServerState

log = logging.getLogger("mlx_serve")

FATAL_EXIT_CODE = 70  # EX_SOFTWARE: a supervisor should restart us
FATAL_EXIT_GRACE = 1.0  # seconds for in-flight error replies under plain uvicorn
ABORT_GRACE = 5.0  # seconds for the actor to end after an abort


def served_model_name(settings: Settings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model is None:
        return DEFAULT_MODEL_ID
    return os.path.basename(os.path.normpath(settings.model)) or settings.model


def make_loader(settings: Settings, failpoints: FailPoints) -> Any:
    """The engine's load job (runs on the MLX thread): resolve, convert once, load."""

    def load() -> Any:
        from mlx_serve.runner import BatchLimits, load_runner

        openblas = openblas_active()
        dequantize = settings.dequantize_default_model
        if dequantize is None:
            dequantize = openblas
        if openblas:
            log.info("OpenBLAS is active: float32 matmuls use it")
        if jemalloc_active():
            log.info("jemalloc is active: memory allocation uses it")
        if settings.model is None:
            form = "float32 (fast with OpenBLAS)" if dequantize else "4-bit"
            log.info("serving the embedded default model as %s", form)
        path, _ = resolve_model(settings.model, settings.cache_dir, progress=log.info,
                                dequantize=dequantize)
        log.info("loading model from %s", path)
        limits = BatchLimits(settings.decode_batch_size, settings.prefill_batch_size,
                             settings.prefill_step_size)
        runner = load_runner(path, limits=limits, failpoints=failpoints,
                             max_context=settings.max_context,
                             prefix_cache_bytes=settings.prefix_cache_bytes,
                             cache_limit_bytes=settings.mlx_cache_limit_bytes,
                             one_array_logprobs=settings.one_array_logprobs)
        log.info("model loaded: context %d tokens", runner.context_length)
        return runner

    return load


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        max_running=settings.decode_batch_size,
        max_queue=settings.max_queue,
        step_timeout=settings.step_timeout,
        max_failed_rebuilds=settings.max_failed_rebuilds,
        max_request_failures=settings.max_request_failures,
        pipeline_depth=settings.pipeline_depth,
    )


async def _settle_after_load(engine: Engine) -> None:
    """Once the model is loaded: warm what the first requests would wait for, then take
    everything loaded so far out of the garbage collector's way."""
    await engine.ready.wait()
    if engine.runner is None:
        return
    await _warm_structured_output(engine)
    log.info("froze %d startup objects out of the garbage collector's view",
             freeze_startup_heap())


async def _warm_structured_output(engine: Engine) -> None:
    """Build the tokenizer's grammar tables (a second or so) before a client needs them."""
    try:
        await anyio.to_thread.run_sync(engine.runner.compile_response_format,
                                       {"type": "json_object"})
    except Exception as exc:  # structured output then fails per request, with a 400
        log.warning("structured output unavailable: %s", exc)


def freeze_startup_heap() -> int:
    """Move every object alive now (modules, tokenizer, grammar tables) to the permanent
    generation, as vLLM does after its warm-up; return how many.

    A full collection otherwise walks all of them, and the whole process stands still
    meanwhile, MLX thread included: on the tiny model at 128 streams a full collection
    under load took 88 ms, 15 ms with the startup heap frozen. Refcounting still frees
    frozen objects; only cycles among them stay until exit.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


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


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    failpoints = FailPoints.from_spec(settings.failpoints)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        mlx = MLXThread()
        engine = Engine(make_loader(settings, failpoints), engine_config(settings), mlx)
        state = ServerState(settings, engine, failpoints, served_model_name(settings))
        app.state.server = state
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run_engine, state)
                tg.start_soon(_settle_after_load, engine)
                yield
                engine.begin_drain()
                with anyio.move_on_after(settings.drain_timeout):
                    await engine.finished.wait()
                engine.abort()  # whatever is left gets a terminal error, stuck step or not
                with anyio.move_on_after(ABORT_GRACE):
                    await engine.finished.wait()
                tg.cancel_scope.cancel()
        finally:
            failpoints.release()  # no MLX job may stay blocked on a hang fail point
            mlx.stop(timeout=10)

    from mlx_serve.debug_routes import debug_routes

    routes = ROUTES + (debug_routes() if settings.failpoints_http else [])
    return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)


def __getattr__(name: str) -> Any:
    # ``uvicorn mlx_serve.app:app`` reads settings from MLX_SERVE_* at import, lazily, so
    # that importing this module for create_app() has no side effects.
    if name == "app":
        return create_app()
    raise AttributeError(name)
