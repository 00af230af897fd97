"""The log-probabilities of a prompt's own tokens (completions' ``echo`` with ``logprobs``).

Evaluation harnesses (lm-evaluation-harness's ``local-completions``) score a text by
sending it as a prompt with ``echo`` and ``logprobs`` and reading each prompt token's
log-probability given the tokens before it. That needs the model's logits at every
prompt position, which the batch's prefill never keeps (it samples from the last
position only). So the prompt is run through the model here, in chunks, and the KV
cache this leaves behind is handed to the batch: its prefill then has just the last
prompt token to process, and the prompt is computed once, not twice.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_serve.generation import PromptLogprobs, TokenLogprob
from mlx_serve.runner.logprobs import TokenTexts, finite


def score_prompt(model: Any, prompt: list[int], k: int, texts: TokenTexts,
                 chunk_tokens: int) -> tuple[PromptLogprobs, list[Any]]:
    """Score ``prompt[1:]`` given what precedes each token, with ``k`` alternatives.

    Returns the scores and a KV cache of ``prompt[:-1]``, ready for the batch to go on
    from the last prompt token. ``chunk_tokens`` bounds the logits held at once (one
    row of the vocabulary's size per position).
    """
    cache = make_prompt_cache(model)
    tokens = mx.array(prompt)
    scored: list[TokenLogprob] = []
    positions = len(prompt) - 1
    for start in range(0, positions, chunk_tokens):
        end = min(start + chunk_tokens, positions)
        logits = model(tokens[None, start:end], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = tokens[start + 1:end + 1]
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        top_ids = top_values = chosen  # placeholders, not read when k == 0
        if k > 0:
            top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_values, [c.state for c in cache])
        scored += _describe(texts, cast(list[int], targets.tolist()),
                            cast(list[float], chosen.tolist()),
                            top_ids.tolist() if k > 0 else None,
                            top_values.tolist() if k > 0 else None)
    return PromptLogprobs(texts(prompt[0])[0], tuple(scored)), cache


def _describe(texts: TokenTexts, targets: list[int], chosen: list[float],
              top_ids: Any, top_values: Any) -> list[TokenLogprob]:
    out = []
    for i, (token, value) in enumerate(zip(targets, chosen, strict=True)):
        top: tuple[tuple[str, tuple[int, ...], float], ...] = ()
        if top_ids is not None:
            pairs = sorted(zip(top_ids[i], top_values[i], strict=True), key=lambda p: -p[1])
            top = tuple((*texts(t), finite(v)) for t, v in pairs)
        out.append(TokenLogprob(*texts(token), finite(value), top))
    return out
