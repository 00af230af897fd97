"""SSE keep-alive while a stream waits, errors before the first chunk, and a stream whose
client takes none of it."""

from __future__ import annotations

import json
import re
import socket
import time
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


@pytest.fixture(scope="module")
def impatient_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("edges-send") / "server.log"
    with ServerProcess(tiny_model_dir, log, args=["--send-timeout", "1"]) as server:
        yield server


def aborted(server: ServerProcess) -> float:
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    match = re.search(r"^mlx_serve_request_aborted_total (\S+)$", metrics, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def test_a_stream_its_client_does_not_read_is_cut_off_and_cancelled(impatient_server):
    """16 long choices with 20 alternatives a token: megabytes the client never takes."""
    body = json.dumps({"prompt": "hi", "n": 16, "max_tokens": 1500, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", impatient_server.port))
        sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while aborted(impatient_server) == 0:  # the server gives up on the client
            assert time.monotonic() < deadline, impatient_server.log_text()
            time.sleep(0.05)
    log = impatient_server.log_text()
    assert "its client took none of the reply for 1 s" in log
    deadline = time.monotonic() + 30
    while httpx.get(impatient_server.base_url + "/health", timeout=30).json()["running"]:
        assert time.monotonic() < deadline, "its choices never left the batch"
        time.sleep(0.05)
    metrics = httpx.get(impatient_server.base_url + "/metrics", timeout=30).text
    assert "mlx_serve_request_success_total{" not in metrics  # no choice ran to its end
    assert "Traceback" not in log
