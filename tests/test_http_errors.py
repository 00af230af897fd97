"""Black-box tests of every HTTP error: its status and OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}``, against a real ``python -m mlx_serve``
process on the tiny model, served as ``foo`` (``--served-model-name``), with
``--max-body-bytes 2048 --max-context 64 --body-timeout 3 --header-timeout 3``, and
queue 1, batch 1 (so that two requests fill it once the overload test hangs its steps
through the fail-point HTTP control). Every wait is bounded; nothing sleeps to
synchronise.

The deeply nested body test runs after the log check, so a regression that logs a
traceback there shows up in its own test.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
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


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("http_errors") / "server.log"
    # Batch 1 and queue 1 change nothing for the one-at-a-time requests of most tests, and
    # let the overload test fill the server with two requests once it hangs the steps.
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


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        yield c


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


# -- malformed bodies ---------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"{bad json", b"", b'{"messages": [', b"\xff\xfe{"])
def test_malformed_json_is_400(http, raw):
    response = http.post("/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [
    b'{"messages": [], "temperature": NaN}', b'{"x": Infinity}', b'{"x": -Infinity}',
    b'{"x": 1e999}', b'{"metadata": {"a": NaN}}'])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_numbers_json_cannot_hold_are_400(http, raw, path):
    """Python's json reads them; a Response echoing one in its metadata could not be sent."""
    error = error_of(http.post(path, content=raw, headers={"content-type": "application/json"}),
                     400)
    assert "JSON" in error["message"] or "range" in error["message"]


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800"}]}'),
    ("/v1/completions", rb'{"prompt": "\udfff", "max_tokens": 1}'),
    ("/tokenize", rb'{"prompt": "x\udc00y"}'),
    ("/v1/responses", rb'{"input": "hi", "metadata": {"\ud83d": "v"}}')])
def test_a_lone_surrogate_is_400(http, path, raw):
    """JSON lets a string escape half of a UTF-16 pair; no text holds it (the tokenizer
    raised, a 500)."""
    error = error_of(http.post(path, content=raw, headers={"content-type": "application/json"}),
                     400)
    assert "surrogate" in error["message"]


def test_an_escaped_pair_is_one_character(http):
    raw = rb'{"prompt": "\ud83d\ude00", "return_token_strs": true}'  # what ensure_ascii writes
    response = http.post("/tokenize", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200 and "".join(response.json()["token_strs"]) != ""


def test_a_response_json_schema_format_needs_its_name_and_schema(http):
    body = {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}
    error = error_of(http.post("/v1/responses", json=body), 400)
    assert error["param"] == "text.format" and "'name'" in error["message"]


@pytest.mark.parametrize("metadata, param", [
    ("x", "metadata"), ({"k": 1}, "metadata.k"), ({"k": "v" * 513}, "metadata.k"),
    ({str(i): "v" for i in range(17)}, "metadata")])
def test_response_metadata_is_openais_pairs_of_strings(http, metadata, param):
    body = {"input": "hi", "max_output_tokens": 1, "metadata": metadata}
    error = error_of(http.post("/v1/responses", json=body), 400)
    assert param_matches(error, param), error


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/completions", {"prompt": 5}, "prompt", "valid string"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt.1", "valid integer"),
    ("/v1/completions", {"prompt": []}, "prompt", "at least 1 item"),
    ("/v1/responses", {"input": [{"role": 5, "content": "hi"}]}, "input.0.role", "'user'"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input.0.output", "valid string"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]},
     "input.0.output", "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text", "Field required"),
])
def test_a_value_that_fits_no_member_of_a_union_is_named_as_written(http, path, body, param,
                                                                    says):
    """Not pydantic's first member's error (``prompt.str``, or the message item's ``type``
    for a function call's output): the place in the body, in the member the client meant."""
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"null", b"42"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_body_that_is_not_an_object_is_400(http, raw, path):
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert error_of(response, 400)["type"] == "invalid_request_error"


# -- invalid or unsupported parameters (400 naming the parameter) -------------------------

