"""Pythonic tool calls (mlx-lm's ``pythonic`` parser: LFM2 and others), followed while
they are written.

A span holds a Python list of calls, ``[get_weather(city="Paris"), now(tz='UTC')]``,
whose keyword arguments are Python literals (JSON's ``true``/``false``/``null`` read as
Python's). The parser evaluates each and the reply sends ``json.dumps`` of the
arguments; the scanner writes that same JSON as the text comes: a string value character
by character, its escapes decoded, any other value (numbers, lists, dicts, ...) whole
once it is complete. A call ends where its closing parenthesis is.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import warnings
from typing import Any

from mlx_serve.call_scanner import CallScanner, json_chars

# A call of the list: after its "[" or the "," that follows the call before it.
PYTHONIC_CALL = re.compile(r"[\[,]\s*[\w.]+\s*\(")
_HEAD = re.compile(r"[\[,]\s*([\w.]+)\s*\(")
_KEY = re.compile(r"\s*(\w+)\s*=\s*")
_SPACE = re.compile(r"\s*")
_WORD_AND_SPACE = re.compile(r"\w*\s*")
_QUOTES = "\"'"
# The length of an escape of fixed length, its backslash included.
_FIXED_ESCAPES = {"x": 4, "u": 6, "U": 10}
_OCTAL = "01234567"


class PythonicCallScanner(CallScanner):
    __slots__ = ("_rules", "_state", "_quote", "_keys", "_value")

    def __init__(self, parser: Any) -> None:
        super().__init__()
        # The parser's own reading of JSON's literals inside Python ones.
        self._rules = sys.modules.get(getattr(parser, "__module__", ""))
        self._state = "key"  # key | value | string | after_string
        self._quote = ""  # the open string's quote
        self._keys = 0  # keyword arguments begun
        self._value: _ValueEnd | None = None  # a value other than a string, being read

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.match(self.text)

    def read_to(self) -> int:
        return self._at

    def _scan(self) -> str:
        out: list[str] = []
        while not self.ended and self._step(out):
            pass
        return "".join(out)

    def _step(self, out: list[str]) -> bool:
        """Read what the current state can; False when it needs more text."""
        if self._state == "key":
            return self._read_key(out)
        if self._state == "value":
            return self._read_value(out)
        if self._state == "string":
            return self._read_string(out)
        return self._read_after_string(out)

    def _read_key(self, out: list[str]) -> bool:
        """``name=`` (or the call's ")"), after "(" or an argument's ","."""
        text = self.text
        at = _skip_space(text, self._at)
        if at == len(text):
            return False
        if text[at] == ")":
            return self._end_call(out, at)
        key = _KEY.match(text, at)
        if key is None or key.end() == len(text):
            # Not a keyword argument (the parser then takes none of the call's): it is
            # skipped to its end. Or the text may end inside the key or before its value.
            return self._skip_value(at) if key is None and _not_a_key(text, at) else False
        out.append((", " if self._keys else "") + json.dumps(key.group(1), ensure_ascii=False)
                   + ": ")
        self._keys += 1
        self._at, self._state = key.end(), "value"
        return True

    def _read_value(self, out: list[str]) -> bool:
        text = self.text
        if text[self._at] in _QUOTES:
            out.append('"')
            self._quote, self._state = text[self._at], "string"
            self._at += 1
            return True
        end = self._value_end(self._at)
        if end is None:
            return False
        out.append(self._as_json(text[self._at:end]))
        self._at, self._state = end, "key"
        return self._after_value(end)

    def _read_string(self, out: list[str]) -> bool:
        """A string's characters, decoded, up to its closing quote or an escape not yet
        complete."""
        text, at, quote = self.text, self._at, self._quote
        upto = at
        while upto < len(text) and text[upto] != quote:
            if text[upto] == "\\":
                end = _escape_end(text, upto)
                if end is None:
                    break
                upto = end
            else:
                upto += 1
        out.append(json_chars(_decoded(text[at:upto], quote)))
        self._at = upto
        if upto < len(text) and text[upto] == quote:
            self._at, self._state = upto + 1, "after_string"
            return True
        return False

    def _read_after_string(self, out: list[str]) -> bool:
        """After a closing quote: another string joins it ("a" "b"), else the value ends."""
        text = self.text
        at = _skip_space(text, self._at)
        if at == len(text):
            return False
        if text[at] in _QUOTES:
            self._quote, self._state, self._at = text[at], "string", at + 1
            return True
        out.append('"')
        self._at, self._state = at, "key"
        return self._after_value(at)

    def _after_value(self, at: int) -> bool:
        """Past a value: its "," is consumed; a ")" is left for the key state to end on."""
        if at < len(self.text) and self.text[at] == ",":
            self._at = at + 1
        return True

    def _value_end(self, at: int) -> int | None:
        """The end of the value that starts at ``at``, once the text has it."""
        if self._value is None:
            self._value = _ValueEnd(at)
        end = self._value.find(self.text)
        if end is not None:
            self._value = None
        return end

    def _skip_value(self, at: int) -> bool:
        end = self._value_end(at)
        if end is None:
            return False
        self._at = end
        return self._after_value(end)

    def _end_call(self, out: list[str], at: int) -> bool:
        out.append("}")
        self._at, self.ended = at + 1, True
        return False

    def _as_json(self, source: str) -> str:
        """A complete non-string value as the parser reads it, then as the reply sends it."""
        try:
            node = ast.parse(source.strip(), mode="eval").body
            literals = getattr(self._rules, "_JSONLiterals", None)
            if literals is not None:
                node = literals().visit(node)
            return json.dumps(ast.literal_eval(node), ensure_ascii=False, default=plain_json)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return json.dumps(source.strip(), ensure_ascii=False)  # as the parser's fallback


def plain_json(value: Any) -> Any:
    """What JSON cannot hold, as Python literals may: sets as lists, bytes as text."""
    if isinstance(value, (set, frozenset)):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _skip_space(text: str, at: int) -> int:
    space = _SPACE.match(text, at)
    assert space is not None  # it matches the empty string
    return space.end()


def _not_a_key(text: str, at: int) -> bool:
    """Whether what starts at ``at`` (where ``_KEY`` does not match) can no longer become
    ``name=``: a word, maybe with space after it, may still be followed by "="."""
    word = _WORD_AND_SPACE.match(text, at)
    assert word is not None
    return word.end() < len(text)


class _ValueEnd:
    """Where a value ends: the first "," or ")" outside brackets and strings. It resumes
    where the last look stopped, so a long value costs its length once, not at every
    piece."""

    __slots__ = ("at", "_depth", "_quote", "_escaped")

    def __init__(self, at: int) -> None:
        self.at = at  # the next character to look at
        self._depth = 0
        self._quote = ""
        self._escaped = False

    def find(self, text: str) -> int | None:
        """The end's index in ``text``; None if the text ends first."""
        at, depth, quote, escaped = self.at, self._depth, self._quote, self._escaped
        while at < len(text):
            ch = text[at]
            if escaped:
                escaped = False
            elif quote:
                if ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = ""
            elif ch in _QUOTES:
                quote = ch
            elif ch in "([{":
                depth += 1
            elif depth:
                depth -= ch in ")]}"
            elif ch in "),":
                return at
            at += 1
        self.at, self._depth, self._quote, self._escaped = at, depth, quote, escaped
        return None


def _escape_end(text: str, at: int) -> int | None:
    """The end of the escape whose backslash is at ``at``; None if the text may still be
    writing it."""
    if at + 1 >= len(text):
        return None
    kind = text[at + 1]
    if kind in _FIXED_ESCAPES:
        end = at + _FIXED_ESCAPES[kind]
        return end if end <= len(text) else None
    if kind == "N":
        close = text.find("}", at)
        return None if close < 0 else close + 1
    if kind in _OCTAL:
        end = at + 1
        while end < len(text) and end < at + 4 and text[end] in _OCTAL:
            end += 1
        return end if end < len(text) or end == at + 4 else None
    return at + 2


def _decoded(raw: str, quote: str) -> str:
    """A run of a string literal's characters (whole escapes only), as Python reads them."""
    if "\\" not in raw:
        return raw
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown escape stays as written
            value = ast.literal_eval(quote + raw + quote)
        return value if isinstance(value, str) else raw
    except (SyntaxError, ValueError):
        return raw
