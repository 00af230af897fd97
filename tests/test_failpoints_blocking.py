"""Tests for mlx_serve.failpoints' blocking actions: ``sleep``, and ``hang`` ended from
another thread, released, filtered by user, and awaited without blocking the loop."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from mlx_serve.failpoints import FailPoints
from tests.failpoint_helpers import WAIT_S, outcomes, start_thread


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_sleep_blocks_for_at_least_the_given_time() -> None:
    points = FailPoints.from_spec("engine.step=1*sleep(50)")
    start = time.monotonic()
    points.check("engine.step")
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    points.check("engine.step")  # exhausted: no sleep
    assert time.monotonic() - start < 0.05


def hang_in_thread(points: FailPoints, site: str) -> tuple[threading.Thread, list[str]]:
    result: list[str] = []
    thread = start_thread(lambda: result.extend(outcomes(points, site, 1)))
    assert points.wait_hanging(site, timeout=WAIT_S)
    assert thread.is_alive()
    return thread, result


@pytest.mark.parametrize("end", ["clear", "release", "replace"])
def test_hang_is_ended_from_another_thread(end: str) -> None:
    points = FailPoints.from_spec("engine.step=1*hang->raise(ValueError:after)")
    thread, result = hang_in_thread(points, "engine.step")
    ender = {
        "clear": lambda: points.clear("engine.step"),
        "release": points.release,
        "replace": lambda: points.set("engine.step", "off"),
    }[end]
    start_thread(ender).join(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert result == ["ok"]
    assert not points.wait_hanging("engine.step", timeout=0)


def test_released_rule_no_longer_hangs_but_keeps_counting() -> None:
    points = FailPoints.from_spec("engine.step=2*hang->raise(ValueError:after)")
    thread, _ = hang_in_thread(points, "engine.step")
    points.release()
    thread.join(WAIT_S)
    assert outcomes(points, "engine.step", 2) == ["ok", "ValueError"]


def test_hang_with_user_filter_waits_for_several_callers() -> None:
    points = FailPoints.from_spec("engine.step[user=alice]=hang")
    assert outcomes(points, "engine.step", 1, users={"bob"}) == ["ok"]
    results: list[str] = []
    threads = [
        start_thread(lambda: results.extend(outcomes(points, "engine.step", 1, {"alice"})))
        for _ in range(3)
    ]
    assert points.wait_hanging("engine.step", count=3, timeout=WAIT_S)
    points.clear("engine.step[user=alice]")
    for thread in threads:
        thread.join(WAIT_S)
    assert results == ["ok"] * 3


@pytest.mark.anyio
async def test_acheck_raise_and_sleep() -> None:
    points = FailPoints.from_spec("sse.send=1*sleep(20)->1*raise(ConnectionResetError:gone)")
    with anyio.fail_after(WAIT_S):
        start = anyio.current_time()
        await points.acheck("sse.send")
        assert anyio.current_time() - start >= 0.02
        with pytest.raises(ConnectionResetError) as info:
            await points.acheck("sse.send")
        assert str(info.value) == "gone"
        await points.acheck("sse.send")


@pytest.mark.anyio
async def test_acheck_hang_does_not_block_the_loop() -> None:
    points = FailPoints.from_spec("sse.send=1*hang")
    hung_done = anyio.Event()
    other_ran = anyio.Event()

    async def hanger() -> None:
        await points.acheck("sse.send")
        hung_done.set()

    async def other() -> None:
        other_ran.set()

    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hanger)
            assert await anyio.to_thread.run_sync(points.wait_hanging, "sse.send", 1, WAIT_S)
            tg.start_soon(other)
            await other_ran.wait()  # the loop keeps running while acheck hangs
            assert not hung_done.is_set()
            await anyio.to_thread.run_sync(points.clear, "sse.send")
            await hung_done.wait()


@pytest.mark.anyio
async def test_acheck_hang_is_cancellable() -> None:
    points = FailPoints.from_spec("sse.send=hang")
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(points.acheck, "sse.send")
            assert await anyio.to_thread.run_sync(points.wait_hanging, "sse.send", 1, WAIT_S)
            tg.cancel_scope.cancel()
    assert not points.wait_hanging("sse.send", timeout=0)
    assert points.describe() == {"sse.send": "hang"}
