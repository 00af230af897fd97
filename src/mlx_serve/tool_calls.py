"""A reply's tool calls, from the raw text of the model's tool-call spans.

A call in mlx-lm's ``json_tools`` format, ``{"name": ..., "arguments": {...}}``, is
followed while it is generated, as OpenAI and vLLM stream calls: it is announced (id and
name) as soon as its name is complete, and its arguments go out piece by piece, exactly as
the model writes them, up to the end of their JSON value. So a long call (a file's
contents, say) reaches the client as it is written, not all at once at its end, and a
whole reply carries the very same arguments as the stream. A call cut off by
``max_tokens`` keeps the arguments written so far, as OpenAI's do. Followed too: the
tagged formats of ``qwen3_coder``, ``glm47``, ``longcat`` and ``minimax_m2``
(``tool_calls_xml``), Kimi-K2's and Mistral's JSON arguments (``kimi_k2``, ``mistral``:
sent as written), Gemma 4's and FunctionGemma's (``tool_calls_gemma``), Kimi K3's
(``tool_calls_xtml``), MiniCPM5's (``tool_calls_minicpm``), Muse Spark's
(``tool_calls_atem``) and the Python calls of ``pythonic`` (``tool_calls_pythonic``).

A call written in another shape (JSON with ``arguments`` first, a list of calls), or in
a format none of these follows, is parsed by the model family's mlx-lm parser once
complete and goes out whole.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_serve.call_scanner import (
    CallScanner,
    CallSequence,
    OneCall,
    SpanFollower,
    merged_steps,
    read_raw,
)
from mlx_serve.tool_calls_atem import ATEM_CALL, AtemCallScanner
from mlx_serve.tool_calls_gemma import GEMMA_CALL, FunctionGemmaCallScanner, GemmaCallScanner
from mlx_serve.tool_calls_minicpm import MiniCpmCallScanner
from mlx_serve.tool_calls_pythonic import PYTHONIC_CALL, PythonicCallScanner, plain_json
from mlx_serve.tool_calls_xml import (
    INVOKE,
    INVOKE_END,
    GlmCallScanner,
    LongCatCallScanner,
    MiniMaxCallScanner,
    XmlCallScanner,
)
from mlx_serve.tool_calls_xtml import XTML_CALL, XTML_CALL_END, XtmlCallScanner

log = logging.getLogger(__name__)

# Kimi-K2: a call's section, and its head up to the start of its arguments.
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>")
_KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_HEAD = re.compile(r"<\|tool_call_begin\|>\s*((?:functions\.)?(.+?):\d+)\s*"
                        r"<\|tool_call_argument_begin\|>", re.DOTALL)
# Mistral: a call's header, and its head up to the start of its JSON arguments.
_MISTRAL_CALL = re.compile(r"[\w-]+\s*\[ARGS\]")
_MISTRAL_HEAD = re.compile(r"([\w-]+)\s*\[ARGS\]\s*(\{)")
# The head of a JSON call, up to the first character of an object or array of arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*([\[{])')


def is_json_tool_parser(parser: Any) -> bool:
    """Whether the model family writes its calls as JSON (mlx-lm's ``json_tools``)."""
    return getattr(parser, "__module__", "").endswith("json_tools")


def new_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """An OpenAI chat tool call."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(parser: Any, tools: list[dict] | None, text: str) -> list[dict]:
    """A raw tool-call span -> OpenAI tool calls, using the model family's mlx-lm parser."""
    try:
        parsed = parser(text, tools)
    except Exception as exc:  # e.g. cut off by max_tokens; a parser's own bug fails no reply
        log.warning("could not parse a tool call (%s): %.200r", exc, text)
        return []
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            # JSON that is no call (a number, say): json_tools returns whatever it reads
            log.warning("left out a tool call without a name: %.200r", text)
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, default=plain_json)
        calls.append(new_call(call["name"], arguments, call.get("id")))
    return calls


