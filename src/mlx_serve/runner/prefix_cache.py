"""Prompt (prefix) caching: reuse the KV of a shared prefix instead of recomputing it.

A thin policy over mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction under a
byte budget). Entries are deep copies, so nothing a batch does later (or a failed step)
can change them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrie,
    PromptTrieResult,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

_MODEL_KEY = "served"  # one model per server
_VALUE = "__value__"  # how PromptTrie marks a node that ends a stored sequence


class _LinearPromptTrie(PromptTrie):
    """mlx-lm's token trie with a search whose cost grows with the prompt, not the cache.

    mlx-lm looks for the shortest stored sequence that extends the common prefix by
    walking the whole subtree below it, copying the path at every node. When many
    entries share a prefix (a system prompt), every lookup then visits every stored
    token: 18 ms for 100 conversations of 500 tokens, on the thread that steps the
    batch. Any stored sequence below the common prefix serves equally (the cache is
    trimmed back to that prefix), so this search follows one branch down to the
    nearest stored sequence instead.
    """

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        if model not in self._trie:
            return PromptTrieResult(model, None, None, None, 0)
        current = self._trie[model]
        if not tokens and _VALUE in current:
            return PromptTrieResult(model, [], None, None, 0)
        last_index, index = -1, 0
        while index < len(tokens) and tokens[index] in current:
            current = current[tokens[index]]
            if _VALUE in current:
                last_index = index
            index += 1
        if last_index == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last_index + 1] if last_index > 0 else None
        longer = None
        if index > 0:
            extra: list[int] = []
            while _VALUE not in current:  # a node without a value always has children
                token = next(iter(current))
                extra.append(token)
                current = current[token]
            longer = tokens[:index] + extra
        return PromptTrieResult(model, None, shorter, longer, index)


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self._lru = LRUPromptCache(max_size=1 << 20, max_bytes=max_bytes) if max_bytes else None
        if self._lru is not None:
            self._lru._trie = _LinearPromptTrie()

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
        if self._lru is None:
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

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        if self._lru is not None and tokens:
            # An extracted cache is a lazy slice of the whole batch's KV buffers: left
            # lazy it would pin all of them, far beyond the bytes the budget counts.
            mx.eval([c.state for c in cache])
            self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)
