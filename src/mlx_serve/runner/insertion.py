"""One request's sequence put into mlx-lm's batch, with what only it samples by."""

from __future__ import annotations

from typing import Any

from mlx_serve.runner.end_tokens import EndTokens
from mlx_serve.runner.format_guard import FormatFaults
from mlx_serve.runner.live import Live
from mlx_serve.runner.sampling import make_request_processors, make_request_sampler


def insert_sequence(batch: Any, live: Live, prompt: list[int], cache: Any, rest: list[int],
                    end_tokens: EndTokens, format_faults: FormatFaults) -> int:
    """Insert ``live``'s sequence into ``batch``, its KV ``cache`` holding ``prompt``
    up to ``rest`` (the tokens still to run), with its own sampler, logits processors
    (a response format's matcher among them) and end tokens; its uid in the batch."""
    request = live.request
    params = request.params
    end_ids = end_tokens.ids(params)
    processors = make_request_processors(params, len(request.prompt_tokens), end_ids)
    fmt = request.output.response_format
    if fmt is not None:  # a fresh matcher, fast-forwarded over what was generated
        matcher = fmt.make_processor_at(  # type: ignore[attr-defined]
            len(request.prompt_tokens), live.generated)
        processors.append(format_faults.guard(request.request_id, matcher,
                                               request.output.format_param))
    (uid,) = batch.insert(
        [rest],
        max_tokens=[live.remaining],
        caches=[cache] if cache is not None else None,
        all_tokens=[prompt[: len(prompt) - len(rest)]],
        samplers=[make_request_sampler(params, len(live.generated))],
        logits_processors=[processors],
        stop_sequences=[end_tokens.stop_sequences(end_ids)],
    )
    return uid
