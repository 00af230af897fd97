"""Black-box tests of a real server under concurrent streams: exact counts, /health and
/live answering fast, and clients that leave mid-reply. Every wait is bounded by a client
timeout or a bounded poll of ``/health``; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from tests.http_helpers import (
    HI,
    MODEL,
    NO_EOS,
    TIMEOUT,
    async_client,
    client_fixture,
    health,
    read_then_leave,
    server_fixture,
    wait_health,
)

server = server_fixture("http_load")
client = client_fixture()

PROMPTS = [f"Question {i}: why is the sky blue? Answer:" for i in range(16)]


@pytest.mark.anyio
async def test_sixteen_concurrent_streams_finish_with_exact_counts(server, client):
    solo = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0)
        for p in PROMPTS]

    async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, Any]:
        parts, finish, usage = [], None, None
        chunks = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), finish, usage

    async with async_client(server) as aclient:
        results = await asyncio.wait_for(
            asyncio.gather(*(stream(aclient, p) for p in PROMPTS)), TIMEOUT)
    for (text, finish, usage), expected in zip(results, solo, strict=True):
        assert finish == expected.choices[0].finish_reason
        assert usage.completion_tokens == expected.usage.completion_tokens
        assert usage.prompt_tokens == expected.usage.prompt_tokens
        if finish == "length":
            assert usage.completion_tokens == 24
        # Batched greedy output equals the solo output.
        assert text == expected.choices[0].message.content
    assert wait_health(server, lambda h: h["running"] == 0)["running"] == 0


@pytest.mark.anyio
async def test_health_and_live_answer_fast_under_sixteen_streams(server):
    async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> int:
        chunks = await aclient.chat.completions.create(
            # Long enough that the probes below finish while every stream still runs.
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1000,
            temperature=0, stream=True, logit_bias=NO_EOS,
            stream_options={"include_usage": True})
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        return usage.completion_tokens

    latencies: list[float] = []
    async with async_client(server) as aclient, httpx.AsyncClient(
            base_url=server.base_url, timeout=5) as probe:
        tasks = [asyncio.ensure_future(stream(aclient, p)) for p in PROMPTS]
        try:
            deadline = time.monotonic() + 20
            while (await probe.get("/health")).json()["running"] < 16:
                assert time.monotonic() < deadline, "the 16 streams never all ran"
                assert not any(t.done() for t in tasks), "a stream ended early"
                await asyncio.sleep(0.01)  # a bounded poll, not a synchronisation
            for _ in range(5):
                for path in ("/health", "/live"):
                    started = time.monotonic()
                    response = await probe.get(path)
                    latencies.append(time.monotonic() - started)
                    assert response.status_code == 200
                    assert response.json()["status"] == "ok"
            under_load = (await probe.get("/health")).json()
            counts = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
        finally:
            for t in tasks:
                t.cancel()
    assert under_load["running"] > 0, "measured after the load was gone"
    assert max(latencies) < 1.0, latencies
    assert counts == [1000] * 16


@pytest.mark.anyio
async def test_client_disconnecting_mid_stream_leaves_the_others_running(server):
    before = health(server)["steps"]
    first_chunk = [asyncio.Event() for _ in range(3)]

    async def other(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        finish, usage = None, None
        chunks = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=300,
            temperature=0, stream=True, logit_bias=NO_EOS,
            stream_options={"include_usage": True})
        async for chunk in chunks:
            first_chunk[i].set()
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        return finish, usage.completion_tokens

    async with async_client(server) as aclient:
        others = [asyncio.ensure_future(other(aclient, i)) for i in range(3)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), TIMEOUT)
            # The leaver: a long request (it would run ~2000 steps), read a little, hang up.
            body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "temperature": 0,
                    "stream": True, "logit_bias": NO_EOS}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as c:
                await read_then_leave(c, "/v1/chat/completions", body)
            # 300 tokens each vs. the leaver's 5 chunks: the others are mid-stream here.
            assert not all(t.done() for t in others), "the others ended before the leaver"
            results = await asyncio.wait_for(asyncio.gather(*others), TIMEOUT)
        finally:
            for t in others:
                t.cancel()
    assert results == [("length", 300)] * 3
    after = wait_health(server, lambda h: h["running"] == 0 and h["waiting"] == 0)
    # ~300 steps for the others; the leaver alone would have needed ~2000.
    assert after["steps"] - before < 1000, after
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                       json={"messages": HI, "max_tokens": 4, "logit_bias": NO_EOS})
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_non_streaming_client_that_disconnects_is_removed_from_the_batch(server):
    before = health(server)["steps"]
    # prompt 17 + 2000 fits the 2048 context; the full request would take ~2000 steps
    # (several seconds). The client gives up after 0.5 s without a byte of reply.
    body = {"model": MODEL, "messages": HI, "max_tokens": 2000, "temperature": 0,
            "logit_bias": NO_EOS}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    started = time.monotonic()
    after = wait_health(server, lambda h: h["running"] == 0 and h["waiting"] == 0,
                        timeout=5)
    assert time.monotonic() - started < 5
    assert after["steps"] - before < 1000, f"the request ran on after the client left: {after}"
    reply = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": "hi", "max_tokens": 3, "logit_bias": NO_EOS})
    assert reply.json()["usage"]["completion_tokens"] == 3




def test_no_traceback_in_the_server_log(server):
    # Runs last in this module: no load or disconnect above may have logged an error.
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_text()
