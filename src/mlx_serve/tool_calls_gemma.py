"""Gemma 4's and FunctionGemma's tool calls (mlx-lm's ``gemma4`` and ``function_gemma``
parsers), followed while they are written.

A Gemma 4 span holds calls one after another, each ``call:NAME{...}``: JSON-like
arguments whose strings are delimited by ``<|"|>`` and whose keys are bare words. The
parser turns them into JSON by quoting the strings and each key that directly follows
``{`` or ``,``; the scanner does the same as the text comes, so the arguments stream as
that JSON, character by character, and the call ends where its outer brace closes.

FunctionGemma writes one ``call:NAME{key:VALUE,...}`` a span, with flat values: strings
between ``<escape>``s, which stream the same way, and others read at their end.
"""

from __future__ import annotations

import json
import re

from mlx_serve.call_scanner import CallScanner, json_chars
from mlx_serve.stop_strings import held_back

GEMMA_CALL = re.compile(r"call:[\w-]+\{")
_HEAD = re.compile(r"call:([\w-]+)\{")
_QUOTE = '<|"|>'
_WORD = re.compile(r"\w*")


class GemmaCallScanner(CallScanner):
    __slots__ = ("_depth", "_in_string", "_key_may_follow")

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = False
        self._key_may_follow = False  # the last character read was "{" or ","

    def _find_head(self) -> re.Match[str] | None:
        return _HEAD.match(self.text)

    def _opened(self, head: re.Match[str]) -> str | None:
        self._depth, self._key_may_follow = 1, True
        return super()._opened(head)

    def read_to(self) -> int:
        return self._at

    def _scan(self) -> str:
        out: list[str] = []
        text = self.text
        while self._at < len(text) and not self.ended:
            if self._in_string:
                if not self._read_string(out):
                    break
            elif text.startswith(_QUOTE, self._at):
                out.append('"')
                self._at += len(_QUOTE)
                self._in_string, self._key_may_follow = True, False
            elif len(text) - self._at < len(_QUOTE) and _QUOTE.startswith(text[self._at:]):
                break  # may be a string's opening
            elif self._key_may_follow:
                if not self._read_word(out):
                    break
            else:
                self._read_char(out, text[self._at])
        return "".join(out)

    def _read_string(self, out: list[str]) -> bool:
        """A string's text up to its closing delimiter (or what cannot be part of it)."""
        text = self.text
        end = text.find(_QUOTE, self._at)
        if end >= 0:
            out.append(json_chars(text[self._at:end]) + '"')
            self._at, self._in_string = end + len(_QUOTE), False
            return True
        rest = text[self._at:]
        safe = rest[:len(rest) - held_back(rest, (_QUOTE,), len(_QUOTE))]
        out.append(json_chars(safe))
        self._at += len(safe)
        return False

    def _read_word(self, out: list[str]) -> bool:
        """After "{" or ",": a bare word and ":" is a key, quoted; anything else is as is.
        False while the text ends inside the word."""
        text = self.text
        word = _WORD.match(text, self._at)
        assert word is not None
        if word.end() == len(text):
            return False
        self._key_may_follow = False
        if word.group() and text[word.end()] == ":":
            out.append(json.dumps(word.group(), ensure_ascii=False) + ":")
            self._at = word.end() + 1
        elif word.group():
            out.append(word.group())
            self._at = word.end()
        return True

    def _read_char(self, out: list[str], ch: str) -> None:
        out.append(ch)
        self._at += 1
        if ch == "{":
            self._depth += 1
        elif ch == "}":
            self._depth -= 1
            self.ended = self._depth == 0
        self._key_may_follow = ch in "{,"


# FunctionGemma (mlx-lm's ``function_gemma`` parser): ``call:NAME{key:VALUE,...}`` in a
# span of its own, strings between ``<escape>``s.
FUNCTION_GEMMA_HEAD = re.compile(r"call:(\w+)\{")
_ESCAPE = "<escape>"


class FunctionGemmaCallScanner(CallScanner):
    """A FunctionGemma call, read as its parser reads it: a key runs to its ":", a string
    value between ``<escape>``s is followed by one separator character, any other value
    runs to the next "," and reads as JSON if it is JSON, else as its text; the object
    ends at "}". (The parser ends it at the first "}" even inside a string, and then
    fails on the unclosed string; here such a string is kept whole.)"""

    __slots__ = ("_state", "_keys")

    def __init__(self) -> None:
        super().__init__()
        self._state = "key"  # key | value | string | after_string
        self._keys = 0

    def _find_head(self) -> re.Match[str] | None:
        return FUNCTION_GEMMA_HEAD.search(self.text)

    def _scan(self) -> str:
        out: list[str] = []
        read = {"key": self._read_key, "value": self._read_value,
                "string": self._read_string, "after_string": self._read_separator}
        while not self.ended and read[self._state](out):
            pass
        return "".join(out)

    def _read_key(self, out: list[str]) -> bool:
        text = self.text
        colon, brace = text.find(":", self._at), text.find("}", self._at)
        if brace >= 0 and (colon < 0 or brace < colon):
            return self._close(out, brace)
        if colon < 0:
            return False
        key = json.dumps(text[self._at:colon], ensure_ascii=False)
        out.append((", " if self._keys else "") + key + ": ")
        self._keys += 1
        self._at, self._state = colon + 1, "value"
        return True

    def _read_value(self, out: list[str]) -> bool:
        text, at = self.text, self._at
        if text.startswith(_ESCAPE, at):
            out.append('"')
            self._at, self._state = at + len(_ESCAPE), "string"
            return True
        ends = [end for end in (text.find(",", at), text.find("}", at)) if end >= 0]
        if not ends:
            return False
        end = min(ends)
        try:
            value = json.loads(text[at:end])
        except ValueError:
            value = text[at:end]
        out.append(json.dumps(value, ensure_ascii=False))
        self._at, self._state = end + (text[end] == ","), "key"
        return True

    def _read_string(self, out: list[str]) -> bool:
        text, at = self.text, self._at
        end = text.find(_ESCAPE, at)
        if end >= 0:
            out.append(json_chars(text[at:end]) + '"')
            self._at, self._state = end + len(_ESCAPE), "after_string"
            return True
        rest = text[at:]
        safe = rest[:len(rest) - held_back(rest, (_ESCAPE,), len(_ESCAPE))]
        out.append(json_chars(safe))
        self._at += len(safe)
        return False

    def _read_separator(self, out: list[str]) -> bool:
        """The parser passes over the one character after a string, whatever it is."""
        if self._at == len(self.text):
            return False
        if self.text[self._at] == "}":
            return self._close(out, self._at)
        self._at, self._state = self._at + 1, "key"
        return True

    def _close(self, out: list[str], brace: int) -> bool:
        out.append("}")
        self._at, self.ended = brace + 1, True
        return False
