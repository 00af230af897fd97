"""A real server that prepares one arriving request per event-loop pass
(``--intake-per-pass 1``): a burst of mixed requests all get their whole answers, the
same as each alone, and clients that hang up in such a burst cost nobody else theirs.
Every wait is bounded by a client timeout or a bounded poll."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http_helpers import MODEL, TIMEOUT, async_client, sdk_client
from tests.server_process import ServerProcess

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("http_intake") / "server.log"
    with ServerProcess(tiny_model_dir, log, args=["--intake-per-pass", "1"]) as proc:
        yield proc


PROMPTS = [f"Item {i}: tell me a story about the number {i}." for i in range(12)]


async def test_a_burst_prepared_one_request_a_pass_gets_every_answer(server):
    with sdk_client(server) as client:
        solo_chat = [client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=12,
            temperature=0).choices[0].message.content for p in PROMPTS]
        solo_text = [client.completions.create(
            model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]
        solo_response = client.responses.create(
            model=MODEL, input=PROMPTS[0], max_output_tokens=12, temperature=0).output_text

    async def chat_stream(aclient, prompt: str) -> str:
        chunks = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks
                        if c.choices])

    async def completion(aclient, prompt: str) -> str:
        reply = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                 temperature=0)
        return reply.choices[0].text

    async def response(aclient, prompt: str) -> str:
        reply = await aclient.responses.create(model=MODEL, input=prompt,
                                               max_output_tokens=12, temperature=0)
        return reply.output_text

    async with async_client(server) as aclient:
        chats, texts, responses = await asyncio.wait_for(asyncio.gather(
            asyncio.gather(*(chat_stream(aclient, p) for p in PROMPTS)),
            asyncio.gather(*(completion(aclient, p) for p in PROMPTS)),
            asyncio.gather(*(response(aclient, PROMPTS[0]) for _ in range(4)))), TIMEOUT)
    assert chats == solo_chat
    assert texts == solo_text
    assert responses == [solo_response] * 4


async def test_clients_that_hang_up_in_a_paced_burst_cost_the_others_nothing(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    with sdk_client(server) as client:
        expected = client.completions.create(**body).choices[0].text

    async def leaver(c: httpx.AsyncClient) -> None:
        # Sent among the others and dropped at once, its request perhaps still waiting
        # for its turn (a cancelled waiter itself: test_intake_turns.py).
        with pytest.raises(httpx.TimeoutException):
            await c.post("/v1/completions", json={**body, "max_tokens": 200},
                         timeout=httpx.Timeout(TIMEOUT, read=0.001))

    async def stayer(c: httpx.AsyncClient) -> str:
        reply = await c.post("/v1/completions", json=body)
        assert reply.status_code == 200
        return reply.json()["choices"][0]["text"]

    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as c:
        jobs = [leaver(c) if i % 3 == 0 else stayer(c) for i in range(24)]
        results = await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)
    assert [r for r in results if r is not None] == [expected] * 16
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as c:
        # Nothing is left behind: the engine empties and the server still answers.
        for _ in range(200):
            state = (await c.get("/health")).json()
            if state["running"] == 0 and state["waiting"] == 0:
                break
            await asyncio.sleep(0.05)  # a bounded poll of the server's own count
        assert state["running"] == 0 and state["waiting"] == 0
        assert await stayer(c) == expected
