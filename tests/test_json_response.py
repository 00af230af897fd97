"""Whole replies are written even when a model's tool call holds half a surrogate pair, and
large ones are built off the event loop, encoded a slice at a time, to the same bytes."""

from __future__ import annotations

import gc
import json
import threading

import anyio
import pytest
from mlx_lm.tool_parsers import pythonic

from mlx_serve.json_response import (
    LARGE_REPLY_ITEMS,
    SLICE_ITEMS,
    JSONResponse,
    json_reply,
    render_in_slices,
)
from mlx_serve.tool_calls import parse_tool_calls


def test_text_goes_out_as_utf8():
    assert JSONResponse({"text": "é😀"}).body == '{"text":"é😀"}'.encode()


def test_a_lone_surrogate_goes_out_escaped():
    """Python's reading of "\\ud83d" is a str no UTF-8 can hold: the body is ASCII JSON."""
    (call,) = parse_tool_calls(pythonic.parse_tool_call, None, '[look(q="\\ud83d!")]')
    body = JSONResponse({"tool_calls": [call]}).body
    assert b"\\ud83d" in body
    assert json.loads(body)["tool_calls"][0]["function"]["arguments"] == call["function"][
        "arguments"]


def _logprob(i: int) -> dict:
    return {"token": f"t{i}é", "logprob": -i / 7, "bytes": [116],
            "top_logprobs": [{"token": f"a{j}", "logprob": -j / 3, "bytes": [97]}
                             for j in range(3)]}


LARGE = {"id": "x", "choices": [
    {"index": c, "message": {"role": "assistant", "content": 'hé\n"q"', "tool_calls": []},
     "logprobs": {"content": [_logprob(i) for i in range(SLICE_ITEMS * 2 + 7)]},
     "finish_reason": None} for c in range(3)],
    "usage": {"prompt_tokens": 1}, "nested": [[1] * (SLICE_ITEMS + 1), [2] * 3], "e": [],
    "d": {}, "f": 1.5, "t": True}


@pytest.mark.parametrize("content", [
    LARGE, {}, [], [None] * (SLICE_ITEMS * 3), {"a": [{"b": list(range(SLICE_ITEMS + 1))}]},
    {"s": "\ud83d"}, [["\ud83d"] * (SLICE_ITEMS + 1)], "plain"])
def test_slices_render_the_bytes_of_one_call(content):
    assert render_in_slices(content) == JSONResponse(content).body


@pytest.mark.anyio
async def test_a_large_reply_is_built_off_the_event_loop():
    threads = []

    def build(value: dict) -> dict:
        threads.append(threading.get_ident())
        return value

    small = await json_reply(LARGE_REPLY_ITEMS, lambda: build({"a": 1}), "r1")
    large = await json_reply(LARGE_REPLY_ITEMS + 1, lambda: build(LARGE), "r2")
    assert threads[0] == threading.get_ident() != threads[1]
    assert small.body == b'{"a":1}'
    assert large.body == JSONResponse(LARGE).body
    assert large.media_type == "application/json"
    assert (small.headers["x-request-id"], large.headers["x-request-id"]) == ("r1", "r2")


@pytest.mark.anyio
async def test_the_collector_is_off_while_any_large_reply_is_built():
    """Two large replies at once: the collector stays off until the second is done."""
    first_building, second_done, seen = threading.Event(), threading.Event(), []

    def first() -> dict:
        seen.append(gc.isenabled())
        first_building.set()
        assert second_done.wait(10)
        seen.append(gc.isenabled())  # the second finished; this one still builds
        return {"a": 1}

    def second() -> dict:
        assert first_building.wait(10)
        seen.append(gc.isenabled())
        return {"b": 2}

    assert gc.isenabled()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(json_reply, LARGE_REPLY_ITEMS + 1, first, "r4")
            await anyio.to_thread.run_sync(first_building.wait, 10)
            await json_reply(LARGE_REPLY_ITEMS + 1, second, "r3")
            second_done.set()
    assert seen == [False, False, False]
    assert gc.isenabled()
