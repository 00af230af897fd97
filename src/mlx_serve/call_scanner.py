"""Following tool calls while they are written.

A scanner follows one call: what every one shares is here (its text so far, its name once
the call's head is complete, giving up on a call whose head does not come). A span of a
model's tool-call text holds one call (``OneCall``) or several one after another
(``CallSequence``), each with its own scanner."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mlx_serve.stop_strings import held_back

HEAD_LIMIT = 512  # characters: a call without its head in them is parsed at its end


def json_chars(text: str) -> str:
    """Characters as they read inside a JSON string (per character: pieces join up)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def grown(holder: CallScanner | CallSequence, piece: str) -> str:
    """``holder.text + piece``, grown in place where CPython can: ``self.text += piece``
    copies the whole text at every piece, which makes a long call cost the square of its
    length (an attribute is never grown in place; a local variable that holds the only
    reference is)."""
    text, holder.text = holder.text, ""
    text += piece
    return text


def read_raw(text: str, at: int, end: str, started: bool) -> tuple[str, int, bool]:
    """Raw text from ``at`` up to ``end``, less the space around it: what may go out now,
    where reading goes on, and whether ``end`` was reached. Leading space is skipped only
    until some text has gone out (``started``)."""
    rest = text[at:]
    if not started:
        at += len(rest) - len(rest.lstrip())
        rest = rest.lstrip()
    stop = rest.find(end)
    if stop >= 0:
        return rest[:stop].rstrip(), at + stop + len(end), True
    safe = rest[:len(rest) - held_back(rest, (end,), len(end))]
    safe = safe[:len(safe.rstrip())]  # space before the end is not sent
    return safe, at + len(safe), False


class CallScanner:
    """Subclasses say where the head is (``_find_head``), what a found head opens
    (``_opened``: the first argument text, or None to give up; by default the head's
    first group is the name and an object of arguments opens at its end) and how the
    arguments read after it (``_scan``, from ``_at``)."""

    __slots__ = ("text", "name", "call_id", "ended", "_gave_up", "_at")

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.call_id: str | None = None  # the model's own id for the call, if it writes one
        self.ended = False  # the arguments are complete
        self._gave_up = False
        self._at = 0  # where reading the arguments goes on in ``text``

    def feed(self, piece: str) -> str:
        """Take more of the call's text; return the argument text it adds."""
        self.text = grown(self, piece)
        if self.name is not None:
            return self._scan()
        if self._gave_up:
            return ""
        head = self._find_head()
        if head is None:
            self._gave_up = len(self.text) > HEAD_LIMIT
            return ""
        first = self._opened(head)
        if first is None:
            self._gave_up = True
            return ""
        return first + self._scan()

    def finish(self) -> str:
        """The call's span is complete: argument text that only its end releases (a
        format whose arguments have no closing tag of their own)."""
        return ""

    def read_to(self) -> int:
        """Of ``text``, how much the call has read (all of it, unless it ended before)."""
        return len(self.text)

    def _find_head(self) -> re.Match[str] | None:
        raise NotImplementedError

    def _opened(self, head: re.Match[str]) -> str | None:
        self.name = head.group(1)
        self._at = head.end()
        return "{"

    def _scan(self) -> str:
        raise NotImplementedError


class OneCall:
    """A span that holds one call (``json_tools``, ``qwen3_coder``, ``glm47``,
    ``longcat``): its scanner reads the whole span, and the call is done when the span
    is."""

    __slots__ = ("scanners",)

    def __init__(self, scanner: CallScanner) -> None:
        self.scanners = [scanner]

    @property
    def text(self) -> str:
        return self.scanners[0].text

    def feed(self, piece: str) -> list[tuple[int, str, bool]]:
        """Take more of the span's text; return (call in the span, argument text it adds,
        whether the call is done) for each call it touched, in order."""
        scanner = self.scanners[0]
        arguments = scanner.feed(piece)
        return [] if scanner.name is None else [(0, arguments, False)]

    def finish(self) -> list[tuple[int, str, bool]]:
        """The span is complete: every call in it is done."""
        scanner = self.scanners[0]
        return [] if scanner.name is None else [(0, scanner.finish(), True)]


class CallSequence:
    """A span that holds calls one after another (MiniMax-M2's ``<invoke>``s, Kimi-K2's
    ``<|tool_call_begin|>`` sections, Mistral's ``NAME[ARGS]{...}``s, ...): each starts
    at a match of ``start`` and has its own scanner. It runs to the first ``end`` after that,
    as the parsers split them, or, with no ``end``, to where its scanner ends it (the end
    of its arguments' JSON value). A call is done at its end."""

    __slots__ = ("scanners", "text", "_make", "_start", "_end", "_fed", "_from", "_at")

    def __init__(self, make: Callable[[], CallScanner], start: re.Pattern[str],
                 end: str = "") -> None:
        self.scanners: list[CallScanner] = []
        self.text = ""
        self._make, self._start, self._end = make, start, end
        self._fed = 0  # of ``text``, what the last call's scanner has been given
        self._from: int | None = None  # where the last call's end is looked for; None: ended
        self._at = 0  # where the last call starts

    def feed(self, piece: str) -> list[tuple[int, str, bool]]:
        self.text = grown(self, piece)
        steps: list[tuple[int, str, bool]] = []
        while True:
            if self._from is None:
                start = self._start.search(self.text, self._fed)
                if start is None:
                    break
                self.scanners.append(self._make())
                self._at = self._fed = start.start()
                self._from = start.end()
            k, scanner = len(self.scanners) - 1, self.scanners[-1]
            end = self.text.find(self._end, self._from) if self._end else -1
            if end < 0:  # the next search starts where an end could begin
                self._from = max(self._from, len(self.text) - len(self._end) + 1)
            upto = len(self.text) if end < 0 else end + len(self._end)
            arguments = scanner.feed(self.text[self._fed:upto])
            self._fed = upto
            done = end >= 0
            if not self._end and scanner.ended:  # the rest is the next call's
                self._fed, done = self._at + scanner.read_to(), True
            if done:
                arguments += scanner.finish()
                self._from = None
            if scanner.name is not None:
                steps.append((k, arguments, done))
            if not done:
                break
        return merged_steps(steps)

    def finish(self) -> list[tuple[int, str, bool]]:
        if self._from is None or self.scanners[-1].name is None:
            return []
        scanner = self.scanners[-1]  # cut off before its end
        return [(len(self.scanners) - 1, scanner.finish(), True)]


SpanFollower = OneCall | CallSequence


def merged_steps(steps: list[tuple[int, str, bool]]) -> list[tuple[int, str, bool]]:
    """One step a call, in order: its argument text joined, done if its last step was."""
    merged: dict[int, tuple[str, bool]] = {}
    for k, arguments, done in steps:
        merged[k] = (merged.get(k, ("", False))[0] + arguments, done)
    return [(k, arguments, done) for k, (arguments, done) in merged.items()]
