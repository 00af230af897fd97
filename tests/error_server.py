"""Shared by the black-box tests of HTTP errors and of request-body limits: one real
``python -m mlx_serve`` process on the tiny model per module, served as ``foo``
(``--served-model-name``), with small limits so that every error is cheap to provoke, and
the checks of OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_process import ServerProcess

MODEL = "foo"  # --served-model-name: the model folder is "tiny"
HI = [{"role": "user", "content": "hi"}]  # 17 prompt tokens with the tiny ChatML template
MAX_CONTEXT = 64
MAX_BODY = 2048
BODY_TIMEOUT = 3.0  # seconds; every other test's body arrives at once
BODIES_IN_FLIGHT = 3000  # bytes of bodies read at once; every other test sends one body
TIMEOUT = 30.0
READY_TIMEOUT = 100.0  # a start takes ~3 s, far more on a loaded 2-core machine


def error_server_fixture(name: str) -> Any:
    """A module's ``server`` fixture: ``--max-body-bytes 2048 --max-context 64
    --body-timeout 3 --header-timeout 3``, queue 1 and batch 1 (so that two requests fill
    it once a test hangs its steps through the fail-point HTTP control), its log under a
    temporary folder named ``name``."""

    @pytest.fixture(scope="module")
    def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
        log = tmp_path_factory.mktemp(name) / "server.log"
        proc = ServerProcess(tiny_model_dir, log, args=[
            "--max-body-bytes", str(MAX_BODY), "--max-context", str(MAX_CONTEXT),
            "--body-timeout", str(BODY_TIMEOUT), "--header-timeout", str(BODY_TIMEOUT),
            "--max-body-bytes-in-flight", str(BODIES_IN_FLIGHT),
            "--served-model-name", MODEL,
            "--max-queue", "1", "--decode-batch-size", "1", "--failpoints-http",
            "--drain-timeout", "5"])
        try:
            proc.wait_ready(READY_TIMEOUT)
            yield proc
        finally:
            # Never leave a step hanging: a clean SIGTERM needs the MLX thread back.
            try:
                httpx.delete(proc.base_url + "/_debug/failpoints/engine.step", timeout=5)
            except httpx.HTTPError:
                pass
            proc.stop()

    return server


def http_fixture() -> Any:
    """A module's ``http`` fixture: an httpx client on the module's ``server``."""

    @pytest.fixture
    def http(server: ServerProcess) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
            yield c

    return http


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """Check the status and OpenAI's error shape; return the inner error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def param_matches(error: dict[str, Any], expected: str) -> bool:
    """``param`` names the field, or a path inside it (``messages.0.role``)."""
    param = error["param"] or ""
    return param == expected or param.startswith(expected + ".")


def raw_exchange(server: ServerProcess, head: bytes, body_parts: list[bytes],
                 timeout: float = 5.0) -> bytes:
    """Send a request head and some body bytes, never finish the body; read the reply."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)  # socket timeout bounds this
            if not data:
                break
            reply += data
        return reply


def assert_serving_without_a_trace(server: ServerProcess, http: httpx.Client) -> None:
    """The server still answers, and nothing so far logged a traceback or a 500."""
    assert http.get("/health").json()["status"] == "ok"
    response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert response.status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_text()
    assert " 500 " not in log, server.log_text()
