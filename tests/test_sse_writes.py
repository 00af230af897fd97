"""The writes of a streamed reply: one for each step's tokens, the last one also carrying
the usage chunk, ``[DONE]`` and the end of the body (a short reply is mostly writes)."""

from __future__ import annotations

import json

import anyio
import pytest
from anyio.lowlevel import checkpoint

from mlx_serve.errors import MLXServeError
from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import Delta, Failure, FinishReason, ReplyEvent, TokenLogprob
from mlx_serve.replies import Choice, ReplyShape
from mlx_serve.reply_channel import ReplyChannel
from mlx_serve.request_handle import RequestHandle
from mlx_serve.streaming import SSEResponse, sse_events

pytestmark = pytest.mark.anyio

DONE = b"data: [DONE]\n\n"


class Stream:
    """One streamed completion, its events put by the test as the actor would."""

    def __init__(self) -> None:
        self.channel = ReplyChannel[ReplyEvent]()
        shape = ReplyShape(chat=False, model="m", prompt_tokens=3, include_usage=True)
        events = sse_events(RequestHandle("r", self.channel), shape, 1,
                            FailPoints.from_spec(None), None, ping_seconds=60.0)
        self.response = SSEResponse(events, "r1")
        self.sent: list[dict] = []

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        await checkpoint()

    @property
    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent
                if m["type"] == "http.response.body"]

    def data(self) -> list[str]:
        text = b"".join(body for body, _ in self.bodies).decode()
        return [frame.removeprefix("data: ") for frame in text.split("\n\n") if frame]


async def stream_steps(stream: Stream, steps: list[list[ReplyEvent]],
                       end_with_last_step: bool = True) -> None:
    """Each step's events put at once, the route left to write them before the next."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.response.stream_response, stream.send)
        for i, step in enumerate(steps):
            await anyio.wait_all_tasks_blocked()
            for event in step:
                stream.channel.put(event, urgent=i == len(steps) - 1)
            if i == len(steps) - 1 and end_with_last_step:
                stream.channel.close_producer()  # as the actor does, in the same turn
        await anyio.wait_all_tasks_blocked()
        if not end_with_last_step:  # the end comes later, as from an engine process
            stream.channel.close_producer()


def delta(text: str, finish: FinishReason | None = None) -> Delta:
    return Delta(text=text, token_count=1, finish_reason=finish)


async def test_the_last_write_carries_the_last_tokens_the_usage_and_the_end():
    stream = Stream()
    with anyio.fail_after(10):
        await stream_steps(stream, [[delta("a")], [delta("b")],
                                    [delta("c", FinishReason.LENGTH)]])
    assert stream.sent[0]["type"] == "http.response.start"
    bodies = stream.bodies
    assert len(bodies) == 3  # one write a step, no empty one to end the body
    assert [more for _, more in bodies] == [True, True, False]
    last = bodies[-1][0]
    assert last.endswith(DONE) and b'"finish_reason": "length"' in last
    assert b'"usage"' in last
    data = stream.data()
    assert [json.loads(d)["choices"][0]["text"] for d in data[:3]] == ["a", "b", "c"]
    assert json.loads(data[3])["usage"]["completion_tokens"] == 3
    assert data[4] == "[DONE]"


async def test_an_end_that_comes_after_the_last_tokens_is_written_with_the_usage():
    stream = Stream()
    with anyio.fail_after(10):
        await stream_steps(stream, [[delta("a")], [delta("b", FinishReason.STOP)]],
                           end_with_last_step=False)
    bodies = stream.bodies
    assert [more for _, more in bodies] == [True, True, False]
    assert bodies[-1][0].startswith(b'data: {"id"') and bodies[-1][0].endswith(DONE)
    assert b'"usage"' in bodies[-1][0]
    assert stream.data()[-1] == "[DONE]" and stream.data().count("[DONE]") == 1


async def test_a_failure_ends_the_stream_with_its_error_then_done():
    stream = Stream()
    with anyio.fail_after(10):
        await stream_steps(stream, [[delta("a")], [Failure(MLXServeError("boom"))]])
    data = stream.data()
    assert json.loads(data[1])["error"]["message"] == "boom"
    assert data[2:] == ["[DONE]"]  # no usage after a failure
    assert stream.bodies[-1] == (DONE, False)


def test_legacy_top_logprobs_keep_byte_pieces_apart_and_the_chosen_token():
    """Keys are texts, and byte pieces of different characters all read U+FFFD: those
    are keyed by their bytes, as OpenAI writes them (``bytes:\\xe2``), in ``tokens`` too.
    Of tokens that still share a text, the entry is the likeliest's; the chosen token is
    there beside the k likeliest."""
    bad = "\ufffd"
    shape = ReplyShape(chat=False, model="m", prompt_tokens=3, logprobs=2)
    choice = Choice(0)
    items = [TokenLogprob(bad, (0xE2,), -3.73, ((bad, (0xE2,), -3.73), (bad, (0xF0,), -3.88))),
             TokenLogprob("x", (120,), -5.0, (("a", (97,), -1.0), ("a", (97,), -2.0))),
             TokenLogprob(bad, (0xEF, 0xBF, 0xBD), -1.0, ((bad, (0xEF, 0xBF, 0xBD), -1.0),))]
    shape.absorb(choice, Delta("", 1, logprobs=(items[0],)))
    shape.absorb(choice, Delta("x", 1, logprobs=(items[1],)))
    shape.absorb(choice, Delta(bad, 1, FinishReason.LENGTH, logprobs=(items[2],)))
    lp = shape.completion([choice])["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"bytes:\\xe2": -3.73, "bytes:\\xf0": -3.88},
                                  {"a": -1.0, "x": -5.0}, {bad: -1.0}]
    # Before, both pieces were keyed U+FFFD: one entry where two were asked for.
    assert lp["tokens"] == ["bytes:\\xe2", "x", bad]  # a real U+FFFD stays itself
