"""SSE keep-alive while a stream waits, and errors before the first chunk."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("edges") / "server.log"
    spec = "engine.admit[user=bad]=raise(ValueError:refused);engine.step[user=slow]=sleep(400)"
    with ServerProcess(tiny_model_dir, log, env={"MLX_SERVE_FAILPOINTS": spec},
                       args=["--sse-ping-seconds", "0.1"]) as server:
        yield server


def stream_lines(server: ServerProcess, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      timeout=30) as reply:
        return reply.status_code, [line for line in reply.iter_lines() if line]


def test_a_waiting_stream_is_kept_alive_with_comments(slow_server):
    status, lines = stream_lines(slow_server, {"prompt": "hi", "max_tokens": 3,
                                               "stream": True, "user": "slow"})
    assert status == 200
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert any(line.startswith(":") for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"


def test_a_stream_that_fails_before_any_output_is_a_plain_http_error(slow_server):
    reply = httpx.post(slow_server.base_url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "user": "bad"})
    assert reply.status_code == 400
    assert reply.headers["content-type"].startswith("application/json")
    assert "refused" in reply.json()["error"]["message"]
