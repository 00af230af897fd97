"""``text_offset`` of a completion's log-probabilities: where each token starts in the
reply's text.

Adding up the tokens' strings drifts wherever a character is split across tokens: each
part reads as one replacement character, so "世界" in four tokens counted four
characters, and the generated tokens' offsets, which start at the echoed prompt's real
length, went backwards. Here a token adds the characters its bytes complete, decoded as
a stream (a token holding part of a character adds none until the one that completes
it), and no offset passes the end of the text the tokens made.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from mlx_serve.generation import TokenLogprob


class TextOffsets:
    __slots__ = ("_decoder", "length", "_ahead", "_behind", "_last")

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.length = start  # characters of the text so far
        # The reply's detokenizer may write a broken byte's replacement character a token
        # later or sooner than the decoding here: what it has decoded that the text has
        # not shown yet, and what the text has shown that it has not decoded yet.
        self._ahead = ""
        self._behind = ""
        self._last = start  # the last offset given: they never go back

    def add(self, tokens: Sequence[TokenLogprob], text: str) -> list[int]:
        """The offsets of ``tokens``, which together wrote ``text`` (a stop string or
        a special token left out of it: then some write nothing)."""
        at = self.length + len(self._ahead) - len(self._behind)
        starts, pieces = [], []
        for token in tokens:
            pending = bool(self._decoder.getstate()[0])
            piece = self._decoder.decode(bytes(token.bytes))
            # Bytes left pending that this token does not complete read as one
            # replacement character, which the earlier tokens wrote: this one starts after.
            starts.append(at + (pending and piece.startswith("\ufffd")))
            at += len(piece)
            pieces.append(piece)
        self._settle(self._ahead + "".join(pieces), self._behind + text)
        self.length += len(text)
        limit = self.length + len(self._ahead)
        offsets = []
        for start in starts:
            self._last = max(self._last, min(start, limit))
            offsets.append(self._last)
        return offsets

    def _settle(self, decoded: str, shown: str) -> None:
        """Keep what one side has and the other not yet, if it is replacement characters
        only; anything else is text left out of the reply (a stop string, a special
        token), which never comes."""
        self._ahead = self._behind = ""
        if decoded.startswith(shown) and not decoded[len(shown):].strip("\ufffd"):
            self._ahead = decoded[len(shown):]
        elif shown.startswith(decoded) and not shown[len(decoded):].strip("\ufffd"):
            self._behind = shown[len(decoded):]


def prompt_offsets(first: TokenLogprob, scored: Sequence[TokenLogprob], echo: str
                   ) -> list[int]:
    """The offsets of an echoed prompt's tokens in ``echo``, the prompt's text. The first
    token takes no room there if the echo does not begin with it: a BOS token, or the
    start of a character that a later token completes."""
    offsets = TextOffsets()
    whole = bytes(first.bytes).decode("utf-8", "replace")
    offsets.add([first], whole if echo.startswith(whole) else "")
    return [0, *offsets.add(scored, echo[offsets.length:])]
