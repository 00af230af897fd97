"""mlx-lm's decode step, with each step's log-probabilities evaluated as one array.

mlx-lm 0.32's ``GenerationBatch._step`` splits the step's ``[batch, vocab]``
log-probabilities into one row array per sequence and evaluates every row, then waits
for every row again in the next step. Each row is an array of its own for MLX's
scheduler, so a batch of 128 costs 256 array evaluations a step beside the model's own.
Without them steps were 6-18 % shorter in 5 of 6 pairs on the CPU (tiny model, batch
64-128) and 0.87 [0.77-1.07] as long on an H200 (1B, batch 128, 6 pairs); see
benchmarks/README.md, "The one-array decode step".

``one_array_step`` is the same step, line for line, except that it evaluates the
log-probabilities as the one array they are. The rows handed back are still one array
per sequence, as mlx-lm hands them: views of the evaluated array, evaluated only if
read (a request that asked for logprobs). The tokens are the same arrays computed the
same way, so the output is identical; the tests compare it with the stock step.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

import mlx.core as mx
import mlx_lm

log = logging.getLogger(__name__)

# The mlx-lm release whose GenerationBatch._step this mirrors; any other keeps its own.
MIRRORED_RELEASE = "0.32.2"


def one_array_step(self: Any) -> tuple[list[int], list[mx.array]]:
    """mlx-lm 0.32.2's ``GenerationBatch._step``, logprobs evaluated as one array.

    Bound to a GenerationBatch by ``use_one_array_step``.
    """
    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens

    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]

    token_context = []
    if any(self.logits_processors):
        processed_logits = []
        for e in range(len(self.uids)):
            sample_logits = logits[e : e + 1]
            processors = self.logits_processors[e] or ()
            if processors:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    sample_logits = processor(context, sample_logits)
            processed_logits.append(sample_logits)
        logits = mx.concatenate(processed_logits, axis=0)

    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    samplers = [
        self.fallback_sampler if s is None else s
        for s in (self.samplers or [None] * len(self.uids))
    ]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate(
            [s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0
        )

    self._next_tokens = sampled
    # Still one row per sequence (extend and filter keep lists), but lazy views of
    # ``logprobs``, which is what gets evaluated: one array instead of one per row.
    self._next_logprobs = list(logprobs)
    mx.async_eval(self._next_tokens, logprobs, token_context)

    # The current tokens were evaluated with their logprobs' array by the previous step.
    mx.eval(inputs)
    token_list = inputs.tolist()
    for sti, ti in zip(self.tokens, token_list, strict=False):
        sti.append(ti)
    return token_list, self._current_logprobs


def mirrors_installed_mlx_lm(what: str) -> bool:
    """Whether the installed mlx-lm is the release our copies of its code mirror; if not,
    log that mlx-lm's own ``what`` stays (an override of other code could misbehave)."""
    if mlx_lm.__version__ == MIRRORED_RELEASE:
        return True
    log.warning("mlx-lm %s: keeping its own %s (mlx_serve's mirrors mlx-lm %s)",
                mlx_lm.__version__, what, MIRRORED_RELEASE)
    return False


def use_one_array_step(batch_generator: Any) -> bool:
    """Make ``batch_generator``'s decode batch step with ``one_array_step``.

    The decode batch lives as long as its generator (new sequences are merged into it),
    so one override per generator is enough. With an mlx-lm this step does not mirror,
    the stock step stays; returns whether the override is in place.
    """
    if not mirrors_installed_mlx_lm("decode step"):
        return False
    batch = batch_generator._generation_batch
    batch._step = MethodType(one_array_step, batch)
    return True
