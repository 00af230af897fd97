"""Chaos: a seeded mix of every kind of request, with faults at random at every fail-point
site and clients that hang up mid-stream. Whatever happens, every request ends with
exactly one terminal event in valid JSON, the server ends idle and ready, it still
answers exactly, and its log holds no unexpected error: with the engine in the server's
process (streaming every token, and four at a time) and in a child of its own.

The faults: 2 % of batch steps raise (replayed), 0.5 % fail after their tokens are in
(replayed too), 2 % of admissions raise (that request fails alone) and 0.5 % of SSE
writes raise (that stream ends with an error event).
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faults.harness import (
    COMPLETIONS,
    PROMPTS,
    Reply,
    assert_serves,
    call,
    http_client,
)
from tests.faults.server_watch import assert_log_clean, clear_failpoint, health, wait_until
from tests.http_helpers import read_then_leave, strict_json

pytestmark = pytest.mark.anyio

SITES = ("engine.step", "engine.detokenize", "engine.admit", "sse.send")
FAULTS = ";".join([
    "engine.step=2%raise(RuntimeError:chaos step)",
    "engine.detokenize=0.5%raise(ValueError:chaos text)",
    "engine.admit=2%raise(RuntimeError:chaos admit)",
    "sse.send=0.5%raise(ConnectionResetError:chaos send)",
])
RESPONSES = "/v1/responses"
WORKERS = 12
REQUESTS_PER_WORKER = 40
LEAVE_SHARE = 0.1  # streams whose client hangs up after a few events


def random_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A valid request of any kind this server serves: chat, completion or Responses, with
    the sampling, stop, logprob, choice and usage options mixed at random."""
    if rng.random() < 0.15:
        return RESPONSES, random_responses_body(rng)
    chat = rng.random() < 0.6
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 32),
                            "temperature": rng.choice([0, 0.7, 1.0]),
                            "n": rng.choice([1, 1, 1, 2, 3])}
    options = {"stop": [rng.choice(["a", "e", " the"])], "repetition_penalty": 1.2,
               "frequency_penalty": 0.5, "seed": rng.randint(0, 99), "top_k": 5,
               "min_p": 0.05, "user": rng.choice(["alice", "bob"])}
    for name, value in options.items():
        if rng.random() < 0.2:
            body[name] = value
    lengths = {"min_tokens": rng.randint(1, body["max_tokens"]), "ignore_eos": True}
    for name, value in lengths.items():  # vLLM's; not with a response format
        if rng.random() < 0.1:
            body[name] = value
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.15:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 4))
        if rng.random() < 0.1 and not body.keys() & lengths.keys():
            body["response_format"] = {"type": "json_object"}
        return "/v1/chat/completions", body
    body["prompt"] = rng.choice(PROMPTS)
    if rng.random() < 0.15:
        body["logprobs"] = rng.randint(0, 4)
    if rng.random() < 0.15:
        body["echo"] = True
        if rng.random() < 0.5:  # the prompt's own tokens are scored too
            body["logprobs"] = rng.randint(0, 4)
        if rng.random() < 0.3 and "min_tokens" not in body:  # the prompt alone
            body["max_tokens"] = 0
    if rng.random() < 0.1 and not body.keys() & lengths.keys():
        body["response_format"] = {"type": "json_object"}
    return COMPLETIONS, body


def random_responses_body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"input": rng.choice(PROMPTS),
                            "max_output_tokens": rng.randint(1, 32),
                            "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["instructions"] = "Be brief."
    if rng.random() < 0.2:
        body["user"] = rng.choice(["alice", "bob"])
    if rng.random() < 0.1:
        body["text"] = {"format": {"type": "json_object"}}
    return body


async def responses_call(client: httpx.AsyncClient, body: dict[str, Any], stream: bool
                         ) -> Reply:
    """A Responses request, recorded as a chat reply would be: its completed or incomplete
    response as a finish, a failed response (a server-side failure) as an error."""
    reply = Reply({**body, "n": 1}, stream=stream)

    def record(response: dict[str, Any]) -> None:
        if response["status"] == "failed":
            reply.errors.append({"type": "server_error", **response["error"]})
        else:
            reply.finishes.append("length" if response["status"] == "incomplete" else "stop")
            reply.response_id = response["id"]

    try:
        async with client.stream("POST", RESPONSES, json={**body, "stream": stream}) as resp:
            reply.status = resp.status_code
            if resp.status_code != 200 or not stream:
                payload = strict_json((await resp.aread()).decode())
                if resp.status_code != 200:
                    reply.errors.append(payload["error"])
                else:
                    record(payload)
                return reply
            async for line in resp.aiter_lines():
                event = strict_json(line[len("data:"):]) if line.startswith("data:") else {}
                if event.get("type") in ("response.completed", "response.incomplete",
                                         "response.failed"):
                    record(event["response"])
            reply.done = 1  # a Responses stream ends without [DONE]: its end counts
    except httpx.HTTPError as exc:
        reply.transport_error = f"{type(exc).__name__}: {exc}"
    return reply


