"""Black-box tests of ``--engine-process``: HTTP in the server process, the engine (actor and
MLX thread) in a child process it starts. The semantics must be those of the one-process
mode: the same greedy outputs, truthful health, every request answered when the child
dies, disconnects leave the batch, fail points reach the child, SIGTERM drains, overload
is a 429.

One module-scoped engine-process server serves the plain cases (the fault suite's
one-process reference server gives the expected outputs); a test that kills or drains a
server starts its own. Every wait is bounded: client timeouts, ``anyio.fail_after`` and
polls with a deadline.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.faults.harness import (
    CHAT,
    COMPLETIONS,
    NO_EOS,
    SLOW_STEPS,
    Reference,
    Reply,
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
    process_exit,
    set_failpoint,
    wait_for_requests,
    wait_for_state,
    wait_until,
)
from tests.http_helpers import read_then_leave
from tests.server_process import ServerProcess

pytestmark = pytest.mark.anyio

# The module server's --decode-batch-size and --max-queue.
DECODE, QUEUE = 4, 8


def body_for(path: str, i: int, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    body = chat_body(i, max_tokens, **extra)
    if path == COMPLETIONS:
        body["prompt"] = body.pop("messages")[0]["content"]
    return body


def engine_pid(server: ServerProcess) -> int:
    body = httpx.get(server.base_url + "/health", timeout=5).json()
    assert isinstance(body.get("engine_pid"), int), body
    return body["engine_pid"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # it has just gone, or there is no /proc (macOS)
        return not Path("/proc").is_dir()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("engine_process") / "server.log"
    with ServerProcess(tiny_model_dir, log, args=[
            "--engine-process", "--failpoints-http", "--decode-batch-size", str(DECODE),
            "--max-queue", str(QUEUE)]) as s:
        yield s


@pytest.fixture
def spawn(launch: Callable[..., ServerProcess]) -> Iterator[Callable[..., ServerProcess]]:
    """``spawn(*flags, env=...)``: ``launch`` with ``--engine-process``; the engine child is
    killed at teardown should it outlive its server (a stopped child never reads the
    socket's end)."""
    pids: list[int] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = launch("--engine-process", *args, env=env)
        pids.append(engine_pid(server))
        return server

    yield start
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# -- the module server ------------------------------------------------------------------

def test_health_names_a_live_engine_child(server):
    with httpx.Client(base_url=server.base_url, timeout=5) as c:
        ready, live, metrics = c.get("/health"), c.get("/live"), c.get("/metrics")
    assert ready.status_code == 200 and live.status_code == 200, (ready.text, live.text)
    # The child's figures reach /metrics as they reach /health.
    assert 'mlx_serve_engine_state{state="ready"} 1.0' in metrics.text
    assert "mlx_serve_memory_active_bytes" in metrics.text
    body = ready.json()
    assert body["status"] == "ok" and body["state"] == "ready", body
    assert {"running", "waiting", "steps", "recoveries", "replays", "isolated"} <= set(body)
    pid = body["engine_pid"]
    assert isinstance(pid, int) and pid != server.proc.pid and alive(pid), body
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():  # Linux: the engine is the server's own child
        assert int(stat.read_text().rsplit(")", 1)[1].split()[1]) == server.proc.pid


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_greedy_outputs_equal_the_one_process_mode(server, reference: Reference, path):
    bodies = [body_for(path, i, max_tokens=32) for i in range(3)]
    expected = await reference.outcomes(bodies, path)
    with anyio.fail_after(60):
        async with http_client(server) as client:
            replies = await gather(
                *[lambda b=b: stream_chat(client, b, path=path) for b in bodies],
                *[lambda b=b: complete_chat(client, b, path) for b in bodies])
    assert_exact(replies, expected * 2)


async def test_a_client_leaving_mid_stream_leaves_the_batch(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
            "temperature": 0, "stream": True, "logit_bias": NO_EOS}  # ~2000 steps in full
    with anyio.fail_after(30):
        async with http_client(server) as client:
            _, before = await health(client)
            await read_then_leave(client, CHAT, body)
            left = time.monotonic()

            async def emptied() -> dict[str, Any] | None:
                _, body = await health(client)
                return body if body["running"] == 0 and body["waiting"] == 0 else None

            after = await wait_until(emptied, 5, "the leaver to leave the batch")
    assert time.monotonic() - left < 5
    assert after["steps"] - before["steps"] < 1000, f"it ran on after the client left: {after}"


async def test_overload_is_429_at_once_never_a_hang(server):
    count = DECODE + QUEUE + 4
    replies: list[Reply | None] = [None] * count
    with anyio.fail_after(60):
        async with http_client(server) as client:
            async def one(i: int) -> None:
                replies[i] = await complete_chat(client, chat_body(i, max_tokens=4))

            async def refused() -> bool:
                return sum(r is not None and r.status == 429 for r in replies) >= 4

            await set_failpoint(client, "engine.step", "hang")  # every step blocks
            try:
                async with anyio.create_task_group() as tg:
                    for i in range(count):
                        tg.start_soon(one, i)
                    await wait_until(refused, 5, "429s while the engine is stuck")
                    done_early = [r for r in replies if r is not None]
                    await clear_failpoint(client, "engine.step")  # releases the hang
            finally:
                await clear_failpoint(client, "engine.step")
    assert all(r.status == 429 for r in done_early), [r.describe() for r in done_early]
    statuses = []
    for reply in replies:
        assert reply is not None
        assert_one_terminal(reply)
        statuses.append(reply.status)
        if reply.status == 429:
            assert reply.error["type"] == "rate_limit_error", reply.describe()
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(429) >= count - DECODE - QUEUE, statuses


async def test_queued_clients_that_leave_give_their_places_to_new_ones(server):
    """While every step hangs, fill the batch and the queue, let the queued clients
    leave, and ask again: the newcomers are admitted, not refused as if the leavers
    still held their places; once the step goes on, every admitted request finishes."""
    replies: list[Reply | None] = [None] * (DECODE + 2 * QUEUE)
    with anyio.fail_after(60):
        async with http_client(server) as client:
            async def one(i: int, scope: anyio.CancelScope | None = None) -> None:
                if scope is None:
                    replies[i] = await complete_chat(client, chat_body(i, max_tokens=4))
                    return
                with scope:
                    replies[i] = await complete_chat(client, chat_body(i, max_tokens=4))

            await set_failpoint(client, "engine.step", "hang")
            try:
                async with anyio.create_task_group() as tg:
                    leavers = [anyio.CancelScope() for _ in range(QUEUE)]
                    for i in range(DECODE):
                        tg.start_soon(one, i)
                    await wait_for_requests(client, DECODE)
                    for i, scope in enumerate(leavers):
                        tg.start_soon(one, DECODE + i, scope)
                    await wait_for_requests(client, DECODE + QUEUE)
                    for scope in leavers:
                        scope.cancel()

                    async def places_free() -> dict[str, Any] | None:
                        _, body = await health(client)
                        return body if body["waiting"] == 0 else None

                    await wait_until(places_free, 10, "the leavers' places to be free")
                    for i in range(DECODE + QUEUE, DECODE + 2 * QUEUE):
                        tg.start_soon(one, i)
                    await wait_for_requests(client, DECODE + QUEUE)
                    await clear_failpoint(client, "engine.step")
            finally:
                await clear_failpoint(client, "engine.step")
    answered = [r for r in replies if r is not None]
    assert len(answered) == DECODE + QUEUE, "only the leavers are unanswered"
    assert [r.status for r in answered] == [200] * (DECODE + QUEUE), [
        r.describe() for r in answered]


async def test_choices_logprobs_and_format_errors_match_the_one_process_mode(
        server, reference: Reference):
    """What travels as a full event (log-probabilities, the echoed prompt's own, several
    choices on one handle) and what the child compiles (a response format) come out as
    in one process."""
    body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "n": 2,
            "logprobs": 2, "logit_bias": NO_EOS, "echo": True}
    bad_format = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "response_format": {"type": "json_schema", "json_schema": {
                      "name": "x", "schema": {"type": "object",
                                              "properties": {"a": {"type": "strinx"}}}}}}
    seen = []
    with anyio.fail_after(30):
        for target in (reference.server, server):
            async with http_client(target) as client:
                reply = await client.post(COMPLETIONS, json=body)
                errors = [await client.post(CHAT, json={**bad_format, "stream": stream})
                          for stream in (False, True)]
            assert reply.status_code == 200, reply.text
            assert [e.status_code for e in errors] == [400, 400], [e.text for e in errors]
            choices = reply.json()["choices"]
            seen.append(([(c["index"], c["text"], c["logprobs"]) for c in choices],
                         [e.json()["error"]["param"] for e in errors]))
    assert seen[0] == seen[1]
    assert [c[0] for c in seen[1][0]] == [0, 1] and seen[1][1] == ["response_format"] * 2


