"""The log-probabilities of a prompt's own tokens (completions' ``echo`` with ``logprobs``).

Evaluation harnesses (lm-evaluation-harness's ``local-completions``) score a text by
sending it as a prompt with ``echo`` and ``logprobs`` and reading each prompt token's
log-probability given the tokens before it. That needs the model's logits at every
prompt position, which the batch's prefill never keeps (it samples from the last
position only). So the prompts are run through the model here, several at once, in
chunks, and the KV cache each leaves behind is handed to the batch: its prefill then
has just the last prompt token to process, and a prompt is computed once, not twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_serve.generation import GenerationRequest, PromptLogprobs, TokenLogprob
from mlx_serve.runner.logprobs import TokenTexts, finite

# One prompt's scores and the KV cache of all its tokens but the last (None for a
# one-token prompt: there is nothing before its only token).
Scored = tuple[PromptLogprobs, list[Any] | None]


def score_requests(model: Any, requests: Sequence[GenerationRequest], texts: TokenTexts,
                   chunk_tokens: int, max_rows: int) -> dict[str, Scored | Exception]:
    """The prompts of the requests that asked for their scores, scored together; a
    fault is every such request's own (each fails alone, the others go on)."""
    wanted = [r for r in requests if r.output.prompt_logprobs is not None]
    if not wanted:
        return {}
    try:
        results: list[Scored | Exception] = list(score_prompts(
            model, [r.prompt_tokens for r in wanted],
            [r.output.prompt_logprobs or 0 for r in wanted], texts, chunk_tokens, max_rows,
            ranks=[r.output.prompt_ranks for r in wanted]))
    except Exception as exc:
        results = [exc] * len(wanted)
    return {r.request_id: result for r, result in zip(wanted, results, strict=True)}


def score_prompts(model: Any, prompts: Sequence[Sequence[int]], ks: Sequence[int],
                  texts: TokenTexts, chunk_tokens: int, max_rows: int,
                  ranks: Sequence[bool] | None = None) -> list[Scored]:
    """Score each prompt's tokens after the first, with ``ks[i]`` alternatives each (and
    their ranks in the vocabulary where ``ranks[i]``).

    Prompts of similar length go through the model together, up to ``max_rows`` at a
    time, right-padded (a causal model's real positions never see the padding after
    them); a model whose cache is not plain KV goes one prompt at a time. At most
    ``chunk_tokens`` positions (rows times columns) are computed at once, which bounds
    the logits held (one vocabulary-sized row each).
    """
    ranks = ranks or [False] * len(prompts)
    out: list[Scored | None] = [None] * len(prompts)
    # The same prompt (a request's n choices, or several requests) is scored once: its
    # first index stands for every index that has it.
    alike: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        if len(prompt) < 2:
            out[i] = (PromptLogprobs(texts(prompt[0])[0], ()), None)
        else:
            alike.setdefault(tuple(prompt), []).append(i)
    longer = sorted(alike.values(), key=lambda same: len(prompts[same[0]]))  # less padding
    rows = max_rows if all(type(c) is KVCache for c in make_prompt_cache(model)) else 1
    for at in range(0, len(longer), rows):
        group = longer[at:at + rows]
        k = max(ks[i] for same in group for i in same)
        scored = _score_together(model, [prompts[same[0]] for same in group], k, texts,
                                 chunk_tokens, any(ranks[i] for same in group for i in same))
        for same, (row, cache) in zip(group, scored, strict=True):
            for n, i in enumerate(same):  # each its own cache: the batch extends it
                out[i] = (row.result(texts(prompts[i][0]), ks[i], ranks[i]),
                          cache if n == 0 else _copied(cache))
    return cast(list[Scored], out)


