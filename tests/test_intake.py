"""Request preparation on the event loop goes one call per loop turn; long input to a thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import httpx
import pytest

from mlx_serve import request_building, routes
from mlx_serve.app import create_app
from mlx_serve.config import Settings
from mlx_serve.intake import INLINE_TEXT_CHARS, Intake

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


async def test_calls_started_together_run_in_turns_of_the_loop_of_their_own():
    intake, turns = Intake(), LoopTurns()
    seen: list[int] = []

    def record() -> None:
        seen.append(turns.count)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.run)
            async with anyio.create_task_group() as burst:
                for _ in range(20):  # all start in the same turn
                    burst.start_soon(intake.on_loop, record)
            tg.cancel_scope.cancel()
    assert len(seen) == 20 and len(set(seen)) == 20, seen


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


async def test_a_burst_of_chat_requests_is_parsed_and_rendered_one_per_loop_turn(
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
            async with anyio.create_task_group() as tg:
                tg.start_soon(turns.run)
                async with anyio.create_task_group() as burst:
                    for _ in range(12):
                        burst.start_soon(chat, client)
                tg.cancel_scope.cancel()
    assert statuses == [200] * 12
    assert len(parsed) == len(rendered) == 12
    assert len(set(parsed)) == 12 and len(set(rendered)) == 12, (parsed, rendered)