async def test_runtime_failpoints_reach_the_engine_child(server, reference: Reference):
    body = chat_body(5, max_tokens=32, logit_bias=NO_EOS)
    expected = [await reference.outcome(body)]
    with anyio.fail_after(30):
        async with http_client(server) as client:
            _, before = await health(client)
            await set_failpoint(client, "engine.step", "6*off->1*raise(RuntimeError:boom)")
            try:
                reply = await stream_chat(client, body)
            finally:
                await clear_failpoint(client, "engine.step")
            status, after = await health(client)
    assert_exact([reply], expected)  # one continuous stream across the rebuild
    assert status == 200 and after["state"] == "ready", after
    assert after["recoveries"] == before["recoveries"] + 1, (before, after)
    assert after["replays"] > before["replays"], (before, after)


def test_no_unexpected_errors_in_the_log(server):
    assert_log_clean(server, allowed=["boom"])


# -- servers of their own ---------------------------------------------------------------

async def test_failpoints_from_the_environment_reach_the_engine_child(spawn,
                                                                      reference: Reference):
    server = spawn(env={"MLX_SERVE_FAILPOINTS": "engine.step=6*off->1*raise(RuntimeError:boom)"})
    body = chat_body(7, max_tokens=32, logit_bias=NO_EOS)
    expected = [await reference.outcome(body)]
    with anyio.fail_after(30):
        async with http_client(server) as client:
            reply = await stream_chat(client, body)
            status, stats = await health(client)
    assert_exact([reply], expected)
    assert status == 200 and stats["state"] == "ready", stats
    assert stats["recoveries"] == 1 and stats["replays"] >= 1, stats
    assert_log_clean(server, allowed=["boom"])


