"""A format that applies once the reply's reasoning span has ended.

A chat template may open a reasoning span (``<think>``) at the end of the prompt. A
format enforced from the reply's first token would then put the JSON inside the
reasoning and leave the answer empty. Here the reasoning is free (no mask), and the
format's processor starts at the token after the span's end marker, as vLLM's structured
outputs wait for its reasoning parser's end of reasoning (``AfterReasoningFormat``). A
model that opens the span itself may do so with its first token; the format then waits
for the span's end the same way (``MayReasonFirstFormat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlx_serve.runner.structured import new_tokens


class AfterReasoningFormat:
    """A format for a reply that starts inside a reasoning span (the template opened it):
    the reasoning is free, and the format applies from the token after its end marker,
    as vLLM's structured outputs wait for a reasoning parser's end of reasoning."""

    def __init__(self, inner: Any, think_end: int) -> None:
        self.inner = inner  # a CompiledFormat or LazyCallFormat
        self.think_end = think_end

    def make_processor(self, prompt_len: int) -> _AfterReasoningProcessor:
        return self.make_processor_at(prompt_len, ())

    def make_processor_at(self, prompt_len: int, generated: Sequence[int]
                          ) -> _AfterReasoningProcessor:
        processor = _AfterReasoningProcessor(self, prompt_len)
        processor.read(list(generated))  # a replay: past the reasoning, the format wakes
        return processor


class _AfterReasoningProcessor:
    """Asleep (logits untouched) until the reasoning's end marker, then the format's."""

    __slots__ = ("_fmt", "_prompt_len", "_consumed", "_inner")

    def __init__(self, fmt: AfterReasoningFormat, prompt_len: int) -> None:
        self._fmt = fmt
        self._prompt_len = prompt_len
        self._consumed = 0  # generated tokens read while asleep
        self._inner: Any = None  # the format's processor, once awake

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._inner is None:
            self.read(new_tokens(tokens, self._prompt_len, self._consumed))
            if self._inner is None:
                return logits
        return self._inner(tokens, logits)

    def read(self, new: list[int]) -> None:
        """Follow the reasoning; at its end marker the format's processor starts, having
        read what came after the marker."""
        if self._fmt.think_end not in new:
            self._consumed += len(new)
            return
        at = new.index(self._fmt.think_end) + 1
        self._inner = self._fmt.inner.make_processor_at(
            self._prompt_len + self._consumed + at, new[at:])


class MayReasonFirstFormat:
    """A format for a model that opens its own reasoning span (Qwen3 writes ``<think>``
    itself): its first token may be the span's start marker, besides the format's own;
    the span is then free, and the format applies after it."""

    def __init__(self, inner: Any, think_start: int, think_end: int) -> None:
        self.inner = inner
        self.think_start = think_start
        self.after = AfterReasoningFormat(inner, think_end)

    def make_processor(self, prompt_len: int) -> _MayReasonFirstProcessor:
        return self.make_processor_at(prompt_len, ())

    def make_processor_at(self, prompt_len: int, generated: Sequence[int]
                          ) -> _MayReasonFirstProcessor:
        processor = _MayReasonFirstProcessor(self, prompt_len)
        if generated:
            processor.decide(list(generated))
        return processor


class _MayReasonFirstProcessor:
    """Until the first token is read: the format's mask plus the reasoning's start marker;
    then the format's processor, or the one that waits for the span's end."""

    __slots__ = ("_fmt", "_prompt_len", "_deciding", "_processor")

    def __init__(self, fmt: MayReasonFirstFormat, prompt_len: int) -> None:
        self._fmt = fmt
        self._prompt_len = prompt_len
        self._deciding = True
        self._processor: Any = fmt.inner.make_processor_at(prompt_len, ())

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._deciding:
            generated = new_tokens(tokens, self._prompt_len, 0)
            if not generated:  # the first token: either way is open
                masked = self._processor(tokens, logits)
                opener = mx.arange(logits.shape[-1]) == self._fmt.think_start
                return mx.where(opener, logits, masked)
            self.decide(generated)
        return self._processor(tokens, logits)

    def decide(self, generated: list[int]) -> None:
        """The first tokens read: a reasoning span opened, or the format began."""
        self._deciding = False
        if generated[0] == self._fmt.think_start:
            self._processor = self._fmt.after.make_processor_at(self._prompt_len + 1,
                                                                generated[1:])
        else:
            self._processor = self._fmt.inner.make_processor_at(self._prompt_len, generated)
