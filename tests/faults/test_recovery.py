"""Faults the server must absorb: failed steps (replay), a poison request (isolation), a
request that cannot be admitted. Every other request completes with exactly the
fault-free output and the server stays ready.

Each test holds the first step behind the ``GATE`` fail point until all its requests are
in the engine, then swaps in the fault over the debug HTTP endpoint, so the fault hits
a full batch every time.
"""

from __future__ import annotations

import anyio
import pytest

from tests.faults.harness import (
    GATE,
    MALLOC,
    assert_exact,
    assert_one_terminal,
    assert_serves,
    call,
    chat_body,
    gather,
    http_client,
    sdk_call,
    sdk_client,
)
from tests.faults.server_watch import (
    assert_log_clean,
    health,
    polling,
    set_failpoint,
    wait_for_requests,
)
from tests.http_helpers import wait_health

pytestmark = pytest.mark.anyio

SCENARIO_S = 60  # bound on one scenario's client work (pytest-timeout is the outer bound)


def release_gate(client, count: int, *rules: tuple[str, str]):
    """A task: once ``count`` requests are in the engine, install ``rules`` in order.

    The last rule should replace ``engine.step`` (which releases the gate's hang).
    """
    async def task() -> None:
        await wait_for_requests(client, count)
        for site, action in rules:
            await set_failpoint(client, site, action)

    return task


@pytest.mark.parametrize(
    ("fault", "failures"),
    [
        pytest.param("20*off->1*raise(RuntimeError:boom)", 1, id="one-raise"),
        pytest.param(f"10*off->3*raise(RuntimeError:{MALLOC})", 3, id="malloc-3-in-a-row"),
    ],
)
async def test_failed_steps_are_replayed_and_every_request_completes_exactly(
        launch, reference, model_name, fault, failures):
    """Scenarios 1 and 2: 8 streaming + 8 non-streaming requests at temperature 0 go
    through failing steps; all 16 finish with the fault-free output, /health never
    leaves 200."""
    bodies = [chat_body(i, max_tokens=48) for i in range(16)]
    # vLLM's length controls in two of the streams, with the end-of-sequence token made
    # likely: how many tokens count as generated must survive the replay.
    bodies[1] = chat_body(1, max_tokens=48, min_tokens=40, logit_bias={"2": 8})
    bodies[3] = chat_body(3, max_tokens=48, ignore_eos=True, logit_bias={"2": 8})
    expected = await reference.outcomes(bodies)
    assert expected[1][1] == "stop" and expected[3][1] == "length"
    server = launch("--failpoints-http", failpoints=GATE)
    with anyio.fail_after(SCENARIO_S):
        async with http_client(server) as client, sdk_client(server) as sdk:
            async with polling(server, "/health") as probe:
                # Even: non-streaming through the openai SDK; odd: SSE streams via httpx.
                calls = [call(client, b, True) if i % 2 else sdk_call(sdk, model_name, b)
                         for i, b in enumerate(bodies)]
                replies = await gather(*calls, alongside=[
                    release_gate(client, 16, ("engine.step", fault))])
            status, stats = await health(client)

    assert_exact(replies, expected)
    assert len(probe.samples) >= 3 and probe.statuses() == {200}, \
        f"/health left 200 during recovery: {[(s.status, s.body) for s in probe.samples]}"
    assert status == 200 and stats["state"] == "ready", stats
    assert 1 <= stats["recoveries"] <= failures, stats
    assert stats["replays"] >= 16 and stats["isolated"] == 0, stats
    await assert_serves(server, reference, model_name)
    assert_log_clean(server, allowed=["boom", MALLOC])


POISON = ("engine.step[user=poison]", "4*off->raise(ValueError:poisoned)")


