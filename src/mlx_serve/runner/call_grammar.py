"""Grammars for JSON tool calls between one-token markers.

Strict functions' calls (``compile_lazy_calls``): the reply's text is free, with no mask,
so free text costs no grammar work a token. Once the model samples its tool-call start
marker, a fresh matcher of the call's grammar (the JSON of one call, then the end
marker) masks every token until the end marker; then the text is free again. This is
llama.cpp's lazy grammar: inactive until its trigger token.

A JSON response_format beside tools (``compile_answer_or_calls``): the reply is the
answer in its schema, or calls between the markers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import llguidance
import mlx.core as mx

from mlx_serve.runner.structured import (
    JSON_OPTIONS,
    CompiledFormat,
    StructuredOutputError,
    compile_response_format,
    new_tokens,
    schema_of,
)


def compile_lazy_calls(tokenizer: Any, spec: dict, vocab_size: int) -> LazyCallFormat:
    """``spec``: ``{"type": "tool_calls", "start": id, "end": id, "schema": {...}}``, the
    markers' token ids and the JSON schema of one call. Raises StructuredOutputError for
    a schema the grammar library cannot enforce."""
    start, end = int(spec["start"]), int(spec["end"])
    call = _compile_lark(tokenizer, vocab_size, "a strict function's parameters", [
        f"start: GAP body GAP <[{end}]>",
        *_call_rules(spec["schema"])])
    return LazyCallFormat(call, start, end)


def compile_answer_or_calls(tokenizer: Any, spec: dict, vocab_size: int) -> CompiledFormat:
    """A JSON ``response_format`` (``spec["answer"]``) beside tool calls: the reply is the
    answer, or one or more calls between the markers, each held to its schema (as
    OpenAI's models may call tools before the structured answer)."""
    answer = {"x-guidance": JSON_OPTIONS, **schema_of(spec["answer"])}
    return _compile_lark(tokenizer, vocab_size, "the response format or the tools", [
        "start: answer | call+",
        f"answer: %json {json.dumps(answer)}",
        f"call: <[{int(spec['start'])}]> GAP body GAP <[{int(spec['end'])}]> GAP",
        *_call_rules(spec["schema"])])


def _call_rules(call_schema: dict) -> list[str]:
    # The compact JSON of response_format: free whitespace lets a small model loop on it.
    schema = {"x-guidance": JSON_OPTIONS, **call_schema}
    return ["GAP: /[ \\t\\r\\n]{0,4}/",  # templates put a newline around a call's JSON
            f"body: %json {json.dumps(schema)}"]


def _compile_lark(tokenizer: Any, vocab_size: int, what: str, rules: list[str]
                  ) -> CompiledFormat:
    grammar = "\n".join(["%llguidance {}", *rules])
    try:
        return compile_response_format(tokenizer, {"type": "lark", "lark": grammar},
                                       vocab_size)
    except StructuredOutputError as exc:  # name the schemas, not the grammar's line
        reason = re.sub(r"^invalid grammar: at \d+\(\d+\): ", "", str(exc))
        raise StructuredOutputError(f"{what} cannot be enforced: {reason}") from None


class LazyCallFormat:
    """A call's compiled grammar and the markers that open and close a call; immutable
    and shared between requests, like a CompiledFormat."""

    def __init__(self, call: CompiledFormat, start: int, end: int) -> None:
        self.call = call  # from after the start marker to the end marker, included
        self.start = start
        self.end = end

    def make_processor(self, prompt_len: int) -> _LazyCallProcessor:
        return self.make_processor_at(prompt_len, ())

    def make_processor_at(self, prompt_len: int, generated: Sequence[int]
                          ) -> _LazyCallProcessor:
        """A fresh processor that has already read ``generated`` (a request replayed into
        a fresh batch); raises RuntimeError if those tokens break a call's grammar."""
        processor = _LazyCallProcessor(self, prompt_len)
        processor.read(list(generated))
        return processor


class _LazyCallProcessor:
    """Per request: where the reply is (in a call or not) and the call's matcher."""

    __slots__ = ("_fmt", "_prompt_len", "_consumed", "_matcher", "_mask")

    def __init__(self, fmt: LazyCallFormat, prompt_len: int) -> None:
        self._fmt = fmt
        self._prompt_len = prompt_len
        self._consumed = 0
        self._matcher: llguidance.LLMatcher | None = None  # None: free text
        self._mask: mx.array | None = None  # the open call's, for its current state

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = new_tokens(tokens, self._prompt_len, self._consumed)
        if new:
            self.read(new)
        if self._matcher is None:
            return logits
        if self._mask is None:
            self._mask = self._fmt.call.mask(self._matcher)
        return mx.where(self._mask, logits, -mx.inf)

    def read(self, new: list[int]) -> None:
        """Follow the sampled tokens: a start marker opens a call, whose tokens the
        matcher checks, up to its end marker."""
        self._consumed += len(new)
        for token in new:
            if self._matcher is None:
                if token == self._fmt.start:
                    self._matcher = self._fmt.call.fresh_matcher()
                    self._mask = None
                continue
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"sampled token breaks a strict tool call: "
                                   f"{self._matcher.get_error().splitlines()[0]}")
            self._mask = None
            if token == self._fmt.end:
                self._matcher = None
