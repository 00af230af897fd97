import anyio
import pytest

from mlx_serve.reply_channel import ReplyChannel

pytestmark = pytest.mark.anyio


async def test_items_arrive_in_order_and_the_channel_ends_with_its_last_producer():
    channel = ReplyChannel[int](producers=2)
    channel.put(1)
    channel.close_producer()
    received = []

    async def consume():
        async for item in channel:
            received.append(item)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        assert received == [1]  # still open: one producer is left
        channel.put(2)
        channel.close_producer()
    assert received == [1, 2]


async def test_peek_waits_without_consuming():
    channel = ReplyChannel[str]()
    async with anyio.create_task_group() as tg:
        seen = []

        async def peek():
            seen.append(await channel.peek())

        tg.start_soon(peek)
        await anyio.wait_all_tasks_blocked()
        channel.put("first")
    assert seen == ["first"]
    assert [item async for item in _take(channel, 1)] == ["first"]


async def _take(channel, n):
    async for item in channel:
        yield item
        n -= 1
        if n == 0:
            return


async def test_a_closed_consumer_is_seen_by_producers_and_drops_their_items():
    channel = ReplyChannel[int]()
    channel.put(1)
    channel.close()
    assert channel.consumer_gone
    channel.put(2)
    assert await channel.peek() is None
    with anyio.fail_after(1):
        assert [item async for item in channel] == []


async def test_take_ready_returns_everything_queued_without_waiting():
    channel = ReplyChannel[int]()
    assert channel.take_ready() == []
    for i in range(3):
        channel.put(i)
    assert channel.take_ready() == [0, 1, 2]
    assert channel.take_ready() == []