CHAT_400 = [
    ({"model": MODEL}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": HI, "temperature": -0.5}, "temperature"),
    ({"messages": HI, "top_p": 0}, "top_p"),
    ({"messages": HI, "top_p": 1.5}, "top_p"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": HI, "n": 1000}, "n"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HI, "logprobs": "yes please"}, "logprobs"),
    ({"messages": HI, "tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": HI, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"messages": HI, "web_search_options": {}}, "web_search_options"),  # {}: search on
    ({"messages": HI, "verbosity": "low"}, "verbosity"),
    ({"messages": HI, "moderation": {"input": {"mode": "block"}}}, "moderation"),
    ({"messages": HI, "logit_bias": {"100000": 5}}, "logit_bias"),
    ({"messages": HI, "logit_bias": {"7": 150}}, "logit_bias"),
    ({"messages": HI, "stop": [str(i) for i in range(17)]}, "stop"),
    ({"messages": HI, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
     "stream_options"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HI, "user": 42}, "user"),
    ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": HI, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": HI, "min_p": 1.5}, "min_p"),
    ({"messages": HI, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"messages": HI, "min_tokens": -1}, "min_tokens"),
    ({"messages": HI, "ignore_eos": True, "response_format": {"type": "json_object"}},
     "ignore_eos"),
    ({"messages": HI, "min_tokens": 2, "response_format": {"type": "json_object"}},
     "min_tokens"),
]

COMPLETION_400 = [
    ({"model": MODEL}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [100000]}, "prompt"),  # a token id outside the 512-token vocabulary
    ({"prompt": [True]}, "prompt"),  # JSON's true is no token id
    ({"prompt": [1.0]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ({"prompt": "hi", "suffix": "and then"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
     "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_400,
                         ids=[f"chat-{p}-{i}" for i, (_, p) in enumerate(CHAT_400)])
def test_invalid_chat_parameter_is_400_naming_it(http, body, param):
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert param_matches(error, param), error


@pytest.mark.parametrize(("body", "param"), COMPLETION_400,
                         ids=[f"completion-{p}-{i}" for i, (_, p) in enumerate(COMPLETION_400)])
def test_invalid_completion_parameter_is_400_naming_it(http, body, param):
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert param_matches(error, param), error


@pytest.mark.parametrize(("prompt", "kinds"), [
    (["hi", [1, 2]], "a string and a token-id list"),
    ([1, "hi"], "a string and a token id"),
    ([1, [2]], "a token id and a token-id list"),
])
def test_a_prompt_list_of_mixed_kinds_says_so(http, prompt, kinds):
    error = error_of(http.post("/v1/completions", json={"prompt": prompt}), 400)
    assert error["param"] == "prompt"
    assert error["message"].endswith(f"this one mixes {kinds}"), error


def test_unsupported_openai_field_has_its_code(http):
    error = error_of(http.post("/v1/chat/completions",
                               json={"messages": HI, "audio": {"voice": "alloy"}}), 400)
    assert error["param"] == "audio"
    assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("path", "body", "kind"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "input_audio"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input_image"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]}, "input_file"),
])
def test_a_content_part_that_is_not_text_is_refused_by_its_type(http, path, body, kind):
    error = error_of(http.post(path, json=body), 400)
    assert f"content parts of type '{kind}' are not supported" in error["message"], error
    assert error["param"] in ("messages.0.content", "input.0.content")


def test_a_response_text_verbosity_is_refused_unless_the_default(http):
    body = {"input": "hi", "max_output_tokens": 1}
    error = error_of(http.post("/v1/responses", json={**body, "text": {"verbosity": "low"}}),
                     400)
    assert error["param"] == "text.verbosity" and error["code"] == "unsupported_parameter"
    assert http.post("/v1/responses", json={**body, "text": {"verbosity": "medium"}}
                     ).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1,
                                                   "verbosity": "medium"}).status_code == 200


def test_stream_options_the_sdk_sends_are_accepted(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_the_sdk_sees_a_bad_request_error(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)
        assert info.value.status_code == 400
        assert info.value.param == "temperature"
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=1)
        assert info.value.code == "model_not_found"


# -- model names --------------------------------------------------------------------------