async def test_poison_request_is_isolated_and_the_rest_complete_exactly(
        launch, reference, model_name):
    """Scenario 3: one request makes every step it is part of fail. Only it fails, the 7
    healthy requests complete exactly, ``isolated`` counts it. Round 1: the poisoned
    request streams (an error event, then [DONE]); round 2: it does not (500 with an
    OpenAI error object), on the same server.

    The poison lets the request's first steps pass, so that it has streamed some text
    when it turns bad: a stream that fails before its first token is answered with a
    plain HTTP error instead (``streaming.fail_fast``).
    """
    server = launch("--failpoints-http", failpoints=GATE)
    for round_, poison_streams in enumerate((True, False)):
        bodies = [chat_body(8 * round_ + i, max_tokens=32) for i in range(8)]
        expected = await reference.outcomes(bodies)
        bodies[3] = {**bodies[3], "user": "poison"}
        with anyio.fail_after(SCENARIO_S):
            async with http_client(server) as client, sdk_client(server) as sdk:
                if round_:
                    await set_failpoint(client, "engine.step", "hang")  # close the gate again
                async with polling(server, "/health") as probe:
                    calls = [call(client, b, stream=i % 2 == 1) for i, b in enumerate(bodies)]
                    calls[3] = (call(client, bodies[3], stream=True) if poison_streams
                                else sdk_call(sdk, model_name, bodies[3]))
                    replies = await gather(*calls, alongside=[
                        release_gate(client, 8, POISON, ("engine.step", "off"))])
                status, stats = await health(client)

        poisoned = replies.pop(3)
        del expected[3]
        assert_exact(replies, expected)
        assert_one_terminal(poisoned)
        assert poisoned.error is not None, poisoned.describe()
        assert poisoned.error["type"] == "server_error", poisoned.describe()
        if poison_streams:
            assert poisoned.status == 200 and poisoned.done == 1, poisoned.describe()
            assert poisoned.text, f"the error came before any text: {poisoned.describe()}"
        else:
            assert poisoned.status == 500, poisoned.describe()
        assert probe.statuses() == {200}, [(s.status, s.body) for s in probe.samples]
        assert status == 200 and stats["state"] == "ready", stats
        assert stats["isolated"] == round_ + 1, stats
    await assert_serves(server, reference, model_name)
    assert_log_clean(server, allowed=["poisoned"])


async def test_poison_requests_one_after_another_fail_alone(launch, reference, model_name):
    """A client sends poison requests one after another while long healthy ones run.
    Each poison's failed steps and probes take the healthy requests along; before, that
    added up until the third poison failed every healthy request with it (a 500 that
    said not to retry). Only the poisons fail; the rest complete exactly."""
    server = launch(failpoints="engine.step[user=poison]=raise(ValueError:poisoned)")
    bodies = [chat_body(i, max_tokens=1000, ignore_eos=True) for i in range(6)]
    expected = await reference.outcomes(bodies)
    poisons, running_after = [], None

    async def poison_after_poison() -> None:
        nonlocal running_after
        await wait_for_requests(client, len(bodies))
        for k in range(4):
            poisons.append(await call(client, {**chat_body(k), "user": "poison"}, False)())
        running_after = (await health(client))[1]["running"]

    with anyio.fail_after(SCENARIO_S):
        async with http_client(server) as client:
            replies = await gather(*[call(client, b, stream=i % 2 == 0)
                                     for i, b in enumerate(bodies)],
                                   alongside=[poison_after_poison])
            status, stats = await health(client)
    assert running_after == len(bodies)  # the poisons all met the healthy requests
    assert [p.status for p in poisons] == [500] * 4, [p.describe() for p in poisons]
    assert_exact(replies, expected)
    assert status == 200 and stats["state"] == "ready" and stats["isolated"] == 4, stats
    assert_log_clean(server, allowed=["poisoned"])


