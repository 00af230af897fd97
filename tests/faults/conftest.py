"""Fixtures for the fault suite: real ``mlx_serve`` processes on 127.0.0.1.

``launch`` starts one server per scenario (stopped at teardown); ``reference`` is one
fault-free server for the whole session whose temperature-0 outputs are the expected
outputs of every scenario (cached per request body).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Reference
from tests.server_process import ServerProcess


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Reference]:
    log = tmp_path_factory.mktemp("reference") / "server.log"
    with ServerProcess(tiny_model_dir, log) as server:
        yield Reference(server)


@pytest.fixture
def launch(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``launch(*flags, failpoints=SPEC, env=VARS)``: a ready server; stopped at teardown."""
    servers: list[ServerProcess] = []

    def start(*args: str, failpoints: str | None = None,
              env: dict[str, str] | None = None) -> ServerProcess:
        flags = list(args)
        if failpoints is not None:
            flags += ["--failpoints", failpoints]
        log = tmp_path / f"server-{len(servers)}.log"
        server = ServerProcess(tiny_model_dir, log, env=env, args=flags)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        # A graceful stop is what scenario 7 tests; here it would only cost seconds.
        if server.proc.poll() is None:
            server.proc.kill()
        server.stop()


@pytest.fixture
def model_name(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name  # the served model id is the folder's name