def check_ending(reply: Reply) -> None:
    """A finish for every choice, or one error (of the injected kind) that ends the
    request, after the finishes of any choices done before it."""
    info = reply.describe()
    assert reply.transport_error is None, info
    if reply.stream and reply.status == 200:
        assert reply.done == 1 and not reply.after_done, f"[DONE] not last and single: {info}"
    assert set(reply.finishes) <= {"stop", "length"}, info
    if reply.body.get("echo") and reply.body.get("logprobs") is not None:
        # Every choice that ended came with its prompt's scores, replayed or not.
        assert reply.scored_echoes >= len(reply.finishes), f"scores lost: {info}"
    if not reply.errors:
        assert reply.status == 200, info
        assert len(reply.finishes) == reply.body.get("n", 1), f"a choice never ended: {info}"
        return
    assert len(reply.errors) == 1 and reply.errors[0]["type"] == "server_error", info
    assert len(reply.finishes) < reply.body.get("n", 1), info
    if reply.status != 200:
        assert not reply.finishes, info


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [[], ["--stream-interval", "4"], ["--engine-process"]],
                         ids=["one-process", "stream-interval-4", "engine-process"])
async def test_every_request_ends_once_whatever_fails(launch, reference, model_name, mode):
    server = launch("--max-n", "4", "--failpoints-http", *mode, failpoints=FAULTS)
    replies: list[Reply] = []
    left = 0

    async def worker(seed: int) -> None:
        nonlocal left
        rng = random.Random(seed)
        last_response: str | None = None  # the worker's conversation, continued by id
        async with http_client(server) as client:
            for _ in range(REQUESTS_PER_WORKER):
                path, body = random_body(rng)
                if path == RESPONSES and last_response and rng.random() < 0.4:
                    body["previous_response_id"] = last_response
                stream = rng.random() < 0.7
                if stream and rng.random() < LEAVE_SHARE:
                    await read_then_leave(client, path, {**body, "stream": True},
                                          lines=rng.randint(1, 4), require_ok=False)
                    left += 1
                elif path == RESPONSES:
                    replies.append(await responses_call(client, body, stream))
                    last_response = replies[-1].response_id or last_response
                else:
                    replies.append(await call(client, body, stream, path)())

    scrapes: list[int] = []

    async def scrape_metrics(done: anyio.Event) -> None:
        async with http_client(server) as client:
            while not done.is_set():
                scrapes.append((await client.get("/metrics")).status_code)

    with anyio.fail_after(240):
        async with anyio.create_task_group() as outer:
            done = anyio.Event()
            outer.start_soon(scrape_metrics, done)
            async with anyio.create_task_group() as tg:
                for seed in range(WORKERS):
                    tg.start_soon(worker, seed)
            done.set()
    for reply in replies:
        check_ending(reply)
    failed = sum(bool(r.errors) for r in replies)
    assert left and failed and len(replies) - failed > len(replies) // 2  # the mix was real
    assert any("previous_response_id" in r.body for r in replies)  # conversations went on
    assert scrapes and set(scrapes) == {200}

    async with http_client(server) as client:
        seen: list[dict[str, Any]] = []

        async def settled() -> dict[str, Any] | None:
            _, body = await health(client)
            seen[:] = [body]
            idle = body["running"] == 0 and body["waiting"] == 0
            return body if idle and body["state"] == "ready" else None

        with anyio.fail_after(35):
            try:
                body = await wait_until(settled, 30, "the server to end idle and ready")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; /health said {seen}") from None
        assert body["recoveries"] > 0  # steps did fail, and were recovered from
        counted = metric_totals((await client.get("/metrics")).text)
        for site in SITES:
            await clear_failpoint(client, site)
    # Every ending the clients saw was counted (streams left early may add their own).
    assert counted["mlx_serve_request_success_total"] >= sum(len(r.finishes) for r in replies)
    assert counted["mlx_serve_request_errors_total"] >= failed
    assert counted["mlx_serve_request_aborted_total"] <= left
    await assert_serves(server, reference, model_name)
    assert_log_clean(server, allowed=("chaos",))


def metric_totals(text: str) -> dict[str, float]:
    """Each sample name's sum over its labels."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
