"""Per-request samplers and logits processors built from mlx-lm's sample_utils.

Requests with equal unseeded settings share one sampler object, so mlx-lm samples them
in one batched call. A seeded request gets its own sampler whose key depends only on
(seed, position of the token sampled): replaying a request from any position draws the
same keys again, which keeps seeded output exact across recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from mlx_serve.generation import SamplingParams

Sampler = Callable[[mx.array], mx.array]

@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


class SeededSampler:
    """Samples with keys derived from (seed, position), never from MLX's global state."""

    def __init__(self, params: SamplingParams, seed: int, position: int) -> None:
        self._params = params
        self._seed = seed
        self._position = position

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self._params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, 1)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        # Modulo 2**64, the key's range: every int64 seed (and seed + i for choice i)
        # keeps a key of its own.
        key = mx.random.key((self._seed * 1_000_003 + self._position) % (1 << 64))
        self._position += 1
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=key)


def make_request_sampler(params: SamplingParams, position: int) -> Sampler:
    """The sampler for a request whose next sampled token is number ``position``."""
    if params.temperature == 0:
        return greedy_sampler
    if params.seed is None:
        return _shared_sampler(params.temperature, params.top_p, params.min_p, params.top_k)
    return SeededSampler(params, params.seed, position)


class MinTokensProcessor:
    """Rules out the tokens that would end a reply until it has ``min_tokens`` tokens.

    mlx-lm hands a processor the whole context (the prompt, then what was generated),
    so the tokens generated so far are its length past the prompt: after a replay too.
    """

    def __init__(self, prompt_len: int, min_tokens: int, end_ids: Sequence[int]) -> None:
        self._until = prompt_len + min_tokens
        self._end_ids = mx.array(list(end_ids), dtype=mx.int32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size >= self._until or self._end_ids.size == 0:
            return logits
        logits[:, self._end_ids] = -mx.inf  # in place, as mlx-lm's own processors do
        return logits


def make_request_processors(params: SamplingParams, prompt_len: int = 0,
                            end_ids: Sequence[int] = ()) -> list[Callable]:
    """A request's logits processors: bias and penalties (mlx-lm's), then ``min_tokens``
    over ``end_ids`` (the tokens that would end it)."""
    if not params.has_logits_processors:
        return []
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        presence_context_size=params.presence_context_size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=params.frequency_context_size,
    )
    if params.min_tokens:
        processors.append(MinTokensProcessor(prompt_len, params.min_tokens, end_ids))
    return processors