class _Row:
    """One prompt's scores as they come, chunk by chunk."""

    def __init__(self) -> None:
        self.items: list[TokenLogprob] = []
        self.ids: list[int] = []
        self.top_ids: list[tuple[int, ...]] = []
        self.ranks: list[int] = []

    def add(self, texts: TokenTexts, ids: list[int], values: list[float],
            alternatives: tuple[list[list[int]], list[list[float]]] | None,
            ranks: list[int] | None) -> None:
        for i, (token, value) in enumerate(zip(ids, values, strict=True)):
            pairs: list[tuple[int, float]] = []
            if alternatives is not None:
                pairs = sorted(zip(alternatives[0][i], alternatives[1][i], strict=True),
                               key=lambda p: -p[1])
            self.items.append(TokenLogprob(*texts(token), finite(value),
                                           tuple((*texts(t), finite(v)) for t, v in pairs)))
            self.top_ids.append(tuple(t for t, _ in pairs))
        self.ids += ids
        self.ranks += ranks or []

    def result(self, first_token: tuple[str, tuple[int, ...]], k: int, ranks: bool
               ) -> PromptLogprobs:
        """The scores one request asked for: its own number of alternatives (sorted best
        first, so the first ``k`` of a larger group's), its ranks if asked."""
        items = self.items
        if items and len(items[0].top) > k:  # the group scored more than this one asked
            items = [TokenLogprob(t.token, t.bytes, t.logprob, t.top[:k]) for t in items]
        return PromptLogprobs(first_token[0], tuple(items), tuple(self.ids),
                              tuple(t[:k] for t in self.top_ids),
                              tuple(self.ranks) if ranks else (), tuple(first_token[1]))


def _score_together(model: Any, prompts: list[Sequence[int]], k: int, texts: TokenTexts,
                    chunk_tokens: int, ranks: bool) -> list[tuple[_Row, list[Any]]]:
    lengths = [len(p) - 1 for p in prompts]  # scored positions: every token but the last
    width = max(lengths)
    tokens = mx.array([list(p) + [0] * (width + 1 - len(p)) for p in prompts])
    cache = make_prompt_cache(model)
    scored = [_Row() for _ in prompts]
    step = max(1, chunk_tokens // len(prompts))
    for start in range(0, width, step):
        end = min(start + step, width)
        logits = model(tokens[:, start:end], cache=cache).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = tokens[:, start + 1:end + 1]
        chosen = mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        top_ids = top_values = rank = chosen  # placeholders, not read unless asked for
        if k == 1:  # what evaluation harnesses ask for; a partition costs far more
            top_ids = mx.argmax(logprobs, axis=-1, keepdims=True)
        elif k > 1:
            top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        if k > 0:
            top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        if ranks:  # 1 + how many tokens are likelier than the prompt's own
            rank = (logprobs > chosen[..., None]).sum(axis=-1) + 1
        mx.eval(chosen, top_ids, top_values, rank, [c.state for c in cache])
        ids: Any = targets.tolist()
        values: Any = chosen.tolist()
        alternatives: Any = (top_ids.tolist(), top_values.tolist()) if k > 0 else None
        rank_list: Any = rank.tolist() if ranks else None
        for row, length in enumerate(lengths):
            real = max(0, min(end, length) - start)  # the row's positions in this chunk
            scored[row].add(texts, ids[row][:real], values[row][:real],
                            None if alternatives is None else (alternatives[0][row][:real],
                                                               alternatives[1][row][:real]),
                            None if rank_list is None else rank_list[row][:real])
    if len(prompts) == 1:
        return [(scored[0], cache)]
    return [(row, _row_cache(cache, i, length))
            for i, (row, length) in enumerate(zip(scored, lengths, strict=True))]


def _copied(cache: list[Any]) -> list[Any]:
    """Another prompt cache holding the same KV (new array objects for the same data)."""
    return _row_cache(cache, 0, cache[0].offset)


def _row_cache(cache: list[Any], row: int, length: int) -> list[Any]:
    """One prompt's KV out of a batch's: its row, without the padding after it."""
    out = []
    for layer in cache:
        own = KVCache()
        own.keys = layer.keys[row:row + 1, :, :length]
        own.values = layer.values[row:row + 1, :, :length]
        own.offset = length
        out.append(own)
    return out
