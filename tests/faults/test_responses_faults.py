"""A Responses API stream whose request turns out to make steps fail: after its first
text it ends with ``response.failed`` carrying the error, while a healthy stream beside
it completes."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.faults.harness import PROMPTS, http_client
from tests.faults.server_watch import assert_log_clean, clear_failpoint, wait_until
from tests.http_helpers import strict_json

pytestmark = pytest.mark.anyio

POISON = "engine.step[user=poison]=4*off->raise(ValueError:poisoned)"


async def stream_events(client, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                events.append(strict_json(line[len("data:"):]))
    return events


async def test_a_failing_request_ends_its_stream_with_response_failed(launch):
    server = launch(failpoints=POISON)
    bodies = [{"input": PROMPTS[i], "max_output_tokens": 32, "temperature": 0}
              for i in range(2)]
    bodies[0]["user"] = "poison"
    results: list[list[dict[str, Any]]] = [[], []]

    async def one(i: int) -> None:
        async with http_client(server) as client:
            results[i] = await stream_events(client, bodies[i])

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
    poisoned, healthy = results
    kinds = [e["type"] for e in poisoned]
    assert kinds[-1] == "response.failed", kinds
    assert "response.output_text.delta" in kinds  # it failed after its first text
    failed = poisoned[-1]["response"]
    assert failed["status"] == "failed"
    # A code of the SDK's list for a Response's error; what failed is in the message.
    assert failed["error"]["code"] == "server_error", failed["error"]
    assert "generation failed" in failed["error"]["message"], failed["error"]
    from openai.types.responses import ResponseFailedEvent

    ResponseFailedEvent.model_validate(poisoned[-1])  # strict: the code is one it knows
    # It says it is stored, and it is, as it failed (before: 404).
    assert failed["store"] is True
    async with http_client(server) as client:
        stored = await client.get(f"/v1/responses/{failed['id']}")
    assert stored.status_code == 200 and stored.json() == failed
    assert healthy[-1]["type"] == "response.incomplete"
    assert healthy[-1]["response"]["usage"]["output_tokens"] == 32
    assert_log_clean(server, allowed=["poisoned"])


async def test_a_stream_whose_client_left_is_kept_cancelled_with_what_it_made(launch):
    """Its id came in the first event: it is found at once, in progress, and once its
    client has left, as ``cancelled`` with the output made until then."""
    server = launch("--failpoints-http", failpoints="engine.step=6*off->hang")  # stands still
    body = {"input": PROMPTS[0], "max_output_tokens": 64, "temperature": 0, "stream": True}
    events: list[dict[str, Any]] = []
    with anyio.fail_after(60):
        async with http_client(server) as client:
            async with client.stream("POST", "/v1/responses", json=body) as reply:
                lines = reply.aiter_lines()  # kept open: leaving its loop closes the reply
                while not events or events[-1]["type"] != "response.output_text.delta":
                    if (line := await anext(lines)).startswith("data:"):
                        events.append(strict_json(line[len("data:"):]))
                created = events[0]["response"]
                kept = await client.get(f"/v1/responses/{created['id']}")
                assert kept.status_code == 200 and kept.json() == created
                assert created["status"] == "in_progress"
                follow_up = await client.post("/v1/responses", json={
                    "input": "and then?", "previous_response_id": created["id"]})
                assert follow_up.status_code == 400, follow_up.text
                assert "in progress" in follow_up.json()["error"]["message"]
            # The stream's connection is closed: its client has left.
            await clear_failpoint(client, "engine.step")  # the step ends; so does the reply

            async def ended() -> dict[str, Any] | None:
                found = (await client.get(f"/v1/responses/{created['id']}")).json()
                return found if found["status"] != "in_progress" else None

            final = await wait_until(ended, 30, "the cut-off response kept")
    from openai.types.responses import Response

    Response.model_validate(final)  # strict: a status the SDK knows
    assert final["status"] == "cancelled" and final["completed_at"] is None
    (message,) = final["output"]
    assert message["status"] == "incomplete"
    received = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert message["content"][0]["text"].startswith(received) and received
    assert 0 < final["usage"]["output_tokens"] < 64
    assert_log_clean(server)