def test_served_model_name_changes_the_model_id(server, http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("tiny")  # the folder's name is not the served id
        assert info.value.code == "model_not_found"
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert reply.model == MODEL


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": HI}),
    ("/v1/completions", {"model": "tiny-but-not-quite", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": HI}),  # the folder's name
])
def test_unknown_model_is_404_model_not_found(http, path, body):
    error = error_of(http.post(path, json=body), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


# -- body size ----------------------------------------------------------------------------

def big_body() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}


def test_body_over_the_limit_is_413(http):
    error = error_of(http.post("/v1/chat/completions", json=big_body()), 413)
    assert error["code"] == "payload_too_large"


def test_chunked_body_growing_past_the_limit_is_413(http):
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 1024  # JSON whitespace: the body only grows, never completes

    response = http.post("/v1/chat/completions", content=chunks(),
                         headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert error_of(response, 413)["code"] == "payload_too_large"


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


def test_declared_content_length_over_the_limit_is_refused_before_the_body(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
    reply = raw_exchange(server, head, [])  # no body byte is ever sent
    assert reply.startswith(b"HTTP/1.1 413"), reply


def test_limit_is_enforced_while_reading_not_after(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    parts = [b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(3)]  # 3 KiB, body left open
    started = time.monotonic()
    reply = raw_exchange(server, head, parts)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert time.monotonic() - started < 2.0


def test_a_body_that_stops_arriving_is_408_and_the_connection_closes(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b'{"messages"')  # 11 of the 100 bytes, then nothing
        reply = b""
        while data := sock.recv(65536):  # the socket's timeout bounds each wait
            reply += data  # until the server closes the connection
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", reply
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert f"within {BODY_TIMEOUT:g} s" in error["message"]


def test_bodies_read_at_once_have_a_budget(server, http):
    def in_flight() -> float:
        return float(re.search(r"^mlx_serve_request_body_bytes_in_flight (\S+)$",
                               http.get("/metrics").text, re.MULTILINE).group(1))

    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n")
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "user": "u" * 1400}
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b" " * 1900)  # 1,900 of its 2,000 bytes, held open
        deadline = time.monotonic() + TIMEOUT
        while in_flight() < 1900:
            assert time.monotonic() < deadline, "the held body was never counted"
            time.sleep(0.02)
        refused = http.post("/v1/chat/completions", json=body)
    error = error_of(refused, 429)
    assert error["code"] == "server_overloaded" and refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    deadline = time.monotonic() + TIMEOUT
    while in_flight() > 0:  # the held body's client has gone
        assert time.monotonic() < deadline, "the held body was never given back"
        time.sleep(0.02)
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_connection_that_never_sends_a_whole_head_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost:")
        assert sock.recv(65536) == b""  # closed, no reply; the socket's timeout bounds it
    assert "no complete request head within 3 s" in server.log_text()


def test_a_client_leaving_inside_its_body_counts_as_aborted(server, http):
    def aborted() -> float:
        metrics = http.get("/metrics").text
        return float(re.search(r"^mlx_serve_request_aborted_total (\S+)$", metrics,
                               re.MULTILINE).group(1))

    before = aborted()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(head + b'{"messages"')
    deadline = time.monotonic() + TIMEOUT
    while aborted() == before:  # the server reads on, then sees the connection end
        assert time.monotonic() < deadline, "the client's leaving was never counted"
        time.sleep(0.02)
    assert aborted() == before + 1
    # No error counted or logged for it: the traceback check below reads the log.
    assert 'request_errors_total{status="500"}' not in http.get("/metrics").text


def test_body_just_under_the_limit_is_accepted(http):
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "user": "u" * 1500}
    response = http.post("/v1/chat/completions", json=body)
    assert len(response.request.content) < MAX_BODY
    assert response.status_code == 200, response.text


# -- context length -----------------------------------------------------------------------

def test_prompt_plus_max_tokens_over_the_context_is_400(http):
    error = error_of(http.post("/v1/chat/completions",
                               json={"messages": HI, "max_tokens": MAX_CONTEXT - 17 + 1}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"


def test_prompt_filling_the_context_exactly_is_accepted(http):
    response = http.post("/v1/chat/completions",
                         json={"messages": HI, "max_tokens": MAX_CONTEXT - 17,
                               "logit_bias": {"0": -100, "2": -100}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == MAX_CONTEXT


def test_prompt_alone_over_the_context_is_400(http):
    error = error_of(http.post("/v1/completions",
                               json={"prompt": [5] * MAX_CONTEXT, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded"
    error = error_of(http.post("/v1/completions", json={"prompt": [5] * (MAX_CONTEXT + 10)}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    long_chat = [{"role": "user", "content": "the weather is nice " * 40}]
    error = error_of(http.post("/v1/chat/completions", json={"messages": long_chat}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"


def test_without_max_tokens_the_reply_fits_the_context(http):
    response = http.post("/v1/completions", json={
        "prompt": [5] * (MAX_CONTEXT - 4), "logit_bias": {"0": -100, "2": -100}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["choices"][0]["finish_reason"] == "length"


# -- routes -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/nope", "/v1/embeddings", "/v2/chat/completions"])
def test_unknown_route_is_404_in_openai_shape(http, path):
    error_of(http.post(path, json={}), 404)
    error_of(http.get(path), 404)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("POST", "/v1/models"),
    ("DELETE", "/health"), ("POST", "/live"),
])
def test_wrong_method_is_405_in_openai_shape(http, method, path):
    error_of(http.request(method, path), 405)


def test_405_names_the_allowed_methods(http):
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert "POST" in response.headers.get("allow", "")


# -- overload -----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_overload_answers_429_with_retry_after_at_once(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "temperature": 0}
    accepted: list[asyncio.Task[httpx.Response]] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as c:
        try:
            # From now on every engine step blocks (on the MLX thread) until cleared.
            hang = await c.put("/_debug/failpoints/engine.step", content="hang")
            assert hang.status_code == 200 and hang.json()["engine.step"] == "hang"
            refused = None
            for _ in range(6):  # one runs (its step hangs), one queues, the next is refused
                started = time.monotonic()
                task = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
                while not task.done():  # until the server answers or takes it in
                    stats = (await c.get("/health")).json()
                    if stats["running"] + stats["waiting"] > len(accepted):
                        break
                    assert time.monotonic() - started < 5, stats
                    await asyncio.sleep(0.005)  # a bounded poll, not a synchronisation
                if task.done():
                    refused, elapsed = task.result(), time.monotonic() - started
                    break
                accepted.append(task)
            assert refused is not None, "never overloaded"
            assert len(accepted) == 2  # exactly the batch slot and the queue slot
            error = error_of(refused, 429)
            assert elapsed < 1.0
            assert int(refused.headers["retry-after"]) >= 1
            assert error["type"] == "rate_limit_error"
            # A direct timing of one more refusal, and probes stay fast while stuck.
            started = time.monotonic()
            again = await c.post("/v1/chat/completions", json=body)
            assert again.status_code == 429
            assert time.monotonic() - started < 1.0
            for path in ("/health", "/live"):
                started = time.monotonic()
                assert (await c.get(path)).status_code == 200
                assert time.monotonic() - started < 1.0
            # Release the hang: the two accepted requests complete normally.
            cleared = await c.delete("/_debug/failpoints/engine.step")
            assert cleared.status_code == 200
            assert "engine.step" not in cleared.json()
            for response in await asyncio.wait_for(asyncio.gather(*accepted), TIMEOUT):
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] >= 1
        finally:
            await c.delete("/_debug/failpoints/engine.step")
            for task in accepted:
                task.cancel()


# -- nothing above left a trace -----------------------------------------------------------

def test_still_serving_and_no_traceback_in_the_log(server, http):
    assert http.get("/health").json()["status"] == "ok"
    response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert response.status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_text()
    assert " 500 " not in log, server.log_text()


def test_deeply_nested_json_is_400(http):
    # Runs after the traceback check above. 1500 levels: deeper than
    # Python's recursion limit, yet under this server's 2048-byte body limit.
    response = http.post("/v1/chat/completions", content=b"[" * 1500,
                         headers={"content-type": "application/json"})
    error_of(response, 400)


def test_server_stops_cleanly_on_sigterm(server):
    # Last in the module. The overload test hung engine steps and released them through
    # the fail-point HTTP control; the MLX thread is free again, so a drain-and-exit works.
    server.terminate()
    try:
        code: int | str = server.wait_exit(60)
    except subprocess.TimeoutExpired:
        code = "still running 60 s after SIGTERM"
    assert code == 0, f"{code}\n{server.log_text()}"
