"""Token log-probabilities in OpenAI's terms: token text, its bytes, top alternatives."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, cast

import mlx.core as mx

from mlx_serve.generation import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: token characters -> raw bytes."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    chars = list(visible)
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


# JSON has no -Infinity: a token that a mask or penalty ruled out (log-probability -inf)
# is reported with this floor instead, as vLLM does. NaN gets it too.
LOGPROB_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def finite(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Text and bytes of single tokens, cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        hit = self._cache.get(token)
        if hit is None:
            hit = self._cache[token] = self._describe(token)
        return hit

    def _describe(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = self._tokenizer.decode([token])
        piece = self._tokenizer.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece != text and (
                byte := _BYTE_FALLBACK.fullmatch(piece)):
            return text, (int(byte[1], 16),)  # SentencePiece's byte fallback: <0xE2>
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)  # byte-level BPE: exact bytes
            if "\ufffd" in text or raw.decode("utf-8", "replace") == text:
                return text, tuple(raw)
        return text, tuple(text.encode("utf-8"))


def token_logprob(texts: TokenTexts, logprobs: mx.array, token: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``k`` most likely tokens, best first."""
    text, raw = texts(token)
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    if k > 0:
        ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
        id_list = cast(list[int], ids.tolist())
        values = cast(list[float], logprobs[ids].tolist())
        pairs = sorted(zip(id_list, values, strict=True), key=lambda p: -p[1])
        top = tuple((*texts(t), finite(v)) for t, v in pairs)
    return TokenLogprob(text, raw, finite(float(cast(float, logprobs[token].item()))), top)
