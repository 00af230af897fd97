"""Who may call: ``--api-key`` (here ``MLX_SERVE_API_KEY``), which the /v1 endpoints need
as a bearer token and the probes and /metrics do not, and ``--allowed-origins`` (CORS).
The server runs its engine in a child process, whose command line must not carry the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.http_helpers import HI, MODEL, TIMEOUT, server_fixture
from tests.server_process import ServerProcess

KEY = "sk-test-4f1d8c"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("api_key") / "server.log"
    with ServerProcess(tiny_model_dir, log, env={"MLX_SERVE_API_KEY": KEY},
                       args=["--engine-process", "--allowed-origins", ORIGIN]) as proc:
        yield proc


def sdk(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, timeout=TIMEOUT,
                         max_retries=0)


def test_the_right_key_is_served(server):
    with sdk(server, KEY) as client:
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in client.models.list()] == [MODEL]


def test_a_wrong_key_is_401_in_openai_shape(server):
    with sdk(server, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with pytest.raises(openai.AuthenticationError):
            client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


@pytest.mark.parametrize("header", [None, "Basic " + KEY, "Bearer", "Bearer " + KEY + "x"])
def test_a_missing_or_malformed_authorization_is_401(server, header):
    headers = {"Authorization": header} if header is not None else {}
    response = httpx.post(server.base_url + "/v1/chat/completions", headers=headers,
                          json={"messages": HI, "max_tokens": 2}, timeout=TIMEOUT)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/health", "/live", "/metrics"])
def test_probes_and_metrics_need_no_key(server, path):
    assert httpx.get(server.base_url + path, timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": "hi"}),
                                            ("/detokenize", {"tokens": [100]})])
def test_tokenizing_needs_no_key_as_in_vllm(server, path, body):
    assert httpx.post(server.base_url + path, json=body, timeout=TIMEOUT).status_code == 200
    info = httpx.get(server.base_url + "/tokenizer_info", timeout=TIMEOUT)
    assert info.status_code == 200 and "eos_token" in info.json()


def test_the_engine_process_command_line_has_no_key(server):
    pid = httpx.get(server.base_url + "/health", timeout=TIMEOUT).json()["engine_pid"]
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        pytest.skip("no /proc on this platform")
    assert b"--settings" in cmdline.read_bytes()
    assert KEY.encode() not in cmdline.read_bytes()


# -- browsers ------------------------------------------------------------------------------

def test_cors_is_off_unless_asked_for():
    from starlette.middleware.cors import CORSMiddleware

    from mlx_serve.app import create_app
    from mlx_serve.config import Settings

    assert all(m.cls is not CORSMiddleware for m in create_app(Settings()).user_middleware)
    assert Settings(allowed_origins=" https://a.example, *").origins == ["https://a.example", "*"]


def test_an_allowed_origin_passes_the_preflight_without_a_key(server):
    response = httpx.options(server.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                             headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]


def test_a_browser_may_delete_a_stored_response(server):
    response = httpx.options(server.base_url + "/v1/responses/resp_x", timeout=TIMEOUT,
                             headers={"Origin": ORIGIN, "Access-Control-Request-Method": "DELETE"})
    assert response.status_code == 200
    assert "DELETE" in response.headers["access-control-allow-methods"]


def test_replies_name_the_allowed_origin_and_no_other(server):
    body = {"messages": HI, "max_tokens": 2, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as http:
        allowed = http.post("/v1/chat/completions", json=body,
                            headers={**auth, "Origin": ORIGIN})
        other = http.post("/v1/chat/completions", json=body,
                          headers={**auth, "Origin": "https://elsewhere.example"})
        preflight = http.options("/v1/chat/completions", headers={
            "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.text.rstrip().endswith("data: [DONE]")
    assert other.status_code == 403  # a page of an origin not allowed: refused unread
    assert other.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in other.headers
    assert preflight.status_code == 400


default_server = server_fixture("origins")  # default settings: no origin allowed


def test_a_web_page_cannot_make_a_default_server_generate(default_server):
    """A page may send a form or a text/plain POST to any origin without asking; the
    server reads such a body as JSON, so only the page's Origin tells it apart."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    with httpx.Client(base_url=default_server.base_url, timeout=TIMEOUT) as http:
        for kind in ("text/plain", "application/x-www-form-urlencoded"):
            for path in ("/v1/chat/completions", "/v1/responses", "/tokenize"):
                refused = http.post(path, content=body, headers={
                    "Content-Type": kind, "Origin": "https://evil.example"})
                assert refused.status_code == 403, (path, refused.text)
                assert "--allowed-origins" in refused.json()["error"]["message"]
        # Pages of "null" origin (sandboxed frames, files) are pages too.
        assert http.post("/v1/completions", content='{"prompt": "hi"}',
                         headers={"Origin": "null"}).status_code == 403
        # Clients that are not browsers send no Origin: served as before.
        plain = http.post("/v1/chat/completions", content=body,
                          headers={"Content-Type": "text/plain"})
        assert plain.status_code == 200, plain.text
        # Reads pass (a page cannot see their answers without CORS).
        assert http.get("/v1/models", headers={"Origin": "https://evil.example"}
                        ).status_code == 200
        health = http.get("/health").json()
        assert health["running"] == health["waiting"] == 0
