"""Scenario 8: the mlx-lm #1505 seed, without fail points.

In mlx_lm.server a request without logits processors and one with them (e.g.
``repetition_penalty``) finishing prefill in the same step raised ``TypeError:
'NoneType' object is not iterable`` in the generation thread, and the server went
zombie. Here request A has a long prompt (~1200 tokens, prefilled 32 tokens per step)
and no penalties; requests with ``repetition_penalty``, other penalties and
``logit_bias`` arrive with it, while it is prefilling, and while it is decoding. All must
complete and the server must stay healthy without ever needing a recovery.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.faults.harness import (
    Reply,
    assert_one_terminal,
    assert_serves,
    complete_chat,
    http_client,
    stream_chat,
)
from tests.faults.server_watch import assert_log_clean, health, wait_until

pytestmark = pytest.mark.anyio

LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~1200 tokens
# Round 2 needs other prompts: a prefix cache would skip the prefill of a repeated one.
LONG_2 = "Paris is a city on the river Seine, and it is known for its museums. " * 40


def body(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 24,
            "temperature": 0, **extra}




def penalised(text: str) -> list[dict[str, Any]]:
    return [
        body(text * 1, repetition_penalty=1.3),
        body(text * 4, logit_bias={"5": 2.0, "7": -5.0}),
        body(text * 8, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    ]

DECODING = body("a request arriving while A decodes " * 5, repetition_penalty=1.5,
                logit_bias={"9": 1.0})


def assert_completed(replies: list[Reply]) -> None:
    for reply in replies:
        assert_one_terminal(reply)
        assert reply.completed and reply.text, reply.describe()


async def test_mixed_logits_processors_prefilling_together_all_complete(
        launch, reference, model_name):
    server = launch("--prefill-step-size", "32")
    with anyio.fail_after(60):
        async with http_client(server) as client:
            # Round 1: all at once, so their prefills overlap from the first step.
            replies: list[Reply] = []

            async def run(b: dict[str, Any], stream: bool,
                          on_content: anyio.Event | None = None) -> None:
                replies.append(await stream_chat(client, b, on_content=on_content) if stream
                               else await complete_chat(client, b))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, body(LONG), True)
                for i, b in enumerate(penalised("short prompt with a penalty ")):
                    tg.start_soon(run, b, i % 2 == 1)
            assert len(replies) == 4
            assert_completed(replies)

            # Round 2: staggered. Penalised requests arrive while A is still prefilling
            # (A's steps are running and it has no text yet), another once A decodes.
            replies.clear()
            a_decoding = anyio.Event()
            _, before = await health(client)
            sent_during_prefill = False
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, body(LONG_2), True, a_decoding)

                async def a_prefilling() -> bool:
                    _, now = await health(client)
                    return a_decoding.is_set() or now["steps"] >= before["steps"] + 3

                await wait_until(a_prefilling, 10, "A's prefill to start")
                sent_during_prefill = not a_decoding.is_set()
                for i, b in enumerate(penalised("another prompt, penalised: ")):
                    tg.start_soon(run, b, i % 2 == 0)
                await a_decoding.wait()
                tg.start_soon(run, DECODING, True)
            assert len(replies) == 5
            assert_completed(replies)
            assert sent_during_prefill, "A finished prefill before the others were sent"
            status, stats = await health(client)

    assert status == 200 and stats["state"] == "ready", stats
    assert stats["recoveries"] == 0 and stats["isolated"] == 0, stats
    await assert_serves(server, reference, model_name)
    assert_log_clean(server)
