"""``GET /metrics`` of a real server: Prometheus' text format, the engine's figures as of the
scrape, and each request's ending, tokens and latencies counted once."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.http_helpers import (
    HI,
    MODEL,
    NO_EOS,
    TIMEOUT,
    chat_prompt_tokens,
    health,
    read_then_leave,
    server_fixture,
    wait_health,
)
from tests.server_process import ServerProcess

server = server_fixture("metrics")


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    response = httpx.get(server.base_url + "/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_metric(server: ServerProcess, name: str, want: float, timeout: float = 10.0):
    """Scrape until ``name`` reads ``want``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if value(samples, name) == want:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never read {want}: {value(samples, name)}")
        time.sleep(0.02)


def test_a_fresh_server_reports_its_engine_ready_and_idle(server):
    samples = scrape(server)
    assert value(samples, "mlx_serve_engine_state", state="ready") == 1
    assert value(samples, "mlx_serve_engine_state", state="failed") == 0
    assert value(samples, "mlx_serve_num_requests_running") == 0
    assert ("mlx_serve_memory_active_bytes", ()) in samples


def test_requests_are_counted_once_by_how_they_ended(server, tiny_model_dir: Path):
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    before = scrape(server)
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as http:
        whole = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "max_tokens": 5, "logit_bias": NO_EOS})
        assert whole.status_code == 200
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "count", "max_tokens": 4, "stream": True,
                "logit_bias": NO_EOS}) as streamed:
            assert streamed.status_code == 200
            assert list(streamed.iter_lines())[-2] == "data: [DONE]"
        bad = http.post("/v1/chat/completions", json={"messages": HI, "top_p": 7})
        assert bad.status_code == 400

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as client:
            await read_then_leave(client, "/v1/chat/completions", {
                "model": MODEL, "messages": HI, "max_tokens": 2000, "stream": True,
                "logit_bias": NO_EOS}, lines=3)

    anyio.run(leave)
    # The stream that was left ends when the server notices the client is gone.
    after = wait_for_metric(server, "mlx_serve_request_aborted_total",
                            value(before, "mlx_serve_request_aborted_total") + 1)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("mlx_serve_request_success_total", finished_reason="length") == 2
    assert grew("mlx_serve_request_errors_total", status="400") == 1
    assert grew("mlx_serve_prompt_tokens_total") == (
        2 * chat_prompt_tokens(tokenizer, HI) + len(tokenizer.encode("count").ids))
    assert grew("mlx_serve_generation_tokens_total") >= 5 + 4 + 2  # the left one: 2 or more
    # Three requests ended with output; the two streamed ones have a time to first token
    # and a time per output token (a whole reply's tokens all arrive at its end).
    assert grew("mlx_serve_e2e_request_latency_seconds_count") == 3
    assert grew("mlx_serve_time_to_first_token_seconds_count") == 2
    assert grew("mlx_serve_request_time_per_output_token_seconds_count") == 2
    assert grew("mlx_serve_steps_total") >= 9
    assert value(after, "mlx_serve_num_requests_running") == 0


def test_a_whole_reply_whose_client_left_counts_the_tokens_made_for_it(server):
    before = scrape(server)
    steps = health(server)["steps"]
    body = json.dumps({"model": MODEL, "prompt": "count", "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Leave once the batch has made at least 20 of its tokens. A decode step makes
        # one; two steps of margin, since a step counted may have made none of them
        # (one begun before this request joined, or its prompt's prefill): 19 was seen.
        wait_health(server, lambda h: h["steps"] >= steps + 22)
    after = wait_for_metric(server, "mlx_serve_request_aborted_total",
                            value(before, "mlx_serve_request_aborted_total") + 1)
    made = (value(after, "mlx_serve_generation_tokens_total")
            - value(before, "mlx_serve_generation_tokens_total"))
    assert made >= 20  # before: only those its handle had handed over (one)


def test_the_endpoint_is_get_only(server):
    response = httpx.post(server.base_url + "/metrics", timeout=TIMEOUT)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert value(scrape(server), "mlx_serve_request_errors_total", status="405") >= 1


@pytest.mark.parametrize("path", ["/health", "/live", "/v1/models"])
def test_probes_and_model_listing_count_as_no_request(server, path):
    before = scrape(server)
    assert httpx.get(server.base_url + path, timeout=TIMEOUT).status_code == 200
    after = scrape(server)
    for name in ("mlx_serve_e2e_request_latency_seconds_count",
                 "mlx_serve_request_aborted_total"):
        assert value(after, name) == value(before, name)


def test_openmetrics_on_request(server):
    response = httpx.get(server.base_url + "/metrics", timeout=TIMEOUT, headers={
        "Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert 'mlx_serve_engine_state{state="ready"} 1.0' in response.text


def test_requests_that_fail_count_their_time_and_tokens_as_every_other_ending(
        tiny_model_dir: Path, tmp_path: Path):
    # Admission fails for user "bad"; the steps of user "late" fail after a few have run
    # (the batch is rebuilt without that request, which fails alone).
    spec = ("engine.admit[user=bad]=raise(ValueError:cannot admit);"
            "engine.step[user=late]=4*off->raise(RuntimeError:step fault)")
    with ServerProcess(tiny_model_dir, tmp_path / "server.log",
                       env={"MLX_SERVE_FAILPOINTS": spec}) as server:
        before = scrape(server)
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as http:
            common = {"model": MODEL, "prompt": "count", "max_tokens": 50,
                      "logit_bias": NO_EOS}
            for user, stream in (("bad", False), ("bad", True), ("late", False)):
                failed = http.post("/v1/completions", json={**common, "user": user,
                                                            "stream": stream})
                assert failed.status_code >= 400, (user, stream, failed.text)
        after = scrape(server)

        def grew(name: str) -> float:
            return value(after, name) - value(before, name)

        # Before, a failure that became the HTTP response was counted as an error only.
        assert grew("mlx_serve_e2e_request_latency_seconds_count") == 3
        errors = sum(v - value(before, n, **dict(labels)) for (n, labels), v in after.items()
                     if n == "mlx_serve_request_errors_total")
        assert errors == 3
        prompt = len(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
                     .encode("count").ids)
        assert grew("mlx_serve_prompt_tokens_total") == 3 * prompt
        # The late one's tokens, made in the steps before its own failed (4 ran).
        assert grew("mlx_serve_generation_tokens_total") >= 3
