"""Stop-string matching on streamed text, across token boundaries.

Text that could still be the start of a stop string is held back until the next piece
of text decides it, so a stop string never leaks into the output (unless it is asked to
end it) and nothing after it is emitted.
"""

from __future__ import annotations


class StopStringMatcher:
    __slots__ = ("_stops", "_held", "_longest", "_include", "included_stop")

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        """``include``: the matched stop string ends the output rather than being left
        out (vLLM's ``include_stop_str_in_output``)."""
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._include = include
        self.included_stop = ""  # the stop string that ended the output, if kept in it

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched)."""
        if not self._stops:
            return text, False
        pending = self._held + text
        hits = [(at, stop) for stop in self._stops if (at := pending.find(stop)) >= 0]
        if hits:
            first, stop = min(hits, key=lambda hit: hit[0])  # ties: the first listed
            self._held = ""
            self.included_stop = stop if self._include else ""
            return pending[:first + len(stop) if self._include else first], True
        keep = held_back(pending, self._stops, self._longest)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string can complete now)."""
        held, self._held = self._held, ""
        return held


def held_back(text: str, ends: tuple[str, ...], longest: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``ends``
    (``longest``: the longest of them): text that may yet turn out to begin one."""
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(end.startswith(tail) for end in ends):
            return size
    return 0
