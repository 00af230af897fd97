"""Kimi K3's tool calls (mlx-lm's ``kimi_k3`` parser), followed while they are written.

A span holds calls one after another, in XTML tags::

    <|open|>call tool="get_weather" index="1"<|sep|>
      <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
    <|close|>call<|sep|>

A call is announced once its tag is complete. Its arguments go out as the JSON object the
parser makes of them: a ``string`` argument's text as it comes, any other once its tag
closes, read as JSON (or kept as text when it is not). A call whose arguments are one
JSON block (``<|open|>json ...<|sep|>{...}<|close|>json<|sep|>``) right after its tag
sends that block as written. (The parser also takes a block after other arguments, which
then replaces them; such a call streams its arguments and not the block.)
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_serve.call_scanner import json_chars, read_raw
from mlx_serve.stop_strings import held_back
from mlx_serve.tool_calls_xml import TaggedCallScanner

XTML_CALL = re.compile(r"<\|open\|>call")
XTML_CALL_END = "<|close|>call<|sep|>"
_HEAD = re.compile(r"<\|open\|>call((?:(?!<\|sep\|>).)*)<\|sep\|>", re.DOTALL)
_ARGUMENT = re.compile(r"<\|open\|>argument((?:(?!<\|sep\|>).)*)<\|sep\|>", re.DOTALL)
_JSON = re.compile(r"\s*<\|open\|>json(?:(?!<\|sep\|>).)*<\|sep\|>", re.DOTALL)
_JSON_END = "<|close|>json<|sep|>"


class XtmlCallScanner(TaggedCallScanner):
    CLOSE = "<|close|>argument<|sep|>"
    __slots__ = ("_type", "_json_at", "_json_sent", "_block_read")

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._type = "string"  # the type attribute of the argument being read
        self._json_at: int | None = None  # in a JSON block: where its unread text starts
        self._json_sent = False
        self._block_read = False  # its end has been read

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.search(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        name = self._rules._parse_attrs(head.group(1)).get("tool")
        if not name:
            return None  # the parser refuses a call without its tool's name
        self.name, self._at = name, head.end()
        return ""  # "{" goes out with the first argument: the arguments may be a block

    def _scan(self) -> str:
        if self._json_at is None and self._params == 0:
            block = _JSON.match(self.text, self._at)
            if block is not None:
                self._json_at = block.end()
        if self._json_at is not None:
            return self._read_block()
        out = super()._scan()
        return "{" + out if self.ended and self._params == 0 else out  # no arguments: {}

    def _read_block(self) -> str:
        assert self._json_at is not None
        piece = ""
        if not self._block_read:
            piece, self._json_at, self._block_read = read_raw(
                self.text, self._json_at, _JSON_END, self._json_sent)
            self._json_sent = self._json_sent or bool(piece)
        self.ended = self._block_read and self._call_closes()  # then only the call's end
        return piece

    def _start(self, name: str, value_at: int) -> str:
        return ("{" if self._params == 0 else "") + super()._start(name, value_at)

    def _next_parameter(self) -> tuple[str, int] | None:
        """Also notes the argument's type, which says how its value reads."""
        tag = _ARGUMENT.search(self.text, self._at)
        if tag is None or self.text.find(XTML_CALL_END, self._at, tag.start()) >= 0:
            return None
        attrs = self._rules._parse_attrs(tag.group(1))
        self._type = attrs.get("type", "string")
        return attrs.get("key", ""), tag.end()

    def _call_closes(self) -> bool:
        return self.text.find(XTML_CALL_END, self._at) >= 0

    def _is_string(self, name: str) -> bool:
        return self._type == "string"

    def _streamable(self, value: str) -> tuple[str, str]:
        safe = value[:len(value) - held_back(value, (self.CLOSE,), len(self.CLOSE))]
        return safe, safe

    def _closing(self, rest: str) -> str:
        if self._opened_string:
            return json_chars(rest) + '"'
        return json.dumps(self._rules._decode_value(rest, self._type), ensure_ascii=False)
