"""A known-good forward pass outside the batch: a broken engine, or requests that fail
on their own?

When ``--max-failed-rebuilds`` requests in a row have each failed alone with no good step
between them, the actor cannot tell which it is from the steps: with requests arriving
one at a time, a client that sends the same failing request three times looks like an
engine that fails everything. This runs the model over a few tokens with a fresh cache
and waits for its logits: if that works, the engine still computes and serving goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def self_test(model: Any, tokens: Sequence[int]) -> None:
    """Raise if the model cannot compute logits for ``tokens`` (or they are not finite)."""
    logits = model(mx.array([list(tokens)]), cache=make_prompt_cache(model))
    finite = mx.all(mx.isfinite(logits))
    mx.eval(finite)
    if not finite.item():
        raise RuntimeError("the self-test's logits are not finite")
