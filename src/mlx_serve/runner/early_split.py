"""Newcomers move into the decode batch in the step that finished their prefill.

mlx-lm 0.32's ``BatchGenerator`` splits a prompt into everything but its last token and
that last token. One ``next()`` call prefills the first part; the *next* call moves the
sequence into the decode batch (queuing its first token); the call after that returns
the token. So a newcomer waits three batch steps for its first token, one of them only
for the move.

``use_early_split`` makes each call also move the sequences whose prefill it has just
finished, at its end: the same move with the same arguments, one call sooner, so the
first token comes a step sooner. Each sequence's tokens are computed from the same cache
and inputs; what changes is only the step at which it joins the decode batch, which in
plain serving already depends on when its request arrived. With nothing else in the
batch (one stream) the steps are the same ones, one call earlier; the tests compare
the outputs with mlx-lm's own schedule.

The move also samples each moved sequence's first token (mlx-lm's ``generate`` runs its
first decode step), but ``next()`` hands that token back only at the end of the *next*
call, which at 64-128 streams is often another group's prefill. ``take_first_tokens``
reads those tokens as soon as the call that moved them returns, so a server can send
them a call sooner still; the next call hands the same tokens back as usual, and
``drop_handed_back`` takes out the ones ``mark_sent_ahead`` recorded as sent.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, NamedTuple

from mlx_lm.generate import PromptProcessingBatch

from mlx_serve.runner.decode_step import mirrors_installed_mlx_lm


def move_prefilled(self: Any, prompt_responses: list[Any]) -> None:
    """mlx-lm 0.32.2's split block of ``BatchGenerator._next``, run for the sequences
    whose whole prompt but the last token is in their cache. ``self``: the BatchGenerator.
    """
    if len(self._generation_batch) >= self.completion_batch_size:
        return  # mlx-lm moves none while the decode batch is full; nor does this
    split: list[int] = []
    keep: list[int] = []
    for i, seq in enumerate(self._currently_processing):
        segments = seq[0]
        (split if len(segments) == 1 and len(segments[0]) == 1 else keep).append(i)
    if not split:
        return
    last_inputs = [self._currently_processing[i][0][0] for i in split]
    progress = [(self._currently_processing[i][2],) * 2 for i in split]
    self._currently_processing = [self._currently_processing[i] for i in keep]
    gen_batch = self._prompt_batch.split(split).generate(last_inputs)
    for i, p in enumerate(progress):
        prompt_responses.append(
            PromptProcessingBatch.Response(gen_batch.uids[i], p, True, True))
    # Kept for ``take_first_tokens``; replaced by the next move, so nothing accumulates
    # in a generator whose caller never takes them.
    self._moved_first_tokens = (list(gen_batch.uids), gen_batch._next_tokens)
    self._generation_batch.extend(gen_batch)


class FirstToken(NamedTuple):
    """A first token read ahead, shaped as the batch's own response for it."""

    uid: int
    token: int
    logprobs: Any = None
    finish_reason: str | None = None
    prompt_cache: Any = None
    all_tokens: Any = None


def take_first_tokens(batch_generator: Any) -> dict[int, int]:
    """The first tokens of the sequences the last ``next()`` call moved into decoding,
    by uid; empty if it moved none (or the change is not in place). Reading them waits
    for their sampling, a single-token forward pass queued by the move."""
    moved = vars(batch_generator).pop("_moved_first_tokens", None)
    if moved is None:
        return {}
    uids, tokens = moved
    return dict(zip(uids, tokens.tolist(), strict=True))


def mark_sent_ahead(batch_generator: Any, sent: dict[int, int]) -> None:
    """Record the first tokens (by uid) sent ahead after the last ``next()`` call."""
    if sent:
        batch_generator._sent_ahead = sent


def drop_handed_back(batch_generator: Any, responses: list[Any]) -> list[Any]:
    """A ``next()`` call's responses without the first tokens sent ahead after the call
    before it: the batch hands each back in the very next call, or never (its sequence
    was removed meanwhile). Anything but the same token, unfinished, is a fault."""
    sent = vars(batch_generator).pop("_sent_ahead", None)
    if not sent:
        return responses
    kept = []
    for r in responses:
        token = sent.get(r.uid)
        if token is None:
            kept.append(r)
        elif r.token != token or r.finish_reason is not None:
            raise RuntimeError(f"the batch handed back token {r.token} ({r.finish_reason}) "
                               f"for token {token}, sent ahead")
    return kept


def _next_with_early_split(self: Any) -> tuple[list[Any], list[Any]]:
    prompt_responses, generation_responses = type(self)._next(self)
    move_prefilled(self, prompt_responses)
    return prompt_responses, generation_responses


def use_early_split(batch_generator: Any) -> bool:
    """Make ``batch_generator`` move prefilled sequences into decoding a call sooner.

    With an mlx-lm whose ``_next`` this does not mirror, its own schedule stays;
    returns whether the change is in place.
    """
    if not mirrors_installed_mlx_lm("prefill schedule"):
        return False
    batch_generator._next = MethodType(_next_with_early_split, batch_generator)
    return True
