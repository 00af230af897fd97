"""Request preparation on the event loop: a budget per loop turn; long input to a thread."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import httpx
import pytest

from mlx_serve import request_building, routes
from mlx_serve.app import create_app
from mlx_serve.config import Settings
from mlx_serve.intake import INLINE_TEXT_CHARS, Intake, IntakeGate

pytestmark = pytest.mark.anyio
T = TypeVar("T")


class LoopTurns:
    """Counts the event loop's turns: a task that steps once per turn."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            self.count += 1
            await anyio.lowlevel.checkpoint()


async def test_short_input_stays_on_the_event_loop_and_long_input_goes_to_a_thread():
    intake = Intake()
    loop_thread = threading.get_ident()
    assert await intake.by_size(INLINE_TEXT_CHARS, threading.get_ident) == loop_thread
    assert await intake.by_size(INLINE_TEXT_CHARS + 1, threading.get_ident) != loop_thread
    assert await intake.by_size(None, threading.get_ident) != loop_thread


async def burst_turns(intake: Intake, calls: int, work: Callable[[], None]) -> list[int]:
    """The loop turn of each of ``calls`` calls started together, in the order they ran."""
    turns = LoopTurns()
    seen: list[tuple[int, int]] = []

    def record(index: int) -> None:
        seen.append((index, turns.count))
        work()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.run)
            async with anyio.create_task_group() as burst:
                for index in range(calls):  # all start in the same turn
                    burst.start_soon(intake.on_loop, record, index)
            tg.cancel_scope.cancel()
    assert [index for index, _ in seen] == list(range(calls))  # in the order they came
    return [turn for _, turn in seen]


def busy(seconds: float) -> Callable[[], None]:
    def work() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return work


async def test_calls_that_use_up_a_turns_budget_go_on_in_the_next_turn():
    turns = await burst_turns(Intake(budget=0.003), 10, busy(0.001))
    per_turn = Counter(turns)
    assert max(per_turn.values()) <= 3 and len(per_turn) >= 4, turns


async def test_cheap_calls_share_a_turn():
    turns = await burst_turns(Intake(budget=0.005), 20, lambda: None)
    assert len(set(turns)) == 1, turns


async def test_a_zero_budget_gives_every_call_a_turn_of_its_own():
    turns = await burst_turns(Intake(budget=0.0), 10, lambda: None)
    assert len(set(turns)) == 10, turns


async def test_a_burst_wakes_each_waiter_about_once():
    intake = Intake(budget=0.003)

    async def request(index: int, order: list[int]) -> None:
        await intake.admit()
        order.append(index)
        busy(0.001)()

    order: list[int] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for index in range(60):
                tg.start_soon(request, index, order)
    assert order == list(range(60))
    # Waking every waiter each turn would take ~60 * 20 / 2 wake-ups.
    assert intake.wakeups <= 2 * 60, intake.wakeups


async def test_a_waiter_cancelled_in_line_does_not_hold_up_the_others():
    intake = Intake(budget=0.0)
    done: list[int] = []

    async def request(index: int) -> None:
        await intake.admit()
        done.append(index)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for index in range(5):
                tg.start_soon(request, index)
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(request, 99)
                await anyio.lowlevel.checkpoint()  # it is in line now
                doomed.cancel_scope.cancel()
    assert done == [0, 1, 2, 3, 4]


async def test_a_long_input_in_a_thread_does_not_hold_up_short_ones():
    intake = Intake()
    release = threading.Event()
    results: list[str] = []

    def long_job() -> str:
        release.wait(10)
        return "long"

    async def run(call: Callable[[], object]) -> None:
        results.append(await call())  # type: ignore[misc]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, lambda: intake.by_size(INLINE_TEXT_CHARS + 1, long_job))
            await anyio.lowlevel.checkpoint()  # the long job is in its thread
            results.append(await intake.by_size(10, lambda: "short"))
            release.set()
    assert results == ["short", "long"]


async def test_a_burst_of_chat_requests_is_parsed_and_rendered_through_the_intake(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    turns = LoopTurns()
    parsed: list[int] = []
    rendered: list[int] = []

    def recorded(fn: Callable[..., T], turns_seen: list[int]) -> Callable[..., T]:
        def call(*args: Any) -> T:
            turns_seen.append(turns.count)
            return fn(*args)
        return call

    monkeypatch.setattr(routes, "parse", recorded(routes.parse, parsed))
    monkeypatch.setattr(request_building, "render_chat",
                        recorded(request_building.render_chat, rendered))
    app = create_app(Settings(model=str(tiny_model_dir)))
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    statuses: list[int] = []

    async def chat(client: httpx.AsyncClient) -> None:
        statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)

    with anyio.fail_after(60):
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            await app.state.server.engine.ready.wait()
            app.state.server.intake = Intake(budget=0.0)  # a turn per call, to see each
            async with anyio.create_task_group() as tg:
                tg.start_soon(turns.run)
                async with anyio.create_task_group() as burst:
                    for _ in range(12):
                        burst.start_soon(chat, client)
                tg.cancel_scope.cancel()
    assert statuses == [200] * 12
    assert len(parsed) == len(rendered) == 12
    assert len(set(parsed)) == 12 and len(set(rendered)) == 12, (parsed, rendered)


async def test_the_gate_admits_posts_through_the_intake_and_lets_other_requests_pass():
    turns = LoopTurns()
    seen: list[tuple[str, int]] = []

    async def endpoint(scope: dict, receive: Any, send: Any) -> None:
        seen.append((scope["method"], turns.count))

    gate = IntakeGate(endpoint)  # type: ignore[arg-type]
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(intake=Intake(0.0))))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.run)
            async with anyio.create_task_group() as burst:
                for method in ("POST",) * 5 + ("GET",) * 5:  # all start in the same turn
                    scope = {"type": "http", "method": method, "app": app}
                    burst.start_soon(gate, scope, None, None)
            tg.cancel_scope.cancel()
    posts = [turn for method, turn in seen if method == "POST"]
    gets = [turn for method, turn in seen if method == "GET"]
    assert len(set(posts)) == 5  # a zero budget: a turn each
    assert len(gets) == 5 and set(gets) == {posts[0]}  # at once, in the first turn
