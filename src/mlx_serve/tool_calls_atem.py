"""Muse Spark's tool calls (mlx-lm's ``muse_spark`` parser, XML_ATEM), followed while they
are written.

A span holds calls one after another, ``<atem:invoke name="NAME">`` with
``<atem:parameter name="KEY">VALUE</atem:parameter>``s and ``</atem:invoke>`` (a
parameter's value may hold that end: the call ends at the first one outside a value).
A value is JSON if it reads as JSON, else its stripped text. So a value streams as a
string once its start rules JSON out (a letter that begins no JSON literal, say);
anything else goes out once its tag closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_serve.call_scanner import json_chars
from mlx_serve.tool_calls_xml import TaggedCallScanner

ATEM_CALL = re.compile(r"<atem:invoke\b")
_HEAD = re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)">')
_PARAMETER = re.compile(r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*?>')
_INVOKE_END = "</atem:invoke>"
# What a JSON value may start with (Python's json reads NaN and Infinity too), and the
# words it may be.
_JSON_STARTS = frozenset('"{[-0123456789tfnNI')
_JSON_WORDS = ("true", "false", "null", "NaN", "Infinity")


class AtemCallScanner(TaggedCallScanner):
    CLOSE = "</atem:parameter>"
    SPAN_CLOSES_CALL = True  # the parser reads a call without its end tag
    __slots__ = ("_end",)

    def __init__(self, parser: Any, tools: list[dict] | None = None) -> None:
        super().__init__(parser, tools)
        self._end = 0  # where the call's end tag ends, once read

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.search(self.text)

    def read_to(self) -> int:
        return self._end if self.ended else len(self.text)

    def _next_parameter(self) -> tuple[str, int] | None:
        tag = _PARAMETER.search(self.text, self._at)
        if tag is None or self.text.find(_INVOKE_END, self._at, tag.start()) >= 0:
            return None
        return tag.group(1), tag.end()

    def _call_closes(self) -> bool:
        end = self.text.find(_INVOKE_END, self._at)
        if end < 0:
            return False
        self._end = end + len(_INVOKE_END)
        return True

    def _is_string(self, name: str) -> bool:
        return True  # until its text says otherwise (``_may_open``)

    def _may_open(self, body: str) -> bool:
        """Whether the value's first text rules JSON out, so it is the text itself."""
        if not body:
            return False
        if body[0] not in _JSON_STARTS:
            return True
        return body[0] in "tfnNI" and not any(word.startswith(body) for word in _JSON_WORDS)

    def _closing(self, rest: str) -> str:
        if self._opened_string:
            return json_chars(rest.rstrip()) + '"'
        return json.dumps(self._rules._param_value(rest), ensure_ascii=False)
