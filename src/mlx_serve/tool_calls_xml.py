"""Tool calls in tagged formats, followed while they are written: the XML of
Qwen3-Coder and later Qwen models (mlx-lm's ``qwen3_coder`` parser), GLM-4.5-4.7's
pairs (``glm47``; LongCat-Flash's, ``longcat``, are the same in ``longcat_`` tags) and
MiniMax-M2's ``<invoke name=...>`` with ``<parameter name=...>`` tags (``minimax_m2``):

    <function=write_file>                    write_file
    <parameter=path>                         <arg_key>path</arg_key>
    a.txt                                    <arg_value>a.txt</arg_value>
    </parameter>                             <arg_key>content</arg_key>
    <parameter=content>                      <arg_value>...</arg_value>
    ...
    </parameter>
    </function>

A call is announced once its name is known. Its arguments go out as the JSON object
the parser makes of them (``json.dumps`` of its dict, so a whole reply and the stream
carry the same text): each parameter's key when its tag is complete, a string's
characters as they come, any other value once its tag closes, typed and converted by
the parser's own rules: those of the module the model's parser comes from, taken from
it at run time, as only the runner imports mlx-lm.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from mlx_serve.call_scanner import CallScanner, json_chars
from mlx_serve.stop_strings import held_back

_FUNCTION = re.compile(r"\s*<function=\s*([^\s<>]+)>")
_PARAMETER = re.compile(r"\s*<parameter=\s*([^\s<>]+)>")
_CLOSE_FUNCTION = "</function>"
_ARG_KEY = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>", re.DOTALL)
_LONGCAT_ARG_KEY = re.compile(
    r"<longcat_arg_key>(.*?)</longcat_arg_key>(?:\\n|\s)*<longcat_arg_value>", re.DOTALL)
# MiniMax-M2: a span's calls, each from INVOKE to the first INVOKE_END, as its parser splits.
INVOKE = re.compile(r"<invoke name=")
INVOKE_END = "</invoke>"
_INVOKE_HEAD = re.compile(r"<invoke name=([^>]+)>")
_MINIMAX_PARAMETER = re.compile(r"<parameter name=([^>]+)>")
_STRING_TYPES = frozenset({"string", "str", "text"})


class TaggedCallScanner(CallScanner):
    """What the tagged formats share: parameters one after another, each a key, then a
    value up to ``CLOSE``; a string value streams as it comes, any other goes out whole
    once its tag closes. Subclasses say which values are strings, what of a string's
    text may go out yet, and what a closed value reads as."""

    CLOSE = ""
    SPAN_CLOSES_CALL = False  # the call may have no end tag: its span's end closes it
    __slots__ = ("_rules", "_tools", "_param", "_value_at", "_close_from",
                 "_opened_string", "_params")

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        """``parser``: the model's mlx-lm parse function, whose module has the rules."""
        super().__init__()
        self._rules = sys.modules[parser.__module__]
        self._tools = tools
        self._param: str | None = None  # the parameter whose value is being read
        self._value_at = 0  # where the part of that value not sent yet starts
        self._close_from = 0  # where its closing tag is looked for
        self._opened_string = False  # its opening quote has gone out
        self._params = 0

    def finish(self) -> str:
        """Where the span's end closes the call, its object closes, unless the span was
        cut off inside a value."""
        if (not self.SPAN_CLOSES_CALL or self.name is None or self._param is not None
                or self.ended):
            return ""
        self.ended = True
        return "}"

    def _start(self, name: str, value_at: int) -> str:
        """A parameter's key is complete: its JSON key goes out."""
        self._param, self._opened_string, self._value_at = name, False, value_at
        self._close_from = value_at
        self._params += 1
        return (", " if self._params > 1 else "") + json.dumps(name, ensure_ascii=False) + ": "

    def _value(self) -> tuple[str, bool]:
        """What of the current value can go out now, and whether it closed."""
        assert self._param is not None
        end = self.text.find(self.CLOSE, self._close_from)
        if end >= 0:
            self._at = end + len(self.CLOSE)
            piece = self._closing(self.text[self._value_at:end])
            self._param = None
            return piece, True
        # A long value is read once, not again with every piece.
        self._close_from = max(self._close_from, len(self.text) - len(self.CLOSE) + 1)
        if not self._is_string(self._param):
            return "", False
        safe, body = self._streamable(self.text[self._value_at:])
        if not self._opened_string:
            if not self._may_open(body):
                return "", False
            self._opened_string = True
            self._value_at += len(safe)
            return '"' + json_chars(body), False
        self._value_at += len(safe)
        return json_chars(safe), False

    def _scan(self) -> str:
        """Parameters one after another, until the call's closing tag."""
        out = []
        while not self.ended:
            if self._param is not None:
                piece, closed = self._value()
                out.append(piece)
                if not closed:
                    break
                continue
            tag = self._next_parameter()
            if tag is not None:
                out.append(self._start(*tag))
                continue
            if self._call_closes():
                self.ended = True
                out.append("}")
            break  # more text is needed to know what comes next
        return "".join(out)

    def _next_parameter(self) -> tuple[str, int] | None:
        """The next parameter's name and where its value starts, once its tag is complete."""
        raise NotImplementedError

    def _call_closes(self) -> bool:
        """Whether the call's closing tag comes next."""
        raise NotImplementedError

    def _is_string(self, name: str) -> bool:
        raise NotImplementedError

    def _streamable(self, value: str) -> tuple[str, str]:
        """Of a string's text not sent yet: what may go out (``safe``), and that text
        less what the parser trims at a value's start (the first piece's ``body``). Here,
        for a parser that strips values: what may yet be the closing tag, or space at the
        end, waits."""
        safe = value[:len(value) - held_back(value, (self.CLOSE,), len(self.CLOSE))]
        safe = safe[:len(safe.rstrip())]
        return safe, safe.lstrip()

    def _may_open(self, body: str) -> bool:
        return bool(body)

    def _closing(self, rest: str) -> str:
        """A closed value's JSON, given its text not sent yet."""
        raise NotImplementedError


