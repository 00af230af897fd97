"""Scenario 7: SIGTERM under load. The server drains (readiness 503 ``draining``, liveness
200, new requests 503), in-flight requests finish (or get a terminal error once the
drain timeout passes), and the process exits 0.

Every step sleeps 25 ms (``engine.step=sleep(25)``) so that the in-flight work lasts
long enough to be observed; a sleeping step changes no output.
"""

from __future__ import annotations

import os
import time

import anyio
import httpx
import pytest

from tests.faults.harness import (
    GATE,
    NO_EOS,
    POLL_S,
    SLOW_STEPS,
    Reply,
    assert_all_terminal,
    assert_exact,
    assert_one_terminal,
    chat_body,
    complete_chat,
    gather,
    http_client,
    stream_chat,
)
from tests.faults.server_watch import (
    assert_log_clean,
    clear_failpoint,
    health,
    polling,
    process_exit,
    wait_for_requests,
    wait_for_state,
    wait_until,
)
from tests.server_process import ServerProcess

pytestmark = pytest.mark.anyio

def streaming_load(client, bodies, started: list[anyio.Event]):
    """Streams for even bodies (each sets its event on its first text), JSON for odd."""
    calls = []
    for i, body in enumerate(bodies):
        if i % 2 == 0:
            event = anyio.Event()
            started.append(event)
            calls.append(lambda b=body, e=event: stream_chat(client, b, on_content=e))
        else:
            calls.append(lambda b=body: complete_chat(client, b))
    return calls


def assert_ended_with_errors(replies, since: float, earliest: float, latest: float) -> None:
    """Every reply ended with its terminal error (a stream: status 200, some text, its
    error event and [DONE]; a whole reply: a 5xx), ``earliest``-``latest`` s after
    ``since``."""
    assert_all_terminal(replies)
    for reply in replies:
        assert reply.error is not None, f"expected a terminal error: {reply.describe()}"
        if reply.stream:
            assert reply.status == 200 and reply.done == 1 and reply.text, reply.describe()
        else:
            assert reply.status is not None and reply.status >= 500, reply.describe()
        waited = reply.ended_at - since
        assert earliest <= waited <= latest, f"ended {waited:.2f} s after: {reply.describe()}"


async def test_sigterm_drains_in_flight_requests_then_exits_zero(launch, reference):
    server = launch("--drain-timeout", "20", failpoints=SLOW_STEPS)
    bodies = [chat_body(i, max_tokens=64) for i in range(8)]
    expected = await reference.outcomes(bodies)
    marks: dict[str, float] = {}
    refused: list[Reply] = []
    with anyio.fail_after(40):
        async with http_client(server) as client:
            started: list[anyio.Event] = []

            async def terminate_and_check() -> None:
                for event in started:
                    await event.wait()  # every stream is generating
                await wait_for_requests(client, 8)
                server.terminate()
                marks["sigterm"] = time.monotonic()
                body = await wait_for_state(client, "draining", timeout=5)
                status, _ = await health(client)
                assert status == 503, body
                live_status, live = await health(client, "/live")
                assert live_status == 200 and live["state"] == "draining", live
                refused.append(await complete_chat(client, chat_body(20, max_tokens=4)))
                refused.append(await stream_chat(client, chat_body(21, max_tokens=4)))
                marks["checked"] = time.monotonic()

            async with polling(server, "/live") as live_probe:
                replies = await gather(*streaming_load(client, bodies, started),
                                       alongside=[terminate_and_check])
                code = await process_exit(server, timeout=15)

    assert_exact(replies, expected)
    first_done = min(r.ended_at for r in replies)
    assert first_done > marks["checked"], "the checks did not happen while work was in flight"
    for reply in refused:
        assert_one_terminal(reply)
        assert reply.status == 503 and reply.error is not None, reply.describe()
    # Until the last request is answered the process must look alive (it is stopping
    # afterwards, and /live may then say so). The server reaches "stopped" only after it
    # has answered every request (assert_exact above proves they all completed), but that
    # answer to a probe can reach this client just before it has read the end of the last
    # stream on another connection; such a sample belongs to the stop, not the drain.
    last_end = max(r.ended_at for r in replies)
    working = [s for s in live_probe.samples
               if s.at <= last_end and s.body.get("state") != "stopped"]
    assert {s.status for s in working} == {200}, \
        f"/live left 200 while draining: {[(s.status, s.body) for s in working]}"
    assert "draining" in {s.body.get("state") for s in working}, working
    assert code == 0, f"exit status {code}:\n{server.log_text()}"
    assert_log_clean(server)


