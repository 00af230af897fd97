"""OpenAI reply objects, built as plain dicts: chunks, whole completions, logprobs, tools.

This is the per-token hot path of streaming: no pydantic validation of our own output.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from mlx_serve.generation import Delta, PromptLogprobs, TokenLogprob
from mlx_serve.text_offsets import TextOffsets, prompt_offsets
from mlx_serve.tool_calls import CallUpdate, ToolCallStream


def legacy_token(text: str, raw: tuple[int, ...]) -> str:
    """A token as OpenAI's legacy logprobs write it: its text, or, for a piece of a
    character (no whole UTF-8 alone, its text U+FFFD), its bytes as ``bytes:\\xe2\\x80``,
    so that different pieces keep different keys in ``top_logprobs``."""
    if "\ufffd" not in text:
        return text
    try:
        bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _text_keyed(chosen: TokenLogprob, k: int) -> dict[str, float]:
    """The legacy ``top_logprobs`` entry: the ``k`` likeliest and the chosen token, by
    text (``legacy_token``); of tokens with one text the likeliest's."""
    top: dict[str, float] = {}
    for text, raw, value in chosen.top[:k]:  # likeliest first
        top.setdefault(legacy_token(text, raw), value)
    top.setdefault(legacy_token(chosen.token, chosen.bytes), chosen.logprob)
    return top


def vllm_prompt_logprobs(scores: PromptLogprobs) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has none), its own entry
    and its alternatives', keyed by token id, each with its log-probability, its rank in
    the vocabulary and its text."""
    out: list[dict[str, dict] | None] = [None]
    for i, t in enumerate(scores.scored):
        entry = {str(scores.ids[i]): {"logprob": t.logprob, "rank": scores.ranks[i],
                                      "decoded_token": t.token}}
        for rank, (token_id, (text, _, value)) in enumerate(zip(scores.top_ids[i], t.top,
                                                                strict=True), 1):
            entry.setdefault(str(token_id), {"logprob": value, "rank": rank,
                                             "decoded_token": text})
        out.append(entry)
    return out


def chat_logprob(t: TokenLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
            "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(b)}
                             for s, b, lp in t.top]}


@dataclass
class Choice:
    """One choice's progress: what was sent, and what a whole reply needs."""

    index: int
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    text_offsets: TextOffsets = field(default_factory=TextOffsets)
    tokens: int = 0
    reasoning_tokens: int = 0  # of ``tokens``, those spent on reasoning
    # Tokens that wrote no text of their own yet (part of a character, a marker): they
    # count with the next token that does, or with the last one at the end.
    undecided_tokens: int = 0
    reasoning_last: bool = False  # whether the last text written was reasoning
    # How many reasoning pieces came before the reply's answer began, its first text or
    # tool call (None: not yet): reasoning written after that is listed after the answer's
    # items in a Response, in an item of its own.
    reasoning_before_answer: int | None = None
    cached_tokens: int = 0
    finish: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # echo with logprobs: the prompt's own
    call_stream: ToolCallStream | None = None  # made at the choice's first tool-call text

    def call_complete(self, position: int) -> bool:
        """Whether the call's arguments were written to their end (not cut off)."""
        return self.call_stream is None or position not in self.call_stream.cut_off


def _count_reasoning(choice: Choice, delta: Delta) -> None:
    """Count a delta's tokens as reasoning or not: by the text they wrote (a step that
    also wrote the answer counts as the answer's), and those that wrote none by the
    next text (the character they are part of), or by the last at the reply's end."""
    if delta.reasoning or delta.text or delta.tool_calls or delta.tool_text:
        choice.reasoning_last = bool(delta.reasoning) and not delta.text
        if choice.reasoning_last:
            choice.reasoning_tokens += delta.token_count + choice.undecided_tokens
        choice.undecided_tokens = 0
    else:
        choice.undecided_tokens += delta.token_count
    if delta.finish_reason is not None and choice.reasoning_last:
        choice.reasoning_tokens += choice.undecided_tokens
        choice.undecided_tokens = 0


def reply_items(choices: list[Choice]) -> int:
    """How much a whole reply holds: its tokens and their logprob alternatives."""
    return sum(c.tokens + len(c.logprobs) * len(c.logprobs[0].top if c.logprobs else ())
               for c in choices)


