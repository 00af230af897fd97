"""mlx-lm's BPE streaming detokenizer, with each token's bytes looked up once.

Every generated token is detokenized on the MLX thread, inside the batch step.
mlx-lm's ``BPEStreamingDetokenizer.add_token`` maps the held-back text back to bytes one
character at a time (a dict lookup and a bytearray append each) on every token; that is
most of a token's text cost (about 1.9 of 2.7 us on the CPU machine, SmolLM2's
tokenizer). Here each token's bytes, and whether it is the lone space that mlx-lm holds
back, are computed once per tokenizer with mlx-lm's own rules, and a token costs one
bytes concatenation and one decode. The rules are mlx-lm's, line for line, as of the
release ``decode_step`` mirrors (the tests compare the two on random streams; with any
other mlx-lm its own detokenizer is used); only the tables and the way the text is kept
differ, and one byte: mlx-lm's ``add_token`` tests each looked-up byte for truth, so the
token of the NUL byte came out as its stand-in character "Ā" (U+0100), where the
tokenizer's own ``decode``, mlx-lm's ``finalize`` and a token's logprobs text give NUL.
Here it is NUL.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from mlx_serve.runner.decode_step import mirrors_installed_mlx_lm

try:  # mlx-lm's own byte table (private: without it, its detokenizer is used as it is)
    from mlx_lm.tokenizer_utils import _byte_decoder
except ImportError:  # pragma: no cover
    _byte_decoder = None  # type: ignore[assignment]


def _token_bytes(text: str, byte_decoder: dict[str, int]) -> bytes:
    """``text``'s bytes as mlx-lm's ``_decode_bytes`` builds them, but for byte 0 (which
    it takes for "not a byte" and writes as its stand-in character's UTF-8)."""
    out = bytearray()
    for c in text:
        res = byte_decoder.get(c)
        if res is not None:
            out.append(res)
        else:
            out.extend(bytes(c, "utf-8"))
    return bytes(out)


_PAST_THE_MAP = (b"!", False)  # what mlx-lm adds for an id past its token map


class TabledBPEStreamingDetokenizer(BPEStreamingDetokenizer):
    """Gives the text of mlx-lm's ``BPEStreamingDetokenizer`` (NUL for the NUL byte's
    token, where mlx-lm's gives "Ā"), faster.

    Built once from an existing one (sharing its token map); ``fresh()`` makes the
    per-request copies, as mlx-lm's ``TokenizerWrapper.detokenizer`` does. The text is
    kept as a list of pieces: mlx-lm's ``self.text += piece`` copies the whole reply on
    every token, a cost that grows with its length (2x a token's at 8,192 tokens).
    ``last_segment`` joins only the pieces not yet read; ``text`` joins them all.
    """

    # Per token id: its bytes, and whether it is the lone space that mlx-lm holds back
    # (to drop it if the reply starts with it).
    _entries: tuple[tuple[bytes, bool], ...]

    @classmethod
    def from_detokenizer(cls, prototype: BPEStreamingDetokenizer
                         ) -> TabledBPEStreamingDetokenizer:
        made = cls.__new__(cls)
        made.tokenmap = prototype.tokenmap
        decoder = _byte_decoder()
        made._entries = tuple((_token_bytes(v, decoder), len(v) == 1 and decoder.get(v[0]) == 32)
                              for v in made.tokenmap)
        made.reset()
        return made

    def fresh(self) -> TabledBPEStreamingDetokenizer:
        made = copy.copy(self)
        made.reset()
        return made

    def reset(self) -> None:
        self.tokens = []
        self._pending = b""  # the held-back tokens' bytes
        self._pieces: list[str] = []
        self._read = 0  # pieces already handed out by last_segment
        self._length = 0  # characters of text so far

    @property
    def text(self) -> str:  # type: ignore[override]  # mlx-lm's is a plain attribute
        return "".join(self._pieces)

    @property
    def last_segment(self) -> str:
        pieces, read = self._pieces, self._read
        count = len(pieces)
        if read == count:
            return ""
        self._read = count
        return pieces[read] if read == count - 1 else "".join(pieces[read:])

    def _emit(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)

    def _maybe_trim_space(self, current_text: str) -> str:
        # mlx-lm's: a reply's first text loses its leading space.
        if current_text[:1] == " " and not self._length:
            return current_text[1:]
        return current_text

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        try:
            raw, hold = self._entries[token]
        except IndexError:  # mlx-lm's fallback for an id past the token map
            raw, hold = _PAST_THE_MAP
        pending = self._pending + raw
        text = pending.decode("utf-8", "replace")
        # As mlx-lm: wait for a multi-byte character's end, and past a lone space.
        if hold or text.endswith("\ufffd"):
            self._pending = pending
        else:
            if text := self._maybe_trim_space(text):  # _emit, inline: once a token
                self._pieces.append(text)
                self._length += len(text)
            self._pending = b""

    def finalize(self) -> None:
        # mlx-lm's: the held-back text, decoded. mlx-lm maps that text through the byte
        # table again; the bytes are these (for a character outside the table, which
        # only an odd added token could hold back, its lookup raises; here it is UTF-8).
        self._emit(self._maybe_trim_space(self._pending.decode("utf-8", "replace")))
        self._pending = b""


def streaming_detokenizers(tokenizer: Any) -> Any:
    """A callable that makes a fresh streaming detokenizer per request: the tabled one
    where the tokenizer's is exactly mlx-lm's BPE detokenizer of the release whose rules
    it mirrors, else mlx-lm's own."""
    prototype = getattr(tokenizer, "_detokenizer", None)
    if (_byte_decoder is not None and type(prototype) is BPEStreamingDetokenizer
            and mirrors_installed_mlx_lm("BPE streaming detokenizer")):
        return TabledBPEStreamingDetokenizer.from_detokenizer(prototype).fresh
    return lambda: tokenizer.detokenizer
