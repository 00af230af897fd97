"""Black-box tests of request-body limits: bodies too large, declared or growing, bodies
that stop arriving, heads never finished, and the budget of bodies read at once; each
answered in OpenAI's error shape (or the connection closed) by a real server with small
limits (``tests/error_server.py``). Every wait is bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

from tests.error_server import (
    BODY_TIMEOUT,
    HI,
    MAX_BODY,
    MODEL,
    TIMEOUT,
    assert_serving_without_a_trace,
    error_of,
    error_server_fixture,
    http_fixture,
    raw_exchange,
)

server = error_server_fixture("http_body_limits")
http = http_fixture()


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


def test_still_serving_and_no_traceback_in_the_log(server, http):
    # Last in the module: no body above, however broken, left a trace.
    assert_serving_without_a_trace(server, http)