@dataclass
class ReplyShape:
    """Everything about one HTTP request's reply that is fixed before generation."""

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    # vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far.
    continuous_usage: bool = False
    # Each prompt's tokens (several prompts in one completion request), for that usage;
    # ``prompt_tokens`` is the request's, all prompts together.
    prompt_lengths: tuple[int, ...] = ()
    choices_per_prompt: int = 1  # ``n``: choice i answers prompt i // n
    logprobs: int | None = None
    reasoning_format: str = "reasoning"
    tool_parser: Any = None
    tools: list[dict] | None = None
    one_tool_call: bool = False  # parallel_tool_calls false: a span's later calls dropped
    echo: dict[int, str] = field(default_factory=dict)  # completions: each choice's prompt
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's scores in the reply
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _text_frames: dict[int, tuple[str, ...]] = field(default_factory=dict, repr=False)

    # -- shared pieces -----------------------------------------------------------------

    def absorb(self, choice: Choice, delta: Delta) -> list[CallUpdate]:
        """Record a delta in ``choice``; return what it changed in its tool calls."""
        choice.tokens += delta.token_count
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
            # The generated tokens' offsets index the reply's text, which starts with it.
            choice.text_offsets = TextOffsets(len(self.echo.get(choice.index, "")))
        choice.content.append(delta.text)
        if delta.text and not delta.reasoning:  # most tokens: the answer's text
            choice.reasoning_last, choice.undecided_tokens = False, 0
        else:
            if delta.reasoning:
                choice.reasoning.append(delta.reasoning)
            _count_reasoning(choice, delta)
        if choice.reasoning_before_answer is None and (
                delta.text or delta.tool_calls or delta.tool_text):
            choice.reasoning_before_answer = len(choice.reasoning)
        calls: list[CallUpdate] = []
        if (delta.tool_calls or delta.tool_text) and self.tool_parser is not None:
            if choice.call_stream is None:
                choice.call_stream = ToolCallStream(self.tool_parser, self.tools,
                                                    self.one_tool_call)
            calls = choice.call_stream.update(choice.tool_calls, delta.tool_calls,
                                              delta.tool_text)
        if delta.logprobs and not self.chat:
            choice.offsets += choice.text_offsets.add(delta.logprobs, delta.text)
        choice.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            choice.cached_tokens = delta.cached_tokens
            choice.finish = delta.finish_reason.value
            # A reply whose last call was cut off ended for another reason than its calls.
            if choice.finish == "stop" and choice.tool_calls and choice.call_complete(
                    len(choice.tool_calls) - 1):
                choice.finish = "tool_calls"
        return calls

    def _reasoning_fields(self, text: str) -> dict[str, str]:
        if self.reasoning_format == "both":
            return {"reasoning": text, "reasoning_content": text}
        return {self.reasoning_format: text}

    def _logprobs_object(self, items: list[TokenLogprob], offsets: list[int],
                         prompt: PromptLogprobs | None = None, echo: str = ""
                         ) -> dict | None:
        """The ``logprobs`` of a choice's tokens; for a completion with ``prompt``, those
        of the echoed prompt's tokens first (its first token has no log-probability)."""
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": [chat_logprob(t) for t in items]}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        if prompt is not None:
            tokens.append(legacy_token(prompt.first_token, prompt.first_bytes))
            values.append(None)
            tops.append(None)
            first = TokenLogprob(prompt.first_token, prompt.first_bytes, 0.0)
            text_offset = prompt_offsets(first, prompt.scored, echo)
            items = [*prompt.scored, *items]
        tokens += [legacy_token(t.token, t.bytes) for t in items]
        values += [t.logprob for t in items]
        # The prompt may have been scored with more alternatives (for prompt_logprobs).
        # The chosen token is always among them, as OpenAI's legacy API promises ("up to
        # logprobs+1 elements") and vLLM does, even where it is not among the likeliest.
        tops += [_text_keyed(t, self.logprobs) for t in items]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": text_offset + offsets}

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        completion_tokens = sum(c.tokens for c in choices)
        # Choices of one prompt share its prefill: its best reuse counts, for each prompt.
        best: dict[int, int] = {}
        for c in choices:
            prompt = c.index // self.choices_per_prompt
            best[prompt] = max(best.get(prompt, 0), c.cached_tokens)
        cached = sum(best.values())
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": self.prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.chat:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
        return usage

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    # -- streaming -----------------------------------------------------------------------

    def _envelope(self, choices: list[dict], completion_tokens: int = 0) -> dict:
        body = {"id": self.id, "object": self._object(chunk=True), "created": self.created,
                "model": self.model, "choices": choices}
        if self.continuous_usage:  # as vLLM: the choice's own prompt and tokens so far
            at = choices[0]["index"] // self.choices_per_prompt
            prompt = (self.prompt_lengths[at] if at < len(self.prompt_lengths)
                      else self.prompt_tokens)
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                             "total_tokens": prompt + completion_tokens}
        elif self.include_usage:
            body["usage"] = None
        return body

    @property
    def echo_waits_for_scores(self) -> bool:
        """Whether echoed prompts carry logprobs, which come with a choice's first delta."""
        return bool(self.echo) and self.logprobs is not None

    def echo_chunk(self, index: int, prompt: str, scores: PromptLogprobs | None = None
                   ) -> dict:
        """A completion's echoed prompt, its choice's first chunk."""
        logprobs = None if scores is None else self._logprobs_object([], [], scores, prompt)
        return self._envelope([{"index": index, "text": prompt, "logprobs": logprobs,
                                "finish_reason": None}])

    def role_chunk(self, index: int, content: str | None = "") -> dict:
        """The first chunk: ``content`` null where the reply opens with a tool call, as
        OpenAI's does (the SDKs then end such a reply with content None, as whole)."""
        return self._envelope([{"index": index,
                                "delta": {"role": "assistant", "content": content},
                                "logprobs": None, "finish_reason": None}])

    def text_chunk(self, index: int, text: str) -> str:
        """The JSON of a chunk that only carries text: the common case, built from a
        cached frame so that only the text itself is encoded per token."""
        frame = self._text_frames.get(index)
        if frame is None:
            marker = "\u0000MARK\u0000"
            key = "delta" if self.chat else "text"
            item: dict[str, Any] = {"index": index,
                                    key: {"content": marker} if self.chat else marker,
                                    "logprobs": None, "finish_reason": None}
            frame = self._text_frames[index] = tuple(
                json.dumps(self._envelope([item])).split(json.dumps(marker)))
        # json.dumps of a string with its defaults, without its two Python-level calls
        return encode_basestring_ascii(text).join(frame)

    def delta_chunk(self, choice: Choice, delta: Delta, updates: list[CallUpdate]
                    ) -> str | None:
        """The JSON of the chunk for one delta (None when it carries nothing to send)."""
        if (delta.text and choice.finish is None and not updates and not delta.reasoning
                and not delta.logprobs and not self.continuous_usage):
            return self.text_chunk(choice.index, delta.text)
        logprobs = self._logprobs_object(list(delta.logprobs),
                                         choice.offsets[len(choice.offsets)
                                                        - len(delta.logprobs):])
        finish = choice.finish
        if self.chat:
            body: dict[str, Any] = {}
            if delta.text:
                body["content"] = delta.text
            if delta.reasoning:
                body.update(self._reasoning_fields(delta.reasoning))
            calls = [_call_delta(choice.tool_calls, u) for u in updates
                     if u.opened or u.arguments]
            if calls:
                body["tool_calls"] = calls
            if not body and finish is None and not delta.logprobs:
                return None
            item = {"index": choice.index, "delta": body, "logprobs": logprobs,
                    "finish_reason": finish}
        else:
            if not delta.text and finish is None and not delta.logprobs:
                return None
            item = {"index": choice.index, "text": delta.text, "logprobs": logprobs,
                    "finish_reason": finish}
        return json.dumps(self._envelope([item], choice.tokens))

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {"id": self.id, "object": self._object(chunk=True), "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage(choices)}

    # -- whole replies -----------------------------------------------------------------

    def completion(self, choices: list[Choice]) -> dict:
        items = []
        for c in sorted(choices, key=lambda c: c.index):
            echoed = c.prompt_logprobs if c.index in self.echo else None
            logprobs = self._logprobs_object(c.logprobs, c.offsets, echoed,
                                             self.echo.get(c.index, ""))
            if self.chat:
                message: dict[str, Any] = {"role": "assistant",
                                           "content": "".join(c.content) or None}
                if c.reasoning:
                    message.update(self._reasoning_fields("".join(c.reasoning)))
                if c.tool_calls:
                    message["tool_calls"] = c.tool_calls
                elif message["content"] is None:
                    message["content"] = ""
                items.append({"index": c.index, "message": message, "logprobs": logprobs,
                              "finish_reason": c.finish})
            else:
                items.append({"index": c.index,
                              "text": self.echo.get(c.index, "") + "".join(c.content),
                              "logprobs": logprobs, "finish_reason": c.finish})
                if self.prompt_logprobs is not None and c.prompt_logprobs is not None:
                    items[-1]["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs)
        body = {"id": self.id, "object": self._object(chunk=False), "created": self.created,
                "model": self.model, "choices": items, "usage": self.usage(choices)}
        scored = [c.prompt_logprobs for c in choices if c.prompt_logprobs is not None]
        if self.chat and self.prompt_logprobs is not None and scored:
            body["prompt_logprobs"] = vllm_prompt_logprobs(scored[0])  # one prompt: vLLM's place
        return body


def _call_delta(calls: list[dict], update: CallUpdate) -> dict:
    """A chat chunk's ``tool_calls`` item: a call's id and name with its first arguments,
    then only its arguments, as OpenAI streams them."""
    if not update.opened:
        return {"index": update.position, "function": {"arguments": update.arguments}}
    call = calls[update.position]
    return {"index": update.position, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": update.arguments}}