@dataclass(slots=True)
class CallUpdate:
    """What one delta adds to one call: its opening (id and name), argument text, its end."""

    position: int  # the call's index among the choice's calls
    opened: bool  # the call's first update: the reply announces it
    arguments: str  # argument text new in this update
    done: bool  # the call is complete (or was cut off where the reply ended)


class JsonCallScanner(CallScanner):
    """One JSON call as it is written: its name once complete, then the text of its
    arguments up to the end of their value (nesting followed outside strings)."""

    __slots__ = ("_depth", "_in_string", "_escaped")

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = self._escaped = False

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.match(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        try:
            self.name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return None
        self._at = head.start(2)
        return ""

    def _scan(self) -> str:
        text, start = self.text, self._at
        at = start
        while at < len(text) and not self.ended:
            ch = text[at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.ended = self._depth == 0
            at += 1
        self._at = at
        return text[start:at]

    def read_to(self) -> int:
        return self._at


class MistralCallScanner(JsonCallScanner):
    """A Mistral call (mlx-lm's ``mistral`` parser), one of a span's ``NAME[ARGS]{...}``s:
    its JSON arguments go out as written, and end the call where their value ends (the
    format has no closing tag)."""

    __slots__ = ()

    def _find_head(self) -> re.Match[str] | None:
        return _MISTRAL_HEAD.match(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self.name = head.group(1)
        self._at = head.start(2)
        return ""


class KimiCallScanner(CallScanner):
    """A Kimi-K2 call (mlx-lm's ``kimi_k2`` parser), one of a span's ``<|tool_call_begin|>``
    sections: ``functions.NAME:N``, ``<|tool_call_argument_begin|>``, then JSON arguments
    up to ``<|tool_call_end|>``, which go out as written (spaces around them left out).
    The call's id is the model's ``functions.NAME:N``, as the parser has it."""

    __slots__ = ("_sent",)

    def __init__(self) -> None:
        super().__init__()
        self._sent = False  # some argument text has gone out

    def _find_head(self) -> re.Match[str] | None:
        return _KIMI_HEAD.search(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self.call_id, self.name = head.group(1), head.group(2)
        self._at = head.end()
        return ""

    def _scan(self) -> str:
        piece, self._at, self.ended = read_raw(self.text, self._at, _KIMI_CALL_END, self._sent)
        self._sent = self._sent or bool(piece)
        return piece


class ToolCallStream:
    """One choice's tool calls as its deltas bring them: complete spans and the text of
    the one still open. Fills ``calls`` (the choice's OpenAI tool calls) and says what
    each delta changed."""

    __slots__ = ("_parser", "_tools", "_follower", "_open", "_positions", "_one", "cut_off")

    def __init__(self, parser: Any, tools: list[dict] | None, one_call: bool = False) -> None:
        """``one_call``: at most one call (``parallel_tool_calls`` false); the generation
        ends with the first span, and of a span holding several calls the first is kept."""
        self._parser, self._tools, self._one = parser, tools, one_call
        self._follower = _follower_for(parser, tools)  # None: calls are parsed whole
        # Positions of calls whose span ended before their arguments did (max_tokens, a
        # stop string, an end-of-sequence token): kept as written, but not complete.
        self.cut_off: set[int] = set()
        self._open: SpanFollower | None = None
        self._positions: dict[int, int] = {}  # the open span's calls: their positions

    def update(self, calls: list[dict], completed: tuple[str, ...], open_text: str
               ) -> list[CallUpdate]:
        updates = []
        for text in completed:
            updates += self._complete(calls, text)
        if open_text and self._follower is not None:
            if self._open is None:
                self._open, self._positions = self._follower(), {}
            updates += self._follow(calls, self._open, self._open.feed(open_text))
        return updates

    def _complete(self, calls: list[dict], text: str) -> list[CallUpdate]:
        span, self._open = self._open, None
        if self._follower is not None:
            if span is None:
                span, self._positions = self._follower(), {}
            updates = self._follow(calls, span,
                                   merged_steps(span.feed(text[len(span.text):]) + span.finish()))
            if self._positions:
                return updates
        parsed = parse_tool_calls(self._parser, self._tools, text)
        if self._one:
            parsed = parsed[:max(0, 1 - len(calls))]
        calls += parsed
        first = len(calls) - len(parsed)
        return [CallUpdate(first + i, True, c["function"]["arguments"], True)
                for i, c in enumerate(parsed)]

    def _follow(self, calls: list[dict], span: SpanFollower,
                steps: list[tuple[int, str, bool]]) -> list[CallUpdate]:
        """Apply what a span's followed calls gained: (call in the span, argument text,
        done); a call is announced the first time it appears."""
        updates = []
        for k, arguments, done in steps:
            scanner = span.scanners[k]
            opened = k not in self._positions
            if opened:
                if self._one and (calls or self._positions):
                    continue  # only the first call is kept
                self._positions[k] = len(calls)
                calls.append(new_call(scanner.name or "", "", scanner.call_id))
            position = self._positions[k]
            call = calls[position]
            _append_arguments(call["function"], arguments)
            if done:
                if not scanner.ended:
                    self.cut_off.add(position)
                _check_arguments(call)
            if opened or arguments or done:
                updates.append(CallUpdate(position, opened, arguments, done))
        return updates


def _follower_for(parser: Any, tools: list[dict] | None
                  ) -> Callable[[], SpanFollower] | None:
    """What follows a span of this model family's calls while it is written, if anything."""
    if is_json_tool_parser(parser):
        return lambda: OneCall(JsonCallScanner())
    module = getattr(parser, "__module__", "")
    if module.endswith("qwen3_coder"):
        return lambda: OneCall(XmlCallScanner(parser, tools))
    if module.endswith("glm47"):
        return lambda: OneCall(GlmCallScanner(parser, tools))
    if module.endswith("longcat"):
        return lambda: OneCall(LongCatCallScanner(parser, tools))
    if module.endswith("minimax_m2"):
        return lambda: CallSequence(lambda: MiniMaxCallScanner(parser, tools), INVOKE,
                                    INVOKE_END)
    if module.endswith("kimi_k2"):
        return lambda: CallSequence(KimiCallScanner, _KIMI_CALL, _KIMI_CALL_END)
    if module.endswith("mistral"):
        return lambda: CallSequence(MistralCallScanner, _MISTRAL_CALL)
    if module.endswith("gemma4"):
        return lambda: CallSequence(GemmaCallScanner, GEMMA_CALL)
    if module.endswith("kimi_k3"):
        return lambda: CallSequence(lambda: XtmlCallScanner(parser, tools), XTML_CALL,
                                    XTML_CALL_END)
    if module.endswith("minicpm5"):
        return lambda: OneCall(MiniCpmCallScanner(parser, tools))
    if module.endswith("function_gemma"):
        return lambda: OneCall(FunctionGemmaCallScanner())
    if module.endswith("muse_spark"):
        return lambda: CallSequence(lambda: AtemCallScanner(parser), ATEM_CALL)
    if module.endswith("pythonic"):
        return lambda: CallSequence(lambda: PythonicCallScanner(parser), PYTHONIC_CALL)
    return None


def _append_arguments(function: dict, arguments: str) -> None:
    """Add to a call's arguments, grown in place as ``call_scanner.grown`` explains (a
    dict's value, like an attribute, is otherwise copied whole at every piece)."""
    joined, function["arguments"] = function["arguments"], ""
    joined += arguments
    function["arguments"] = joined


def _check_arguments(call: dict) -> None:
    """Arguments go out as the model wrote them; say so when they are not JSON (cut off
    by ``max_tokens``, or a malformed call), as OpenAI leaves that to the client."""
    try:
        json.loads(call["function"]["arguments"])
    except ValueError as exc:
        log.warning("tool call %s has arguments that are not valid JSON (%s): %.200r",
                    call["function"]["name"], exc, call["function"]["arguments"])