class XmlCallScanner(TaggedCallScanner):
    """A Qwen3-Coder call: ``<function=NAME>``, ``<parameter=NAME>`` tags, ``</function>``.
    The parser drops one newline at each end of a value, reads ``null`` as null, and keeps
    as text a parameter typed as a string or not in the schema."""

    CLOSE = "</parameter>"
    __slots__ = ("_config",)

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._config: dict = {}

    def _find_head(self) -> re.Match[str] | None:
        return _FUNCTION.search(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self._config = self._rules._get_arguments_config(head.group(1), self._tools)
        return super()._opened(head)

    def _next_parameter(self) -> tuple[str, int] | None:
        tag = _PARAMETER.match(self.text, self._at)
        return None if tag is None else (tag.group(1), tag.end())

    def _call_closes(self) -> bool:
        return self.text[self._at:].lstrip().startswith(_CLOSE_FUNCTION)

    def _is_string(self, name: str) -> bool:
        param = self._config.get(name)
        if not param:
            return True
        return ("type" in param
                and str(param["type"]).strip().lower() in self._rules._string_types)

    def _streamable(self, value: str) -> tuple[str, str]:
        # What may yet be the closing tag, or the newline dropped before it, waits.
        ends = ("\n" + self.CLOSE, self.CLOSE)
        safe = value[:len(value) - held_back(value, ends, len(ends[0]))]
        return safe, safe[1:] if safe.startswith("\n") else safe

    def _may_open(self, body: str) -> bool:
        return _not_null_yet(body)

    def _closing(self, rest: str) -> str:
        assert self._param is not None
        if self._opened_string:  # the parser drops one newline before the tag
            return json_chars(rest[:-1] if rest.endswith("\n") else rest) + '"'
        whole = rest[1:] if rest.startswith("\n") else rest
        whole = whole[:-1] if whole.endswith("\n") else whole
        if whole.lower() == "null":
            return "null"
        try:
            value = self._rules._convert_param_value(whole, self._param, self._config)
        except (ValueError, TypeError):  # the parser refuses the call: keep the text
            value = whole
        return json.dumps(value, ensure_ascii=False)


class GlmCallScanner(TaggedCallScanner):
    """A call in GLM-4.5-4.7's format (mlx-lm's ``glm47`` parser): the function's name,
    then ``<arg_key>k</arg_key><arg_value>v</arg_value>`` pairs, and no closing tag of
    its own (the span's end closes it). The name is known at the first ``<arg_key>``; a
    value is stripped; a parameter the schema types ``string`` stays text, any other is
    read by the parser's ``_deserialize``."""

    CLOSE = "</arg_value>"
    SPAN_CLOSES_CALL = True
    KEY = "<arg_key>"
    PAIR = _ARG_KEY
    __slots__ = ("_strings",)

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._strings: set[str] = set()

    def _find_head(self) -> re.Match[str] | None:
        return re.search(re.escape(self.KEY), self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        name = self.text[:head.start()].strip()
        if not name:
            return None
        self.name = name
        self._strings = self._string_args(name)
        self._at = head.start()
        return "{"

    def _string_args(self, name: str) -> set[str]:
        """The function's parameters that the parser keeps as text."""
        return self._rules._get_string_arg_names(name, self._tools)

    def _scan(self) -> str:
        out = []
        while True:
            if self._param is not None:
                piece, closed = self._value()
                out.append(piece)
                if not closed:
                    break
            pair = self.PAIR.search(self.text, self._at)
            if pair is None:
                break
            out.append(self._start(pair.group(1).strip(), pair.end()))
        return "".join(out)

    def _is_string(self, name: str) -> bool:
        return name in self._strings

    def _closing(self, rest: str) -> str:
        if self._opened_string:
            return json_chars(rest.rstrip()) + '"'
        if self._param in self._strings:
            return json.dumps(rest.strip(), ensure_ascii=False)
        return json.dumps(self._rules._deserialize(rest.strip()), ensure_ascii=False)


class LongCatCallScanner(GlmCallScanner):
    """A LongCat-Flash call (mlx-lm's ``longcat`` parser): GLM's pairs, in ``longcat_``
    tags. A parameter the schema types ``string`` stays text (the parser's own test)."""

    CLOSE = "</longcat_arg_value>"
    KEY = "<longcat_arg_key>"
    PAIR = _LONGCAT_ARG_KEY
    __slots__ = ()

    def _string_args(self, name: str) -> set[str]:
        for tool in self._tools or []:
            function = tool.get("function") or {}
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {arg for arg in properties
                        if self._rules._is_string_type(name, arg, self._tools)}
        return set()


class MiniMaxCallScanner(TaggedCallScanner):
    """A MiniMax-M2 call (mlx-lm's ``minimax_m2`` parser), one of a span's ``<invoke>``s:
    ``<invoke name="NAME">``, ``<parameter name="KEY">VALUE</parameter>``s, ``</invoke>``.
    A value is stripped, reads ``null`` as null, and stays text when the schema types it
    only as a string (or not at all); any other is converted by the parser's rules."""

    CLOSE = "</parameter>"
    __slots__ = ("_properties",)

    def __init__(self, parser: Any, tools: list[dict] | None) -> None:
        super().__init__(parser, tools)
        self._properties: dict = {}

    def _find_head(self) -> re.Match[str] | None:
        return _INVOKE_HEAD.search(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self.name = self._rules._extract_name(head.group(1))
        for tool in self._tools or []:
            function = tool.get("function") or {}
            if function.get("name") == self.name and function.get("parameters"):
                self._properties = function["parameters"].get("properties", {})
        self._at = head.end()
        return "{"

    def _next_parameter(self) -> tuple[str, int] | None:
        tag = _MINIMAX_PARAMETER.search(self.text, self._at)
        if tag is None or self._call_closes(before=tag.start()):
            return None
        return self._rules._extract_name(tag.group(1)), tag.end()

    def _call_closes(self, before: int | None = None) -> bool:
        """Whether ``</invoke>`` comes next (before the parameter at ``before``)."""
        return self.text.find(INVOKE_END, self._at, before) >= 0

    def _types(self, name: str) -> list[str]:
        return self._rules._get_param_types_from_config(name, self._properties)

    def _is_string(self, name: str) -> bool:
        return {t.lower() for t in self._types(name)} <= _STRING_TYPES

    def _may_open(self, body: str) -> bool:
        return _not_null_yet(body)

    def _closing(self, rest: str) -> str:
        assert self._param is not None
        if self._opened_string:
            return json_chars(rest.rstrip()) + '"'
        value = self._rules._convert_param_value_with_types(self._raw_value(rest),
                                                            self._types(self._param))
        return json.dumps(value, ensure_ascii=False)

    def _raw_value(self, rest: str) -> str:
        """A closed value's text, before its type converts it: stripped."""
        return rest.strip()


def _not_null_yet(body: str) -> bool:
    """Whether a string's first text can open it: not while it may still read ``null``."""
    return not ("null".startswith(body.lower()) and len(body) <= 4)
