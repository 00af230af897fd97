"""Prompt (prefix) caching: reuse the KV of a shared prefix instead of recomputing it.

A thin policy over mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction under a
byte budget). Entries are deep copies, so nothing a batch does later (or a failed step)
can change them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlx_serve.runner.prompt_trie import RadixPromptTrie

_MODEL_KEY = "served"  # one model per server

# A shorter shared prefix is not reused: reusing it costs a deep copy of the whole stored
# entry (every layer's keys and values, then trimmed) to save a few tokens of prefill,
# and unrelated prompts often share their first token or two. vLLM's prefix caching
# likewise reuses only whole blocks of 16 tokens.
MIN_REUSED_TOKENS = 16


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max_bytes) if max_bytes else None
        self._trie = RadixPromptTrie()
        if self._lru is not None:  # the same cache over a trie that scales (see its module)
            self._lru._trie = self._trie  # type: ignore[assignment]

    @property
    def enabled(self) -> bool:
        return self._lru is not None

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes if self._lru is not None else 0

    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """(a cache covering a prefix of ``tokens``, the tokens still to prefill).

        The rest is never empty: the batch generator needs one token to start from.
        """
        if self._lru is None or self._reusable(tokens) < MIN_REUSED_TOKENS:
            return None, tokens
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, tokens)
        if cache is None:
            return None, tokens
        if not rest:
            if not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, list(rest)

    def _reusable(self, tokens: list[int]) -> int:
        """How many leading tokens a stored entry could supply, found without a copy."""
        found = self._trie.search(_MODEL_KEY, tokens)
        if found.exact is not None:
            return len(tokens)
        longer = found.common_prefix if found.longer is not None else 0
        return max(len(found.shorter or ()), longer)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        if self._lru is not None and tokens:
            # An extracted cache is a lazy slice of the whole batch's KV buffers: left
            # lazy it would pin all of them, far beyond the bytes the budget counts. The
            # copy is queued, not waited for: a synchronous eval here would also wait
            # for the step already queued on the device, and the MLX thread would lose
            # its overlap with it (a step finishes some request most of the time).
            mx.async_eval([c.state for c in cache])
            self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)
