"""What the runner keeps: its batch settings, and each request it generates for."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_serve.generation import GenerationRequest, PromptLogprobs
from mlx_serve.runner.text import TextPipeline


@dataclass(frozen=True)
class BatchLimits:
    decode_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512


class Live:
    """One request the runner is generating for (in the batch, or parked)."""

    __slots__ = ("request", "text", "generated", "uid", "cached_tokens", "prefilled",
                 "prompt_logprobs", "scores_due", "text_done")

    def __init__(self, request: GenerationRequest, text: TextPipeline) -> None:
        self.request = request
        self.text = text
        self.generated: list[int] = []
        self.uid: int | None = None
        self.cached_tokens: int | None = None  # prompt tokens found in the prefix cache
        self.prefilled = False
        self.prompt_logprobs: PromptLogprobs | None = None  # sent with the first delta
        # The prompt's own scores are asked for and not computed yet: it must be scored
        # before it goes into a batch (admitted, or replayed before its first admission).
        self.scores_due = request.output.prompt_logprobs is not None
        self.text_done = False  # its reply has ended: set and read by the text phase only

    @property
    def remaining(self) -> int:
        return self.request.params.max_tokens - len(self.generated)