async def kill_engine_mid_flight(server: ServerProcess, client: httpx.AsyncClient,
                                 streams: int, jsons: int) -> tuple[list[Reply], float]:
    """Long requests in flight (streams have output), then SIGKILL the engine child;
    their replies and the time of the kill."""
    pid, started = engine_pid(server), [anyio.Event() for _ in range(streams)]
    bodies = [chat_body(i, max_tokens=1000, logit_bias=NO_EOS) for i in range(streams + jsons)]
    calls = [lambda b=b, e=e: stream_chat(client, b, on_content=e)
             for b, e in zip(bodies, started, strict=False)]
    calls += [lambda b=b: complete_chat(client, b) for b in bodies[streams:]]
    killed: list[float] = []

    async def kill() -> None:
        for event in started:
            await event.wait()
        await wait_for_requests(client, streams + jsons)
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    return await gather(*calls, alongside=[kill]), killed[0]


async def test_a_killed_engine_child_fails_every_request_and_health(spawn):
    server = spawn("--failpoints", SLOW_STEPS)  # 1000 tokens: ~25 s unless cut short
    with anyio.fail_after(40):
        async with http_client(server) as client:
            replies, killed = await kill_engine_mid_flight(server, client, 2, 2)
            ready_status, ready = await health(client)
            live_status, live = await health(client, "/live")
            refused = [await complete_chat(client, chat_body(9, max_tokens=4)),
                       await stream_chat(client, chat_body(10, max_tokens=4))]
    for reply in replies:
        assert_one_terminal(reply)
        assert reply.error is not None, reply.describe()
        if reply.stream:
            assert reply.status == 200 and reply.text and reply.done == 1, reply.describe()
        else:
            assert reply.status is not None and reply.status >= 500, reply.describe()
        assert reply.ended_at - killed < 3.0, f"not at once: {reply.describe()}"
    assert ready_status == 503 and ready["status"] == ready["state"] == "failed", ready
    # No phantom load: every request is answered and no step runs any more.
    assert ready["running"] == ready["waiting"] == 0 and ready["step_age_s"] == 0, ready
    assert live_status == 503 and live["status"] == live["state"] == "failed", live
    for reply in refused:
        assert_one_terminal(reply)
        assert reply.status == 503 and reply.error is not None, reply.describe()
    assert server.proc.poll() is None, "without --exit-on-fatal the server stays up"


