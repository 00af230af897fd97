"""A reply's tool calls, from the raw text of the model's tool-call spans.

A call in mlx-lm's ``json_tools`` format, ``{"name": ..., "arguments": {...}}``, is
followed while it is generated, as OpenAI and vLLM stream calls: it is announced (id and
name) as soon as its name is complete, and its arguments go out piece by piece, exactly as
the model writes them, up to the end of their JSON value. So a long call (a file's
contents, say) reaches the client as it is written, not all at once at its end, and a
whole reply carries the very same arguments as the stream. A call cut off by
``max_tokens`` keeps the arguments written so far, as OpenAI's do. Calls in the tagged
formats of ``qwen3_coder`` and ``glm47`` are followed too (``tool_calls_xml``).

Any other format, or a call written in another shape (JSON with ``arguments`` first, a
list of calls), is parsed by the model family's mlx-lm parser once complete and goes out
whole.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_serve.call_scanner import CallScanner
from mlx_serve.tool_calls_xml import GlmCallScanner, XmlCallScanner

log = logging.getLogger(__name__)

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
    except (ValueError, KeyError, TypeError) as exc:  # e.g. cut off by max_tokens
        log.warning("could not parse a tool call (%s): %.200r", exc, text)
        return []
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
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

    __slots__ = ("_at", "_depth", "_in_string", "_escaped")

    def __init__(self) -> None:
        super().__init__()
        self._at = 0  # the next character of ``text`` to read as arguments
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


class ToolCallStream:
    """One choice's tool calls as its deltas bring them: complete spans and the text of
    the one still open. Fills ``calls`` (the choice's OpenAI tool calls) and says what
    each delta changed."""

    __slots__ = ("_parser", "_tools", "_scanner", "_open", "_one", "cut_off")

    def __init__(self, parser: Any, tools: list[dict] | None, one_call: bool = False) -> None:
        """``one_call``: at most one call (``parallel_tool_calls`` false); the generation
        ends with the first span, and of a span holding several calls the first is kept."""
        self._parser, self._tools, self._one = parser, tools, one_call
        self._scanner = _scanner_for(parser, tools)  # None: calls are parsed whole
        # Positions of calls whose span ended before their arguments did (max_tokens, a
        # stop string, an end-of-sequence token): kept as written, but not complete.
        self.cut_off: set[int] = set()
        self._open: CallScanner | None = None

    def update(self, calls: list[dict], completed: tuple[str, ...], open_text: str
               ) -> list[CallUpdate]:
        updates = []
        for text in completed:
            updates += self._complete(calls, text)
        if open_text and self._scanner is not None:
            if self._open is None:
                self._open = self._scanner()
            update = self._follow(calls, self._open, open_text, done=False)
            if update is not None and (update.opened or update.arguments):
                updates.append(update)
        return updates

    def _complete(self, calls: list[dict], text: str) -> list[CallUpdate]:
        scanner, self._open = self._open, None
        if self._scanner is not None:
            scanner = scanner or self._scanner()
            update = self._follow(calls, scanner, text[len(scanner.text):], done=True)
            if update is not None:
                if (tail := scanner.finish()):
                    update.arguments += tail
                    calls[update.position]["function"]["arguments"] += tail
                if not scanner.ended:
                    self.cut_off.add(update.position)
                _check_arguments(calls[update.position])
                return [update]
        parsed = parse_tool_calls(self._parser, self._tools, text)
        if self._one:
            parsed = parsed[:max(0, 1 - len(calls))]
        calls += parsed
        first = len(calls) - len(parsed)
        return [CallUpdate(first + i, True, c["function"]["arguments"], True)
                for i, c in enumerate(parsed)]

    @staticmethod
    def _follow(calls: list[dict], scanner: CallScanner, piece: str,
                done: bool) -> CallUpdate | None:
        """Feed a followed call; None while (or if) its name is not known."""
        was_open = scanner.name is not None
        arguments = scanner.feed(piece)
        if scanner.name is None:
            return None
        if not was_open:
            calls.append(new_call(scanner.name, ""))
        calls[-1]["function"]["arguments"] += arguments
        return CallUpdate(len(calls) - 1, not was_open, arguments, done)


def _scanner_for(parser: Any, tools: list[dict] | None
                 ) -> Callable[[], CallScanner] | None:
    """What follows a call of this model family while it is written, if anything."""
    if is_json_tool_parser(parser):
        return JsonCallScanner
    module = getattr(parser, "__module__", "")
    if module.endswith("qwen3_coder"):
        return lambda: XmlCallScanner(parser, tools)
    if module.endswith("glm47"):
        return lambda: GlmCallScanner(parser, tools)
    return None


def _check_arguments(call: dict) -> None:
    """Arguments go out as the model wrote them; say so when they are not JSON (cut off
    by ``max_tokens``, or a malformed call), as OpenAI leaves that to the client."""
    try:
        json.loads(call["function"]["arguments"])
    except ValueError as exc:
        log.warning("tool call %s has arguments that are not valid JSON (%s): %.200r",
                    call["function"]["name"], exc, call["function"]["arguments"])
