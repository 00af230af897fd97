"""A tool call in the XML format of Qwen3-Coder and later Qwen models (mlx-lm's
``qwen3_coder`` parser), followed while it is written:

    <function=write_file>
    <parameter=path>
    a.txt
    </parameter>
    <parameter=content>
    ...
    </parameter>
    </function>

The call is announced once ``<function=NAME>`` is complete. Its arguments go out as the
JSON object the parser makes of them (``json.dumps`` of its dict, so a whole reply and
the stream carry the same text): each parameter's key when its tag is complete, a
string's characters as they come (the parser's typing makes it a string: a ``string``
type in the tool's schema, or a parameter the schema does not name), any other value
once its tag closes, converted by the parser's own rules: those of the module the
model's parser comes from (mlx-lm's ``tool_parsers.qwen3_coder``), taken from it at run
time, as only the runner imports mlx-lm.
"""

from __future__ import annotations

import json
import re
import sys
from types import ModuleType
from typing import Any

from mlx_serve.call_scanner import CallScanner

_FUNCTION = re.compile(r"\s*<function=\s*([^\s<>]+)>")
_PARAMETER = re.compile(r"\s*<parameter=\s*([^\s<>]+)>")
_CLOSE_PARAMETER = "</parameter>"
_CLOSE_FUNCTION = "</function>"


def _is_string(name: str, config: dict, rules: ModuleType) -> bool:
    """Whether the parser keeps this parameter's value as text (``null`` aside)."""
    param = config.get(name)
    if not param:
        return True
    return "type" in param and str(param["type"]).strip().lower() in rules._string_types


def _escaped(text: str) -> str:
    """Characters as they read inside a JSON string (per character: pieces join up)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class XmlCallScanner(CallScanner):
    """One call as it is written: its name, then the JSON text of its arguments."""

    __slots__ = ("_rules", "_tools", "_config", "_at", "_param", "_value_at",
                 "_opened_string", "_params")

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        """``parser``: the model's mlx-lm parse function, whose module has the rules."""
        super().__init__()
        self._rules = sys.modules[parser.__module__]
        self._tools = tools
        self._config: dict = {}
        self._at = 0  # where the next tag is looked for
        self._param: str | None = None  # the parameter whose value is being read
        self._value_at = 0  # where that value starts
        self._opened_string = False  # its opening quote has gone out
        self._params = 0

    def _find_head(self) -> re.Match[str] | None:
        return _FUNCTION.search(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self.name = head.group(1)
        self._config = self._rules._get_arguments_config(self.name, self._tools)
        self._at = head.end()
        return "{"

    def _scan(self) -> str:
        out = []
        while not self.ended:
            if self._param is not None:
                piece, closed = self._value()
                out.append(piece)
                if not closed:
                    break
                continue
            rest = self.text[self._at:]
            tag = _PARAMETER.match(rest)
            if tag is not None:
                self._param, self._opened_string = tag.group(1), False
                self._value_at = self._at + tag.end()
                out.append((", " if self._params else "") + json.dumps(self._param) + ": ")
                self._params += 1
                continue
            if rest.lstrip().startswith(_CLOSE_FUNCTION):
                self.ended = True
                out.append("}")
            break  # more text is needed to know what comes next
        return "".join(out)

    def _value(self) -> tuple[str, bool]:
        """What of the current value can go out now, and whether it closed."""
        assert self._param is not None
        value = self.text[self._value_at:]
        end = value.find(_CLOSE_PARAMETER)
        if end >= 0:
            self._at = self._value_at + end + len(_CLOSE_PARAMETER)
            piece = self._closing(value[:end])
            self._param = None
            return piece, True
        if not _is_string(self._param, self._config, self._rules):
            return "", False
        # A string's text so far, less what may yet be the closing tag or the newline
        # the parser drops before it, and its leading newline.
        safe = _safe_prefix(value)
        body = safe[1:] if safe.startswith("\n") else safe
        if not self._opened_string:
            if "null".startswith(body.lower()) and len(body) <= 4:
                return "", False  # it may yet be null
            self._opened_string = True
            self._value_at += len(safe)
            return '"' + _escaped(body), False
        self._value_at += len(safe)
        return _escaped(safe), False

    def _closing(self, rest: str) -> str:
        """The rest of a value whose tag closed (``rest``: its text not sent yet): the
        end of a string streamed so far, or the value converted whole."""
        assert self._param is not None
        if self._opened_string:  # the parser drops one newline before the tag
            return _escaped(rest[:-1] if rest.endswith("\n") else rest) + '"'
        whole = _trimmed(rest)
        if whole.lower() == "null":
            return "null"
        try:
            value = self._rules._convert_param_value(whole, self._param, self._config)
        except (ValueError, TypeError):  # the parser refuses the call: keep the text
            value = whole
        return json.dumps(value, ensure_ascii=False)


def _trimmed(value: str) -> str:
    """A value as the parser keeps it: one leading and one trailing newline dropped."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _safe_prefix(value: str) -> str:
    """The part of a value's text that cannot belong to its ending ("\\n</parameter>")."""
    ending = "\n" + _CLOSE_PARAMETER
    for keep in range(min(len(ending), len(value)), 0, -1):
        if ending.startswith(value[-keep:]) or _CLOSE_PARAMETER.startswith(value[-keep:]):
            return value[:-keep]
    return value
