"""The open-files limit of a real server: kept through mlx-lm's import, raised at
startup, so that a few thousand idle connections leave room for the probes."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

LIMIT = 5000  # above the 4,096 hard limit mlx-lm's import sets
IDLE = 2100  # above the 2,048 it sets as the soft limit


def _limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


@pytest.fixture
def room_for_clients() -> None:
    """This process needs a file per idle connection too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < LIMIT:
        pytest.skip(f"hard open-files limit {hard} < {LIMIT}")
    if soft != resource.RLIM_INFINITY and soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (IDLE + 200, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_limit_is_kept_and_raised_and_probes_answer_beside_idle_connections(
        tiny_model_dir: Path, tmp_path: Path, room_for_clients: None) -> None:
    with ServerProcess(tiny_model_dir, tmp_path / "server.log",
                       open_files=(1024, LIMIT)) as server:
        # Before, importing mlx-lm set (2048, 4096) whatever the process had.
        assert _limits(server.proc.pid) == (LIMIT, LIMIT)
        assert f"open-files limit raised from 1024 to {LIMIT}" in server.log_text()
        idle = []
        try:
            for _ in range(IDLE):
                idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            with httpx.Client(timeout=10) as client:
                assert client.get(server.base_url + "/health").status_code == 200
                assert client.get(server.base_url + "/live").status_code == 200
        finally:
            for sock in idle:
                sock.close()
