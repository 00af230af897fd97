"""Where a prompt is rendered and tokenized: short text on the event loop, long in a thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from mlx_serve.protocol import ChatCompletionRequest, CompletionRequest
from mlx_serve.request_building import (
    INLINE_TEXT_CHARS,
    ITEM_OVERHEAD_CHARS,
    _chat_chars,
    _completion_prompts,
    off_loop_if_long,
)

pytestmark = pytest.mark.anyio


async def test_short_input_stays_on_the_event_loop_and_long_input_goes_to_a_thread():
    loop_thread = threading.get_ident()
    assert await off_loop_if_long(INLINE_TEXT_CHARS, threading.get_ident) == loop_thread
    assert await off_loop_if_long(INLINE_TEXT_CHARS + 1, threading.get_ident) != loop_thread
    assert await off_loop_if_long(None, threading.get_ident) != loop_thread


def chat(**body: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body)


def test_a_chat_counts_every_message_its_template_renders():
    body = chat(messages=[
        {"role": "system", "content": "s" * 10},
        {"role": "user", "content": [{"type": "text", "text": "u" * 20}]},
        {"role": "assistant", "content": None, "reasoning_content": "r" * 30, "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": "a" * 40}}]},
    ])
    assert _chat_chars(body) == 100 + 3 * ITEM_OVERHEAD_CHARS


def test_many_short_messages_are_rendered_off_the_event_loop():
    body = chat(messages=[{"role": "user", "content": ""}] * 100)
    assert _chat_chars(body) > INLINE_TEXT_CHARS


def test_a_chat_with_tools_is_never_rendered_on_the_event_loop():
    body = chat(messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert _chat_chars(body) is None



class RecordingEncoder:
    """Encodes every text as one token and remembers the thread that did it."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def __call__(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1]

    async def encode_soon(self, text: str) -> list[int]:  # PromptEncoder's, in place
        return self(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:  # PromptEncoder's
        return [self(text) for text in texts]


async def test_a_few_short_prompts_are_encoded_on_the_loop_and_many_in_a_thread():
    tokenizer = RecordingEncoder()
    runner = SimpleNamespace(encode=tokenizer, vocab_size=10)
    loop_thread = threading.get_ident()
    await _completion_prompts(CompletionRequest.model_validate({"prompt": ["a", "b"]}), runner)
    assert tokenizer.threads == [loop_thread, loop_thread]
    tokenizer.threads.clear()
    await _completion_prompts(CompletionRequest.model_validate({"prompt": ["a"] * 100}), runner)
    assert len(tokenizer.threads) == 100 and loop_thread not in tokenizer.threads


async def test_short_chats_arriving_together_are_encoded_in_one_batch(tiny_model_dir):
    """Rendered and encoded together off the loop, to the same tokens."""
    from mlx_lm.tokenizer_utils import load

    from mlx_serve.prompt_encoder import PromptEncoder
    from mlx_serve.prompts import render_chat
    from mlx_serve.request_building import _rendered

    tokenizer = load(tiny_model_dir)
    encode = PromptEncoder(tokenizer)
    batches: list[int] = []
    backend = encode._backend
    encode._backend = SimpleNamespace(
        encode=backend.encode,
        encode_batch=lambda texts, **kw: batches.append(len(texts))
        or backend.encode_batch(texts, **kw))
    runner = SimpleNamespace(tokenizer=tokenizer, encode=encode)
    bodies = [chat(messages=[{"role": "user", "content": f"question {i}"}]) for i in range(5)]
    rendered = await asyncio.gather(*(_rendered(body, runner) for body in bodies))
    assert batches == [5]
    assert [r.tokens for r in rendered] == [
        render_chat(tokenizer, PromptEncoder(tokenizer), body).tokens for body in bodies]
    # A chat its template refuses fails alone, the others of its burst answered.
    refused = chat(messages=[{"role": "user", "content": "hi"}],
                   add_generation_prompt=True, continue_final_message=True)
    results = await asyncio.gather(_rendered(bodies[0], runner), _rendered(refused, runner),
                                   return_exceptions=True)
    assert results[0].tokens == rendered[0].tokens
    assert "continue_final_message" in str(results[1])
