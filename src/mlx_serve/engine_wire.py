"""The messages between the HTTP process and the engine process, and their framing.

Each message is a tuple whose first item names it, pickled and sent with a 4-byte
length in front, over a socket pair that only the two processes hold.

    front ──► engine   ("submit", hid, requests)      a handle's requests (choices)
                       ("close", hid)                  the client has gone
                       ("drain",) ("abort",)           as Engine.begin_drain / abort
                       ("failpoint", site, action)     runtime fail points (None clears)
    engine ──► front   ("ready", EngineInfo)           the model is loaded
                       ("events", events, stats)       one per actor turn: every handle's
                                                       new events, then a statistics snapshot
                       ("stats", stats)                a heartbeat while nothing else is said

``events`` is a list of ``(hid, event)``; event None ends the handle's stream. A
``stats`` is ``(EngineStatistics, memory)``. The common delta (text and a
token count, nothing else) travels as a plain tuple: pickling a slotted dataclass runs
Python code per field, and a step at 128 streams carries 128 of them.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from mlx_serve.generation import Delta, FinishReason, ReplyEvent

HEADER = struct.Struct("!I")
HEARTBEAT_S = 0.5  # the engine reports at least this often, so the HTTP process sees a stall
MAX_MESSAGE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the HTTP process needs of the loaded model to build requests."""

    model_path: str
    context_length: int
    vocab_size: int
    pid: int


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """A ``response_format`` to compile in the engine process (compiled ones do not pickle)."""

    response_format: dict[str, Any]


def frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next message; None once the other side has closed its end."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"engine message of {size} bytes")
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def pack_event(event: ReplyEvent) -> Any:
    """A plain ``(text, token_count, finish, index)`` for a delta with nothing else."""
    if (isinstance(event, Delta) and not event.reasoning and not event.tool_calls
            and not event.tool_text and not event.logprobs and not event.cached_tokens
            and event.prompt_logprobs is None):
        finish = None if event.finish_reason is None else event.finish_reason.value
        return (event.text, event.token_count, finish, event.index)
    return event


def unpack_event(packed: Any) -> ReplyEvent:
    """The event ``pack_event`` sent (an end of stream, None, is not an event)."""
    if type(packed) is tuple:
        text, count, finish, index = packed
        return Delta(text, count, None if finish is None else FinishReason(finish), index)
    return packed
