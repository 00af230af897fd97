"""MiniCPM5's tool calls (mlx-lm's ``minicpm5`` parser), followed while they are written.

A span holds one call, its ``<function name=`` marker already taken off by the text
state machine: ``"NAME"><param name="KEY">VALUE</param>...``. Values are typed and
converted as MiniMax-M2's are; one that holds ``<``, ``&`` or a newline comes wrapped in
``<![CDATA[...]]>``, whose text the parser keeps as it is (not stripped). A string value
streams as it comes, a CDATA one without its wrapper.
"""

from __future__ import annotations

import re
from typing import Any

from mlx_serve.call_scanner import json_chars
from mlx_serve.stop_strings import held_back
from mlx_serve.tool_calls_xml import MiniMaxCallScanner

_HEAD = re.compile(r"""(?:<function\s+)?(?:name\s*=\s*)?("[^"]*"|'[^']*'|[^\s"'<>]+)\s*>""")
_PARAM = re.compile(r"""<param\s+name\s*=\s*("[^"]*"|'[^']*'|[^\s"'<>]+)\s*>""")
_CLOSE_FUNCTION = "</function>"
_CDATA = "<![CDATA["
_CDATA_END = "]]>"


class MiniCpmCallScanner(MiniMaxCallScanner):
    CLOSE = "</param>"
    SPAN_CLOSES_CALL = True  # its marker, </function>, is taken off with the span
    __slots__ = ("_cdata",)

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._cdata = False  # the string being streamed is a CDATA block's text

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.search(self.text)

    def _next_parameter(self) -> tuple[str, int] | None:
        tag = _PARAM.search(self.text, self._at)
        if tag is None or self._call_closes(before=tag.start()):
            return None
        self._cdata = False
        return self._rules._extract_name(tag.group(1)), tag.end()

    def _call_closes(self, before: int | None = None) -> bool:
        """Whether ``</function>`` comes next (before the parameter at ``before``): only
        where the span holds it; the span's end closes the call otherwise."""
        return self.text.find(_CLOSE_FUNCTION, self._at, before) >= 0

    def _streamable(self, value: str) -> tuple[str, str]:
        if self._opened_string and not self._cdata:
            return super()._streamable(value)
        start = 0
        if not self._opened_string:
            start = len(value) - len(value.lstrip())
            if _CDATA.startswith(value[start:]):
                return "", ""  # may yet open a CDATA block
            if not value.startswith(_CDATA, start):
                return super()._streamable(value)
            start += len(_CDATA)
        inner = value[start:]
        safe = inner[:_cdata_held_from(inner, self.CLOSE)]
        body = safe
        if not self._opened_string and self._may_open(body):
            self._cdata = True
        return value[:start] + safe, body

    def _closing(self, rest: str) -> str:
        if self._cdata:
            end = rest.rfind(_CDATA_END)
            if end >= 0 and not rest[end + len(_CDATA_END):].strip():
                rest = rest[:end]
            return json_chars(rest) + '"'
        return super()._closing(rest)

    def _raw_value(self, rest: str) -> str:
        """A CDATA block's text as it is, else the stripped text (the parser's rule)."""
        return self._rules._param_value(rest)


def _cdata_held_from(inner: str, close: str) -> int:
    """Of a CDATA block's text so far, where what may be its end (``]]>``, space, then
    the value's closing tag as far as written) begins."""
    end = inner.rfind(_CDATA_END)
    if end >= 0:
        tail = inner[end + len(_CDATA_END):].lstrip()
        if close.startswith(tail):
            return end
    return len(inner) - held_back(inner, (_CDATA_END,), len(_CDATA_END))
