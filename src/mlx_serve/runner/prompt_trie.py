"""A radix tree with the interface of mlx-lm's ``PromptTrie``, for ``LRUPromptCache``.

mlx-lm's trie spends one Python dict per stored token. With a small model's KV cache a
1 GiB budget holds about a million tokens: a million dicts, each insert allocating
hundreds of them (the garbage collector then walks them all, on the thread that steps
the batch), and a search that looks for a sequence extending the common prefix by
visiting the whole subtree below it. Here an edge holds a run of tokens as a tuple, so
an insert adds at most two nodes, walks compare runs in C, and a search descends one
branch.

Results match mlx-lm's, except that ``longer`` may name any stored sequence through the
common prefix rather than the shortest: the cache trims it back to that prefix either
way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import PromptTrieResult

_NO_VALUE = object()


class _Node:
    __slots__ = ("children", "value")

    def __init__(self) -> None:
        # first token of the edge -> (the edge's tokens, the node it leads to)
        self.children: dict[int, tuple[tuple[int, ...], _Node]] = {}
        self.value: Any = _NO_VALUE

    @property
    def has_value(self) -> bool:
        return self.value is not _NO_VALUE


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[start:]`` (binary search on
    slices: each comparison runs in C)."""
    limit = min(len(edge), len(tokens) - start)
    if tuple(tokens[start:start + limit]) == edge[:limit]:
        return limit
    low, high = 0, limit  # edge[:low] matches; edge[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        if tuple(tokens[start:start + mid]) == edge[:mid]:
            low = mid
        else:
            high = mid
    return low


class RadixPromptTrie:
    def __init__(self) -> None:
        self._roots: dict[Any, _Node] = {}

    def _walk(self, model: Any, tokens: Sequence[int]) -> list[tuple[_Node, int]]:
        """The nodes on the exact path of ``tokens`` as (node, depth); KeyError if absent."""
        node, depth = self._roots[model], 0
        path = [(node, 0)]
        while depth < len(tokens):
            edge, child = node.children[tokens[depth]]
            if tuple(tokens[depth:depth + len(edge)]) != edge:
                raise KeyError(tuple(tokens))
            node, depth = child, depth + len(edge)
            path.append((node, depth))
        return path

    def add(self, model: Any, tokens: Sequence[int], value: Any) -> Any:
        node, depth = self._roots.setdefault(model, _Node()), 0
        while depth < len(tokens):
            first = tokens[depth]
            entry = node.children.get(first)
            if entry is None:
                leaf = _Node()
                node.children[first] = (tuple(tokens[depth:]), leaf)
                node, depth = leaf, len(tokens)
                break
            edge, child = entry
            k = _common_length(edge, tokens, depth)
            if k < len(edge):  # split the edge where the new sequence leaves it
                middle = _Node()
                middle.children[edge[k]] = (edge[k:], child)
                node.children[first] = (edge[:k], middle)
                child = middle
            node, depth = child, depth + k
        previous = node.value if node.has_value else None
        node.value = value
        return previous

    def get(self, model: Any, tokens: Sequence[int]) -> Any:
        node = self._walk(model, tokens)[-1][0]
        if not node.has_value:
            raise KeyError(tuple(tokens))
        return node.value

    def pop(self, model: Any, tokens: Sequence[int]) -> Any:
        path = self._walk(model, tokens)
        node = path[-1][0]
        if not node.has_value:
            raise KeyError(tuple(tokens))
        value, node.value = node.value, _NO_VALUE
        # Drop nodes left with neither a value nor children: every leaf keeps a value,
        # which is what lets a search descend to one without backtracking.
        for i in range(len(path) - 1, 0, -1):
            node, depth = path[i]
            if node.has_value or node.children:
                break
            parent, parent_depth = path[i - 1]
            del parent.children[tokens[parent_depth]]
        return value

    def pop_prefixes(self, model: Any, tokens: Sequence[int]) -> list[tuple[int, Any]]:
        """Remove and return the values stored at strict prefixes of ``tokens``."""
        values = []
        node, depth = self._roots[model], 0
        while depth < len(tokens):
            if node.has_value:
                values.append((depth, node.value))
                node.value = _NO_VALUE
            edge, node = node.children[tokens[depth]]
            depth += len(edge)
        return values

    def search(self, model: Any, tokens: Sequence[int]) -> PromptTrieResult:
        tokens = list(tokens)
        if model not in self._roots:
            return PromptTrieResult(model, None, None, None, 0)
        node, depth = self._roots[model], 0
        if not tokens and node.has_value:
            return PromptTrieResult(model, [], None, None, 0)
        last_index = -1  # index of the last token of the longest stored prefix
        rest: tuple[int, ...] = ()  # the unmatched part of an edge the walk stopped in
        while depth < len(tokens):
            entry = node.children.get(tokens[depth])
            if entry is None:
                break
            edge, child = entry
            k = _common_length(edge, tokens, depth)
            if k < len(edge):
                depth, rest, node = depth + k, edge[k:], child
                break
            node, depth = child, depth + k
            if node.has_value:
                last_index = depth - 1
        if not rest and last_index == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last_index + 1] if last_index > 0 else None
        longer = None
        if depth > 0:
            extra = list(rest)
            while not node.has_value:  # a node without a value always has children
                edge, node = next(iter(node.children.values()))
                extra.extend(edge)
            longer = tokens[:depth] + extra
        return PromptTrieResult(model, None, shorter, longer, depth)