async def test_exit_on_fatal_exits_70_when_the_engine_child_dies(spawn):
    server = spawn("--exit-on-fatal", "--failpoints", SLOW_STEPS)
    with anyio.fail_after(40):
        async with http_client(server) as client:
            replies, _ = await kill_engine_mid_flight(server, client, 1, 1)
        code = await process_exit(server, 15)
    for reply in replies:
        assert_one_terminal(reply)  # answered before the exit, not dropped
        assert reply.error is not None, reply.describe()
    assert code == 70, f"exit status {code}:\n{server.log_text()}"


async def test_sigterm_drains_in_flight_requests_then_exits_zero(spawn, reference: Reference):
    server = spawn("--drain-timeout", "20", "--failpoints", SLOW_STEPS)
    pid = engine_pid(server)
    bodies = [chat_body(i, max_tokens=64, logit_bias=NO_EOS) for i in range(4)]  # ~1.6 s
    expected = await reference.outcomes(bodies)
    checked: list[float] = []
    refused: list[Reply] = []
    with anyio.fail_after(40):
        async with http_client(server) as client:
            started = [anyio.Event(), anyio.Event()]

            async def terminate_and_check() -> None:
                for event in started:
                    await event.wait()
                await wait_for_requests(client, 4)
                server.terminate()
                state = await wait_for_state(client, "draining", timeout=5)
                assert (await health(client))[0] == 503, state
                live_status, live = await health(client, "/live")
                assert live_status == 200 and live["state"] == "draining", live
                refused.append(await complete_chat(client, chat_body(20, max_tokens=4)))
                checked.append(time.monotonic())

            replies = await gather(
                lambda: stream_chat(client, bodies[0], on_content=started[0]),
                lambda: stream_chat(client, bodies[1], on_content=started[1]),
                lambda: complete_chat(client, bodies[2]),
                lambda: complete_chat(client, bodies[3]),
                alongside=[terminate_and_check])
            code = await process_exit(server, 15)

            async def child_gone() -> bool:
                return not alive(pid)

            await wait_until(child_gone, 10, "the engine child to exit")
    assert_exact(replies, expected)
    assert min(r.ended_at for r in replies) > checked[0], "checked after the work had ended"
    assert_one_terminal(refused[0])
    assert refused[0].status == 503, refused[0].describe()
    assert code == 0, f"exit status {code}:\n{server.log_text()}"
    assert_log_clean(server)


async def test_a_silent_engine_child_is_wedged_and_its_requests_answered(spawn):
    """A child that stops (SIGSTOP: its event loop cannot report anything) reads as wedged
    once the step deadline passes; the server answers its open requests with a timeout
    error. Resumed, it drops them and serves again."""
    server = spawn("--step-timeout", "2", "--failpoints", SLOW_STEPS)
    pid, started = engine_pid(server), [anyio.Event(), anyio.Event()]
    bodies = [chat_body(i, max_tokens=1000, logit_bias=NO_EOS) for i in range(3)]
    stopped: list[float] = []

    async def stop() -> None:
        for event in started:
            await event.wait()
        await wait_for_requests(client, 3)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(time.monotonic())

    try:
        with anyio.fail_after(40):
            async with http_client(server) as client:
                replies = await gather(
                    lambda: stream_chat(client, bodies[0], on_content=started[0]),
                    lambda: stream_chat(client, bodies[1], on_content=started[1]),
                    lambda: complete_chat(client, bodies[2]), alongside=[stop])
                ready_status, ready = await health(client)
                live_status, live = await health(client, "/live")
                os.kill(pid, signal.SIGCONT)
                await wait_for_state(client, "ready", timeout=15)
                after = await complete_chat(client, chat_body(11, max_tokens=8))
    finally:
        os.kill(pid, signal.SIGCONT)  # never leave a stopped child behind
    for reply in replies:
        assert_one_terminal(reply)
        assert reply.error is not None, reply.describe()
        # Answered after the deadline (2 s), within a few reports of it.
        assert 2.0 <= reply.ended_at - stopped[0] < 5.0, reply.describe()
    assert ready_status == 503 and ready["state"] == "wedged", ready
    assert live_status == 503 and live["state"] == "wedged", live
    # Its requests are answered: none counts as running or waiting any more.
    assert ready["running"] == ready["waiting"] == 0, ready
    assert after.completed, after.describe()
