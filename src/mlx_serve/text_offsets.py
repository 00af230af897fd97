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
    __slots__ = ("_decoder", "length")

    def __init__(self, start: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.length = start  # characters of the text so far

    def add(self, tokens: Sequence[TokenLogprob], text: str) -> list[int]:
        """The offsets of ``tokens``, which together wrote ``text`` (a stop string or
        a special token left out of it: then some write nothing)."""
        end = self.length + len(text)
        offsets, at = [], self.length
        for token in tokens:
            pending = bool(self._decoder.getstate()[0])
            piece = self._decoder.decode(bytes(token.bytes))
            # Bytes left pending that this token does not complete read as one
            # replacement character, which the earlier tokens wrote: this one starts after.
            broken = pending and piece.startswith("\ufffd")
            offsets.append(min(at + broken, end))
            at += len(piece)
        self.length = end
        return offsets


def prompt_offsets(first: TokenLogprob, scored: Sequence[TokenLogprob], echo: str
                   ) -> list[int]:
    """The offsets of an echoed prompt's tokens in ``echo``, the prompt's text. The first
    token takes no room there if the echo does not begin with it: a BOS token, or the
    start of a character that a later token completes."""
    offsets = TextOffsets()
    whole = bytes(first.bytes).decode("utf-8", "replace")
    offsets.add([first], whole if echo.startswith(whole) else "")
    return [0, *offsets.add(scored, echo[offsets.length:])]
