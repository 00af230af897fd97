import anyio
import pytest

from mlx_serve.reply_channel import ReplyChannel

pytestmark = pytest.mark.anyio


async def consume_into(channel, received: list) -> None:
    async for item in channel:
        received.append(item)


async def test_items_arrive_in_order_and_the_channel_ends_with_its_last_producer():
    channel = ReplyChannel[int](producers=2)
    channel.put(1)
    channel.close_producer()
    received: list[int] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume_into, channel, received)
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


async def test_the_consumer_wakes_for_the_first_item_then_every_n_items_or_the_end():
    channel = ReplyChannel[int](wake_every=3)
    batches: list[list[int]] = []

    async def consume():
        async for item in channel:
            batches.append([item, *channel.take_ready()])

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        channel.put(1)  # the first item: at once (time to first token)
        await anyio.wait_all_tasks_blocked()
        assert batches == [[1]]
        channel.put(2)
        channel.put(3)
        await anyio.wait_all_tasks_blocked()
        assert batches == [[1]]  # two waiting: not yet
        channel.put(4)
        await anyio.wait_all_tasks_blocked()
        assert batches == [[1], [2, 3, 4]]
        channel.put(5)
        channel.put(6, urgent=True)  # a terminal event does not wait for company
        await anyio.wait_all_tasks_blocked()
        assert batches == [[1], [2, 3, 4], [5, 6]]
        channel.put(7)
        channel.close_producer()
    assert batches == [[1], [2, 3, 4], [5, 6], [7]]


async def test_a_whole_reply_channel_wakes_only_at_its_end():
    channel = ReplyChannel[int](producers=2, wake_every=None)
    received: list[int] = []

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume_into, channel, received)
        await anyio.wait_all_tasks_blocked()
        channel.put(0)  # the first item still wakes it
        await anyio.wait_all_tasks_blocked()
        for i in range(1, 5):
            channel.put(i)
        await anyio.wait_all_tasks_blocked()
        assert received == [0]
        channel.close_producer()
        await anyio.wait_all_tasks_blocked()
        assert received == [0]  # one producer is left
        channel.close_producer()
    assert received == [0, 1, 2, 3, 4]


async def test_the_channel_has_ended_once_its_items_are_taken_and_its_producers_closed():
    channel = ReplyChannel[int](producers=2)
    assert not channel.ended
    channel.put(1)
    channel.close_producer()
    channel.close_producer()
    assert not channel.ended  # an item is still queued
    assert channel.take_ready() == [1]
    assert channel.ended
    gone = ReplyChannel[int]()
    gone.close()  # the consumer left
    assert gone.ended
