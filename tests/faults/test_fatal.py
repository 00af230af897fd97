"""Faults the server cannot absorb: it must say so, answer everyone, and never go zombie.

Scenario 4: every step fails, and the engine's self-test too -> ``failed`` within K
rebuilds (and, with ``--exit-on-fatal``, the process exits non-zero). Scenario 5: a step
outlives the step deadline -> ``wedged``, then ready again once the step returns.
"""

from __future__ import annotations

import statistics
import time

import anyio
import pytest

from tests.faults.harness import (
    GATE,
    Reply,
    assert_all_terminal,
    assert_one_terminal,
    assert_serves,
    call,
    chat_body,
    complete_chat,
    gather,
    http_client,
    stream_chat,
)
from tests.faults.server_watch import (
    assert_log_clean,
    health,
    polling,
    set_failpoint,
    wait_for_requests,
    wait_for_state,
    wait_until,
)

pytestmark = pytest.mark.anyio

K = 3  # --max-failed-rebuilds
DEAD = "raise(OSError:dead)"


def in_flight(client, count: int = 8, max_tokens: int = 48):
    """``count`` requests, alternately non-streaming and streaming."""
    return [call(client, chat_body(i, max_tokens=max_tokens), stream=i % 2 == 1)
            for i in range(count)]


async def every_step_failing_midflight(client) -> list[Reply]:
    """Eight requests in flight, then every step fails, and so does the engine's
    self-test (a broken engine: a device lost, say); their replies."""
    async def arm() -> None:
        await wait_for_requests(client, 8)
        await set_failpoint(client, "engine.self_test", DEAD)
        await set_failpoint(client, "engine.step", DEAD)

    return await gather(*in_flight(client), alongside=[arm])


def assert_all_failed(replies: list[Reply], codes: set[str]) -> None:
    assert_all_terminal(replies)
    for reply in replies:
        assert reply.error is not None, f"expected a terminal error: {reply.describe()}"
        assert reply.error.get("code") in codes, reply.describe()
        if reply.stream and reply.status == 200:
            assert reply.done == 1, reply.describe()
        else:
            assert reply.status is not None and reply.status >= 500, reply.describe()


async def refused_quickly(client, times: int = 6) -> list[float]:
    """Send new requests (both kinds) to a dead or wedged server: each must be a 503.

    Returns their latencies."""
    latencies = []
    for i in range(times):
        body = chat_body(20 + i, max_tokens=4)
        reply = await (stream_chat(client, body) if i % 2 else complete_chat(client, body))
        assert_one_terminal(reply)
        assert reply.status == 503 and reply.error is not None, reply.describe()
        latencies.append(reply.elapsed)
    return latencies


async def test_every_step_failing_ends_in_failed_and_answers_everyone(launch):
    """Scenario 4: all in-flight requests get a terminal error, /health and /live say 503,
    new requests are refused with 503 in under 100 ms, within K rebuilds."""
    server = launch("--failpoints-http", "--max-failed-rebuilds", str(K), failpoints=GATE)
    with anyio.fail_after(30):
        async with http_client(server) as client:
            replies = await every_step_failing_midflight(client)
            stats = await wait_for_state(client, "failed", timeout=10)
            health_status, _ = await health(client)
            live_status, live = await health(client, "/live")
            latencies = await refused_quickly(client)
            metrics = (await client.get("/metrics")).text

    assert 'mlx_serve_engine_state{state="failed"} 1.0' in metrics
    assert 'mlx_serve_request_errors_total{status="503"}' in metrics
    assert_all_failed(replies, {"engine_dead"})
    assert 1 < stats["recoveries"] <= K + 1, f"not failed within {K} rebuilds: {stats}"
    assert health_status == 503 and live_status == 503, (stats, live)
    assert live["state"] == "failed", live
    # Median and max: one 2-core machine shared with other work can stall any one call.
    assert statistics.median(latencies) < 0.1, f"503 not fast: {latencies}"
    assert max(latencies) < 1.0, f"503 not fast: {latencies}"
    assert server.proc.poll() is None, "without --exit-on-fatal the process stays up"
    assert "failed for good" in server.log_path.read_text()
    assert_log_clean(server, allowed=["dead"])


async def test_exit_on_fatal_makes_the_process_exit_non_zero(launch):
    """Scenario 4 with ``--exit-on-fatal``: the process exits on its own, non-zero, and
    no client is left hanging."""
    server = launch("--failpoints-http", "--exit-on-fatal", "--max-failed-rebuilds", str(K),
                    failpoints=GATE)
    with anyio.fail_after(30):
        async with http_client(server) as client:
            replies = await every_step_failing_midflight(client)

            async def exited() -> bool:
                return server.proc.poll() is not None

            await wait_until(exited, 15, "the process to exit")
    assert server.proc.returncode not in (0, None), server.proc.returncode
    assert "failed for good" in server.log_path.read_text()
    assert_log_clean(server, allowed=["dead"])
    dropped = [r for r in replies if r.transport_error]
    assert not dropped, f"{len(dropped)} in-flight connections dropped, not answered"
    assert_all_failed(replies, {"engine_dead"})


async def test_a_step_past_its_deadline_wedges_then_recovers(launch, reference, model_name):
    """Scenario 5: a 4 s step with ``--step-timeout 2``: /live 503 within 3 s of the step
    starting, in-flight requests get a terminal error, new requests 503; once the step
    returns the server is ready again and serves exactly."""
    server = launch("--failpoints-http", "--step-timeout", "2", failpoints=GATE)
    marks: dict[str, float] = {}
    with anyio.fail_after(30):
        async with http_client(server) as client:
            async def wedge_and_watch() -> None:
                await wait_for_requests(client, 6)
                marks["armed"] = time.monotonic()  # the slow step starts after this
                await set_failpoint(client, "engine.step", "5*off->1*sleep(4000)")

                async def live_down() -> bool:
                    return (await health(client, "/live"))[0] == 503

                await wait_until(live_down, 5, "/live to answer 503")
                marks["live_503"] = time.monotonic()
                status, body = await health(client)
                assert status == 503 and body["state"] == "wedged", body
                marks["refused"] = max(await refused_quickly(client, times=2))
                status, body = await health(client)
                assert body["state"] == "wedged", f"recovered before the checks ended: {body}"

            async with polling(server, "/health") as probe:
                replies = await gather(*in_flight(client, 6), alongside=[wedge_and_watch])
                await wait_for_state(client, "ready", timeout=10)
                marks["ready"] = time.monotonic()
            live_status, _ = await health(client, "/live")

    armed = marks["armed"]
    assert marks["live_503"] - armed <= 3.0, f"/live 503 only after {marks['live_503'] - armed} s"
    assert_all_failed(replies, {"step_timeout"})
    late = [r.describe() for r in replies if r.ended_at - armed > 3.5]
    assert not late, f"terminal errors came only when the step returned: {late}"
    assert marks["ready"] - armed >= 3.5, "ready again before the slow step returned?"
    assert {"ready", "wedged"} <= set(probe.states()), probe.states()
    first_down = next(s.at for s in probe.samples if s.status != 200)
    assert first_down - armed <= 3.0, "/health 503 too late"
    assert live_status == 200
    await assert_serves(server, reference, model_name)
    assert_log_clean(server)
