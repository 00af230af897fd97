"""What every scanner of a tool call being written shares: its text so far, its name
once the call's head is complete, and giving up on a call whose head does not come."""

from __future__ import annotations

import re

HEAD_LIMIT = 512  # characters: a call without its head in them is parsed at its end


class CallScanner:
    """Subclasses say where the head is (``_find_head``), what a found head opens
    (``_opened``: the first argument text, or None to give up) and how the arguments
    read after it (``_scan``)."""

    __slots__ = ("text", "name", "ended", "_gave_up")

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.ended = False  # the arguments are complete
        self._gave_up = False

    def feed(self, piece: str) -> str:
        """Take more of the call's text; return the argument text it adds."""
        self.text += piece
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

    def _find_head(self) -> re.Match[str] | None:
        raise NotImplementedError

    def _opened(self, head: re.Match[str]) -> str | None:
        raise NotImplementedError

    def _scan(self) -> str:
        raise NotImplementedError