async def test_drain_timeout_ends_the_stragglers_with_an_error_and_exits_zero(launch):
    """Variant: a 1 s drain timeout and work that would take ~25 s: in-flight requests get
    a terminal error (stream error event / 5xx) once the timeout passes, exit status 0."""
    server = launch("--drain-timeout", "1", failpoints=SLOW_STEPS)
    bodies = [chat_body(i, max_tokens=1000, logit_bias=NO_EOS) for i in range(6)]
    marks: dict[str, float] = {}
    with anyio.fail_after(40):
        async with http_client(server) as client:
            started: list[anyio.Event] = []

            async def terminate() -> None:
                for event in started:
                    await event.wait()
                await wait_for_requests(client, 6)
                server.terminate()
                marks["sigterm"] = time.monotonic()

            replies = await gather(*streaming_load(client, bodies, started),
                                   alongside=[terminate])
            code = await process_exit(server, timeout=15)

    assert_ended_with_errors(replies, marks["sigterm"], 0.9, 5.0)
    # Said as a shutdown (another replica may serve them), not as a dead engine.
    assert {r.error["code"] for r in replies} == {"server_shutting_down"}, replies
    assert code == 0, f"exit status {code}:\n{server.log_text()}"
    assert_log_clean(server)


async def test_drain_timeout_is_honoured_while_a_step_is_stuck(launch):
    """A step that never returns (a livelock, mlx-lm #1493) at SIGTERM: after the drain
    timeout the in-flight requests should get a terminal error and the process exit."""
    server = launch("--failpoints-http", "--drain-timeout", "1", failpoints=GATE)
    replies: list[Reply] = []
    try:
        async with http_client(server) as client:
            async def load() -> None:
                replies.extend(await gather(*[
                    lambda i=i: complete_chat(client, chat_body(i, max_tokens=8))
                    for i in range(4)]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                await wait_for_requests(client, 4)
                server.terminate()
                with anyio.move_on_after(4):  # drain timeout + 3 s
                    while len(replies) < 4 or server.proc.poll() is None:
                        await anyio.sleep(POLL_S)
                tg.cancel_scope.cancel()
        assert len(replies) == 4, "in-flight requests got no answer within drain timeout + 3 s"
        assert_all_terminal(replies)
        assert server.proc.poll() == 0, "the process did not exit after the drain timeout"
    finally:
        if server.proc.poll() is None:  # let the stuck step return so the process can go
            async with http_client(server) as client:
                await clear_failpoint(client, "engine.step")


async def test_a_second_sigterm_ends_every_request_with_its_error_and_exits_zero(launch):
    """Draining with 20 s to go, a second SIGTERM: each request still in flight gets its
    terminal error at once (a stream its error event and [DONE], not a cut-off body)."""
    server = launch("--drain-timeout", "20", failpoints=SLOW_STEPS)
    bodies = [chat_body(i, max_tokens=1000, logit_bias=NO_EOS) for i in range(6)]
    marks: dict[str, float] = {}
    with anyio.fail_after(40):
        async with http_client(server) as client:
            started: list[anyio.Event] = []

            async def terminate_twice() -> None:
                for event in started:
                    await event.wait()
                await wait_for_requests(client, 6)
                server.terminate()
                await wait_for_state(client, "draining", timeout=5)
                server.terminate()
                marks["second"] = time.monotonic()

            replies = await gather(*streaming_load(client, bodies, started),
                                   alongside=[terminate_twice])
            code = await process_exit(server, timeout=15)

    assert_ended_with_errors(replies, marks["second"], 0.0, 3.0)
    assert code == 0, f"exit status {code}:\n{server.log_text()}"
    assert_log_clean(server)


@pytest.mark.parametrize("where", ["in-process", "engine-process"])
async def test_sigterm_while_the_model_loads_exits_at_once(where, tiny_model_dir, tmp_path):
    """An engine still loading its model (for a minute here) has no request in flight:
    the server stops without waiting for it, its engine process too. Before, it waited
    out the drain timeout and the abort's grace (35 s by default), and so did a server
    whose port was taken while its model loaded."""
    flags = ["--drain-timeout", "30", "--failpoints", "startup.load=sleep(60000)"]
    if where == "engine-process":
        flags.append("--engine-process")
    server = ServerProcess(tiny_model_dir, tmp_path / "server.log", args=flags)
    try:
        async def loading() -> dict | None:
            try:
                async with http_client(server) as client:
                    _, body = await health(client)
            except httpx.ConnectError:  # not listening yet
                return None
            return body if body.get("state") == "loading" else None

        body = await wait_until(loading, 60, "the server to be loading its model")
        child = body.get("engine_pid")
        assert (child is not None) == (where == "engine-process"), body
        assert (child is not None) == (where == "engine-process"), loading
        server.terminate()
        code = await process_exit(server, timeout=10)  # not the drain timeout's 30 s
        assert code == 0, server.log_text()
        assert child is None or not os.path.exists(f"/proc/{child}")  # not left behind
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.stop()
