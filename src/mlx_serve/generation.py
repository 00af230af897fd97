"""Value types shared by the HTTP layer, the actor and the runner. No logic, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlx_serve.errors import MLXServeError


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


# Presence/frequency/repetition penalties look at this many recent tokens by default.
PENALTY_CONTEXT = 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # How many recent tokens each penalty looks at (mlx-lm's fields; its server's 20).
    repetition_context_size: int = PENALTY_CONTEXT
    presence_context_size: int = PENALTY_CONTEXT
    frequency_context_size: int = PENALTY_CONTEXT
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # end-of-sequence tokens do not end the reply
    min_tokens: int = 0  # no end before this many tokens (EOS and stop ids masked)
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string is kept

    @property
    def has_logits_processors(self) -> bool:
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.repetition_penalty not in (None, 1.0)
            or self.presence_penalty not in (None, 0.0)
            or self.frequency_penalty not in (None, 0.0)
        )


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What to report besides text. None of it changes which tokens are sampled."""

    logprobs: int | None = None  # None: off; k >= 0: chosen token plus k alternatives
    split_reasoning: bool = False  # route thinking/tool-call spans apart (chat only)
    # Tools were offered: a tool-call span is a call. Without them (or with tool_choice
    # "none") no call is parsed, and a tool-call marker is a special token like any other.
    tool_calls: bool = True
    initial_state: str = "normal"  # "reasoning" when the prompt opened a thinking span
    keep_leading_space: bool = False  # chat replies drop the first token's space
    one_tool_call: bool = False  # end the reply where its first tool call ends
    skip_special_tokens: bool = True  # vLLM's: special tokens add no text (special_tokens.py)
    # The prompt's own tokens scored too (completions' echo with logprobs, vLLM's
    # prompt_logprobs), each with this many alternatives (None: off); with prompt_ranks
    # each token's rank in the vocabulary as well (vLLM's format has it).
    prompt_logprobs: int | None = None
    prompt_ranks: bool = False
    # Completions' max_tokens 0 (with echo or prompt_logprobs): the prompt is run (and
    # scored) for its one sampled token, which the reply drops; it ends as "length"
    # with no tokens.
    prompt_only: bool = False
    # A compiled response format (runner.structured.CompiledFormat): it does change the
    # sampled tokens, but only the runner knows how to apply it.
    response_format: object | None = None
    format_param: str = "response_format"  # the request field the format came from


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    user: str | None = None
    index: int = 0  # the choice this sequence answers (n > 1, several prompts)
    output: OutputOptions = OutputOptions()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt's own tokens with their log-probabilities given the tokens before them.

    The first token has nothing before it: only its text is known.
    """

    first_token: str
    scored: tuple[TokenLogprob, ...]  # the prompt's tokens after the first, in order
    ids: tuple[int, ...] = ()  # their token ids
    top_ids: tuple[tuple[int, ...], ...] = ()  # the ids of each one's alternatives (its top)
    ranks: tuple[int, ...] = ()  # each one's rank in the vocabulary, 1 the likeliest (if asked)
    first_bytes: tuple[int, ...] = ()  # the first token's bytes


@dataclass(slots=True)
class Delta:
    """New output of one request in one step. The last one carries ``finish_reason``.

    Not frozen, unlike the values around it, but never changed once made: one is built
    for every token of every stream on the MLX thread, and a frozen dataclass's
    ``__init__`` (a ``object.__setattr__`` call a field) took 0.89 us against 0.17.
    """

    text: str
    token_count: int
    finish_reason: FinishReason | None = None
    index: int = 0
    reasoning: str = ""
    tool_calls: tuple[str, ...] = ()  # raw text of each tool call completed in this step
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0  # on the last delta: prompt tokens reused from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # on the first delta, when asked for
    tool_text: str = ""  # new raw text of a tool call still open after this step


@dataclass(frozen=True, slots=True)
class Failure:
    """The terminal event of a request that could not be completed."""

    error: MLXServeError
    index: int = 0


# What a reply stream carries: any number of Deltas, then exactly one terminal event
# (a Delta with finish_reason, or a Failure).
ReplyEvent = Delta | Failure


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """Everything one runner step produced, returned to the actor in one hop."""

    deltas: tuple[tuple[str, Delta], ...] = ()
    failed: tuple[tuple[str, Exception], ...] = ()  # requests that failed alone
    error: BaseException | None = None  # the step itself failed: rebuild before the next
    skipped: bool = False  # queued behind a failed step: admissions taken, nothing stepped
    ran_batch: bool = False  # the model ran (or tried to run) a batch step: not an empty one
    prefilled: bool = False  # the step also processed prompts (a prefill call)