async def test_a_request_that_cannot_be_admitted_fails_alone(launch, reference, model_name):
    """Scenario 6: admission raises for one request (non-streaming in the first round,
    streaming in the second): it gets an error response, the others complete exactly,
    the batch is never rebuilt."""
    # The admission fault is there from the start: the gated first step admits requests.
    server = launch("--failpoints-http",
                    failpoints=f"{GATE};engine.admit[user=bad]=raise(ValueError:cannot admit)")
    for round_, bad_streams in enumerate((False, True)):
        bodies = [chat_body(8 * round_ + i, max_tokens=24) for i in range(6)]
        expected = await reference.outcomes(bodies)
        bodies[2] = {**bodies[2], "user": "bad"}
        with anyio.fail_after(SCENARIO_S):
            async with http_client(server) as client:
                if round_:
                    await set_failpoint(client, "engine.step", "hang")  # close the gate again
                calls = [call(client, b, stream=(i % 2 == 1) if i != 2 else bad_streams)
                         for i, b in enumerate(bodies)]
                # Five: the bad request may be refused by a step of its own, which
                # returns before the gate when nothing else is in the batch.
                replies = await gather(*calls, alongside=[
                    release_gate(client, 5, ("engine.step", "off"))])
                status, stats = await health(client)
        bad = replies.pop(2)
        del expected[2]
        assert_exact(replies, expected)
        assert_one_terminal(bad)
        assert bad.error is not None, bad.describe()
        # A stream that fails before its first token may be answered with a plain HTTP
        # error (``streaming.fail_fast``) or with an error event: both are one terminal.
        assert bad.status == 200 if bad.stream and bad.done else bad.status >= 400, \
            bad.describe()
        assert status == 200 and stats["state"] == "ready", stats
        assert stats["recoveries"] == 0 and stats["isolated"] == 0, stats
    await assert_serves(server, reference, model_name)
    assert_log_clean(server, allowed=["cannot admit"])


async def test_an_isolated_request_is_not_resent_by_the_openai_sdk(launch, model_name):
    """The SDK resends a 5xx (twice by default) unless told not to; a request the server
    isolated would fail the same way, and a run of such failures with no good step
    between makes the engine give up on itself. Its 500 says ``x-should-retry: false``."""
    import openai

    server = launch(failpoints="engine.step[user=poison]=raise(ValueError:poisoned)")
    sdk = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=30)
    with anyio.fail_after(SCENARIO_S):
        with pytest.raises(openai.InternalServerError) as failed:
            await sdk.chat.completions.create(  # the SDK's default retries
                model=model_name, max_tokens=5, user="poison",
                messages=[{"role": "user", "content": "hi"}])
    await sdk.close()
    assert failed.value.response.headers["x-should-retry"] == "false"
    # The request is answered before the actor ends its recovery: wait for that (bounded).
    stats = await anyio.to_thread.run_sync(
        wait_health, server, lambda h: h["state"] != "recovering")
    # Before, the SDK sent it three times: three isolations in a row.
    assert stats["isolated"] == 1 and stats["state"] == "ready", stats


async def test_a_request_worn_out_with_no_culprit_is_resent_by_the_openai_sdk(
        launch, model_name):
    """Every other step fails, eight times over, and every replay passes: no request is
    found the cause, and the request ends after its eighth failed step. Its 500 says
    ``x-should-retry: true``; the SDK's resend, after the faults, completes."""
    import openai

    flaky = "->".join(["1*raise(RuntimeError:flaky)", "1*off"] * 8)
    server = launch(failpoints=f"engine.step={flaky}")
    sdk = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=30)
    with anyio.fail_after(SCENARIO_S):
        raw = await sdk.chat.completions.with_raw_response.create(  # default retries
            model=model_name, max_tokens=40, temperature=0, messages=[
                {"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True})  # no end token cuts either attempt short
    await sdk.close()
    assert raw.retries_taken == 1, raw.retries_taken
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 40
    stats = await anyio.to_thread.run_sync(
        wait_health, server, lambda h: h["state"] != "recovering")
    assert stats["worn_out"] == 1 and stats["isolated"] == 0, stats
    assert stats["recoveries"] == 8, stats
    assert stats["state"] == "ready", stats
    async with http_client(server) as client:
        scraped = (await client.get("/metrics")).text.splitlines()
    assert "mlx_serve_worn_out_requests_total 1.0" in scraped
    assert "mlx_serve_isolated_requests_total 0.0" in scraped
