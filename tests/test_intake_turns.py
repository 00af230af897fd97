"""Arriving requests prepared a few per pass of the event loop (intake_turns.py).

A ticker that reschedules itself with ``call_soon`` counts the loop's passes, so each
test sees which pass every preparation began in.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from mlx_serve.intake_turns import IntakeTurns

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the turns are the asyncio loop's passes


class Passes:
    """The number of the event loop's current pass."""

    def __init__(self) -> None:
        self.count = 0
        self._running = True
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        if self._running:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._running = False


async def _burst(turns: IntakeTurns, passes: Passes, n: int, began: list[tuple[int, int]]
                 ) -> None:
    async def prepare(i: int) -> None:
        await turns.wait_turn()
        began.append((i, passes.count))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(prepare, i)


def _per_pass(began: list[tuple[int, int]]) -> list[int]:
    counts: dict[int, int] = {}
    for _, at in began:
        counts[at] = counts.get(at, 0) + 1
    return list(counts.values())


async def test_a_burst_is_prepared_a_few_per_pass_in_arrival_order():
    turns, passes, began = IntakeTurns(4), Passes(), []
    with anyio.fail_after(10):
        await _burst(turns, passes, 18, began)
    passes.stop()
    assert [i for i, _ in began] == list(range(18))  # nobody overtakes
    assert _per_pass(began) == [4, 4, 4, 4, 2]
    assert turns.waiting == 0


async def test_other_work_runs_between_the_passes_of_a_burst():
    # A /health request stands for the loop's other work: arriving just after a burst of
    # 40, it runs long before the last of them is prepared.
    turns, passes, began = IntakeTurns(8), Passes(), []
    probe_after: list[int] = []

    async def probe() -> None:
        await anyio.sleep(0)  # arrives after the burst's tasks began
        probe_after.append(len(began))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_burst, turns, passes, 40, began)
            tg.start_soon(probe)
    passes.stop()
    assert len(began) == 40
    assert probe_after and probe_after[0] <= 16  # without turns: all 40 first


async def test_without_a_burst_a_request_begins_at_once():
    turns = IntakeTurns(1)
    for _ in range(3):  # one request a pass: none waits
        with anyio.fail_after(1):
            await turns.wait_turn()
        assert turns.waiting == 0
        await anyio.sleep(0)
        await anyio.sleep(0)


async def test_no_limit_lets_a_whole_burst_begin_in_one_pass():
    turns, passes, began = IntakeTurns(0), Passes(), []
    with anyio.fail_after(10):
        await _burst(turns, passes, 20, began)
    passes.stop()
    assert _per_pass(began) == [20]


async def test_a_request_cancelled_while_waiting_leaves_the_queue():
    turns, passes, began = IntakeTurns(2), Passes(), []
    done: list[int] = []

    async def prepare(i: int, scope: anyio.CancelScope) -> None:
        with scope:
            await turns.wait_turn()
            began.append((i, passes.count))
            done.append(i)

    scopes = [anyio.CancelScope() for _ in range(6)]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i, scope in enumerate(scopes):
                tg.start_soon(prepare, i, scope)
            await anyio.sleep(0)  # all six have begun: 0 and 1 went, 2-5 wait
            assert turns.waiting == 4
            scopes[3].cancel()
    passes.stop()
    assert done == [0, 1, 2, 4, 5]
    assert _per_pass(began) == [2, 2, 1]
    assert turns.waiting == 0
