from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from mlx_serve.engine import Engine, EngineConfig
from mlx_serve.failpoints import FailPoints
from mlx_serve.file_limit import import_mlx_lm
from mlx_serve.mlx_thread import MLXThread
from mlx_serve.tiny_model import build_tiny_model
from tests.server_process import ServerProcess

# Before any test module imports mlx-lm (which would set this process's open-files limit
# to 2,048, hard 4,096): the tests keep the limits the machine gave.
import_mlx_lm()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@asynccontextmanager
async def running_engine(
    model_dir: Path,
    *,
    failpoints: str | None = None,
    config: EngineConfig | None = None,
    decode_batch_size: int = 32,
    prefix_cache_bytes: int = 0,
) -> AsyncIterator[Engine]:
    """An engine on the tiny model, its actor running in a task group; stopped on exit."""
    from mlx_serve.runner import BatchLimits, load_runner
    from mlx_serve.runner.streams import release_thread_streams

    fp = FailPoints.from_spec(failpoints)
    limits = BatchLimits(decode_batch_size=decode_batch_size, prefill_batch_size=8,
                         prefill_step_size=64)
    mlx = MLXThread(on_exit=release_thread_streams)  # as the server's (engine_setup)
    engine = Engine(lambda: load_runner(str(model_dir), limits=limits, failpoints=fp,
                                        prefix_cache_bytes=prefix_cache_bytes),
                    config or EngineConfig(max_running=decode_batch_size), mlx)
    engine.failpoints = fp  # type: ignore[attr-defined]  # tests flip them at run time
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            with anyio.fail_after(60):
                await engine.ready.wait()
            try:
                yield engine
            finally:  # as the app's shutdown: a busy actor ends on abort, stuck step or not
                engine.abort()
                tg.cancel_scope.cancel()
    finally:
        fp.release()
        mlx.stop(timeout=10)


@pytest.fixture(scope="session")
def agentic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with thinking and tool-call markers (mlx-lm's json_tools parser)."""
    return build_tiny_model(tmp_path_factory.mktemp("agentic") / "agentic", agentic=True)


@pytest.fixture(scope="session")
def agentic_tokenizer(agentic_dir: Path):
    from mlx_lm import load

    return load(str(agentic_dir))[1]


@pytest.fixture(scope="session")
def agentic_server(agentic_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("agentic-log") / "server.log"
    with ServerProcess(agentic_dir, log) as server:
        yield server


@pytest.fixture(scope="session")
def xml_server(agentic_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """The agentic tiny model with Qwen3-Coder's parser: the same <tool_call> markers,
    XML calls inside them."""
    folder = tmp_path_factory.mktemp("xml-model") / "model"
    shutil.copytree(agentic_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tool_parser_type"] = "qwen3_coder"
    config_path.write_text(json.dumps(config))
    with ServerProcess(folder, folder.parent / "server.log") as server:
        yield server


@pytest.fixture(params=["agentic_server", "xml_server"], ids=["json-calls", "xml-calls"])
def calls_server(request: pytest.FixtureRequest) -> ServerProcess:
    """The agentic model with its own calls in JSON, then with its own calls in XML
    (which a grammar makes JSON)."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def tiny_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model_dir, tmp_path / "server.log") as server:
        yield server
