"""The ``http`` layer of ``benchmarks.layers``: the actor behind mlx_serve's routes.

mlx_serve's own routes, SSE path and error handlers on uvicorn (httptools, as the
server runs them), on the same event loop as the ``Engine`` actor, in the benchmark's
process and over its loaded runner; the clients are ``benchmarks.loadgen`` in a process
of its own, as real clients are. What this layer costs over ``actor`` is what HTTP costs
the batch step, measured without a second process's model, heap or vCPU in the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from benchmarks.environment import ROOT

if TYPE_CHECKING:
    from benchmarks.layers import Counted


def loadgen_command(url: str, model_path: str, count: int, seed: int, args: Any,
                    out: str) -> list[str]:
    """The load generator's command line: ``count`` streamed requests, no warm-up."""
    return [sys.executable, "-m", "benchmarks.loadgen", "--base-url", url,
            "--tokenizer", model_path, "--concurrency", str(args.concurrency),
            "--num-requests", str(count), "--prompt-tokens", str(args.prompt_tokens),
            "--output-tokens", str(args.output_tokens), "--stream", "--warmup", "0",
            "--seed", str(seed), "--time-limit", str(args.run_time_limit), "--json", out]


async def serve_and_load(runner: Any, mlx: Any, args: Any, model_path: str, count: int,
                         seed: int) -> Counted:
    """Serve ``runner`` over HTTP while the load generator sends ``count`` requests.

    Returns the batch steps, output tokens, the clients' TTFT p50 and the load
    generator's duration (first request sent to last reply done: its start-up is not
    the server's time).
    """
    from starlette.applications import Starlette

    from benchmarks.layers import Counted
    from mlx_serve.config import Settings
    from mlx_serve.engine import Engine, EngineConfig
    from mlx_serve.failpoints import FailPoints
    from mlx_serve.http_errors import EXCEPTION_HANDLERS
    from mlx_serve.metrics import ServerMetrics
    from mlx_serve.routes import ROUTES
    from mlx_serve.server_state import ServerState

    engine = Engine(lambda: runner, EngineConfig(max_running=args.decode_batch_size), mlx)
    actor = asyncio.ensure_future(engine.run())
    app = Starlette(routes=ROUTES, exception_handlers=EXCEPTION_HANDLERS)
    settings = Settings(model=model_path, decode_batch_size=args.decode_batch_size,
                        prefill_batch_size=args.prefill_batch_size,
                        prefill_step_size=args.prefill_step_size)
    app.state.server = ServerState(settings, engine, FailPoints(), "layers",
                                   ServerMetrics(engine))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = ListeningServer(uvicorn.Config(app, lifespan="off", log_level="warning",
                                            backlog=2048))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.wait_for(engine.ready.wait(), args.run_time_limit)
        await _listening(server, serving, args.run_time_limit)
        first = engine.statistics().steps
        summary = await _load(url, model_path, count, seed, args)
        steps = engine.statistics().steps - first
        if summary["failed"] or summary["completed"] != count:
            raise RuntimeError(f"http: {summary['failed']} of {count} requests failed")
        return Counted(steps, summary["output_tokens"], summary["ttft_ms"]["p50"],
                       summary["duration_s"])
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)
        sock.close()
        engine.abort()
        await asyncio.wait_for(engine.finished.wait(), 30)
        await actor


class ListeningServer(uvicorn.Server):
    """uvicorn's server with an event for "listening" (uvicorn itself has only a flag)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


async def _listening(server: ListeningServer, serving: asyncio.Future[Any],
                     limit: float) -> None:
    """Until uvicorn listens; an error if it ended first or took over ``limit``."""
    listening: asyncio.Future[Any] = asyncio.ensure_future(server.listening.wait())
    done, _ = await asyncio.wait({listening, serving}, timeout=limit,
                                 return_when=asyncio.FIRST_COMPLETED)
    if listening not in done:
        listening.cancel()
        raise RuntimeError("http: uvicorn did not start")


async def _load(url: str, model_path: str, count: int, seed: int, args: Any
                ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="layer-http-") as tmp:
        out = os.path.join(tmp, "load.json")
        # From the checkout's root, ``-m benchmarks.loadgen`` finds this checkout's tools.
        proc = await asyncio.create_subprocess_exec(
            *loadgen_command(url, model_path, count, seed, args, out), cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), args.run_time_limit + 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError("http: the load generator did not finish") from None
        if proc.returncode != 0:
            raise RuntimeError(f"http: the load generator failed: {err.decode()[-2000:]}")
        return json.loads(Path(out).read_text())["summary"]
