"""OpenAI request bodies -> GenerationRequests: field policy, prompt rendering, limits.

Field policy: an OpenAI field that would change the output is honoured or rejected with
a 400; fields that change nothing are accepted; unknown vendor fields are ignored with a
logged warning, as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from mlx_serve.config import Settings
from mlx_serve.errors import ContextLengthExceededError, RequestError, UnsupportedParameterError
from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
from mlx_serve.prompt_encoder import KEEP_LOCK_UP_TO_CHARS
from mlx_serve.prompts import (
    ChatText,
    Rendered,
    chat_text,
    render_chat,
    rendered_chat,
    with_allowed_tools,
)
from mlx_serve.protocol import (
    ACCEPTED_NO_EFFECT,
    MESSAGE_UNSUPPORTED,
    PENALTY_CONTEXT_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from mlx_serve.reply_constraint import compile_format, held_calls, reasoning_markers

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """The engine requests for one HTTP request, and what the reply needs to know."""

    requests: tuple[GenerationRequest, ...]
    prompt_tokens: int
    logprobs: int | None = None
    tools: list[dict] | None = None
    reasoning_format: str = "reasoning"
    echo: dict[int, str] = dataclasses.field(default_factory=dict)  # choice -> its prompt
    prompt_logprobs: int | None = None  # vLLM's: the prompt's scores in the reply
    # The reply's calls are written as JSON whatever the model's own format: a forced
    # call, or calls held to a grammar (``strict_calls``), so they are read as JSON.
    calls_as_json: bool = False
    choices_per_prompt: int = 1  # ``n``: choice i answers prompt i // n


def _unsupported(param: str, why: str = "is not supported by this server") -> None:
    raise UnsupportedParameterError(f"'{param}' {why}", param=param)


# Unsupported fields' values that ask for what the server does anyway: OpenAI's default.
_DEFAULTS: dict[str, Any] = {"verbosity": "medium", "modalities": ["text"]}
# Unsupported fields that an empty value turns on ({} is web search with its defaults).
_ON_WHEN_EMPTY = frozenset({"web_search_options"})


def _is_off(name: str, value: Any) -> bool:
    if value is None:
        return True
    if name in _ON_WHEN_EMPTY:
        return False
    return value in (False, [], {}) or _DEFAULTS.get(name) == value


def check_extra_fields(extra: dict[str, Any] | None, unsupported: frozenset[str],
                       no_effect: frozenset[str], prefix: str = "") -> None:
    """The field policy for what a request model does not declare: a field that would
    change the output is a 400 unless it is off (or OpenAI's default); one that changes
    nothing is accepted; anything else (a vendor's) is ignored with a warning, as vLLM
    does. ``prefix``: where these fields sit in the body (``text.``)."""
    for name, value in (extra or {}).items():
        if name in unsupported:
            if not _is_off(name, value):
                _unsupported(prefix + name)
        elif name not in no_effect:
            log.warning("ignoring unknown request field %r", prefix + name)


def check_shared_fields(body: ChatCompletionRequest | CompletionRequest, settings: Settings
                        ) -> None:
    """Checks both endpoints share: OpenAI fields we cannot honour, vendor extras, ``n``,
    and ``stream_options`` without ``stream`` (a 400 at OpenAI and vLLM too)."""
    if body.stream_options is not None and not body.stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true",
                           param="stream_options")
    check_extra_fields(body.model_extra, UNSUPPORTED_FIELDS, ACCEPTED_NO_EFFECT)
    if body.stream_options is not None:
        check_extra_fields(body.stream_options.model_extra, frozenset(), frozenset(),
                           prefix="stream_options.")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM
        raise RequestError("'prompt_logprobs' is not available when 'stream' is true",
                           param="prompt_logprobs")
    if body.n > settings.max_n:
        _unsupported("n", f"must be at most {settings.max_n}")


def check_completion_fields(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of < body.n:  # as OpenAI and vLLM refuse it
        raise RequestError(f"'best_of' ({body.best_of}) must be at least 'n' ({body.n})",
                           param="best_of")
    if body.best_of not in (None, body.n):
        _unsupported("best_of", "must equal n")
    if body.suffix:
        _unsupported("suffix")


GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    prompt_len: int,
    runner: Any,
    settings: Settings,
) -> SamplingParams:
    max_tokens = _output_budget(body, max_tokens, prompt_len, runner.context_length, settings)
    for field, ids in (("logit_bias", body.logit_bias or {}),
                       ("stop_token_ids", body.stop_token_ids or ())):
        if any(not 0 <= t < runner.vocab_size for t in ids):
            raise RequestError(f"'{field}' holds a token id outside the vocabulary",
                               param=field)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        # Below this, dividing the logits by it overflows float32 into noise: greedy, as
        # vLLM treats any temperature under 1e-5.
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # A top_k that keeps the whole vocabulary is no filter (mlx-lm would raise).
        top_k=0 if (body.top_k or 0) >= runner.vocab_size else max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        stop=stop,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        **{field: value for field in PENALTY_CONTEXT_FIELDS
           if (value := getattr(body, field)) is not None},
        logit_bias=tuple(sorted((body.logit_bias or {}).items())),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def _output_budget(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                   prompt_len: int, context: int, settings: Settings) -> int:
    """The reply's token limit: what the request asked for, or what the context leaves
    (capped by the server's default); a 400 where the context cannot hold it."""
    room = context - prompt_len
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if room < 1:
        raise ContextLengthExceededError(
            f"the prompt has {prompt_len} tokens; this model's context is {context}",
            param=param)
    if max_tokens is None:
        max_tokens = min(room, settings.default_max_tokens or room)
    elif prompt_len + max_tokens > context:
        raise ContextLengthExceededError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
            f"context of {context} tokens", param="max_tokens")
    if body.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({body.min_tokens}) must be at most max_tokens "
                           f"({max_tokens})", param="min_tokens")
    return max_tokens


def choices(request_id: str, prompt: list[int], params: SamplingParams, n: int, first: int,
            user: str | None, output: OutputOptions) -> list[GenerationRequest]:
    """``n`` sequences for one prompt; seeded choices get seed, seed + 1, ..."""
    out = []
    for i in range(n):
        p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
        out.append(GenerationRequest(f"{request_id}-{first + i}", tuple(prompt), p, user,
                                     first + i, output))
    return out


async def build_chat_request(
    body: ChatCompletionRequest, runner: Any, settings: Settings, request_id: str
) -> Prepared:
    check_shared_fields(body, settings)
    for i, message in enumerate(body.messages):
        check_extra_fields(message.model_extra, MESSAGE_UNSUPPORTED, frozenset(),
                           f"messages.{i}.")
    body = with_allowed_tools(body)
    if body.top_logprobs and not body.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    rendered = await _rendered(body, runner)
    calls = held_calls(body, rendered, runner.tokenizer)
    response_format, format_param = await compile_format(
        body, runner, rendered.forced_call, calls,
        reasoning_markers(runner.tokenizer, rendered))
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens,
                             len(rendered.tokens), runner, settings)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    output = OutputOptions(logprobs=logprobs, split_reasoning=rendered.split_reasoning,
                           tool_calls=rendered.tools is not None,
                           initial_state=rendered.initial_state,
                           # a continued message's next word keeps its leading space
                           keep_leading_space=body.continue_final_message,
                           one_tool_call=body.parallel_tool_calls is False,
                           skip_special_tokens=body.skip_special_tokens,
                           response_format=response_format, format_param=format_param,
                           prompt_logprobs=body.prompt_logprobs,
                           prompt_ranks=body.prompt_logprobs is not None)
    reqs = choices(request_id, rendered.tokens, params, body.n, 0, body.user, output)
    reasoning_format = body.reasoning_format or settings.reasoning_format
    return Prepared(tuple(reqs), len(rendered.tokens), logprobs, rendered.tools,
                    reasoning_format, prompt_logprobs=body.prompt_logprobs,
                    choices_per_prompt=body.n,
                    calls_as_json=rendered.forced_call is not None
                    or (calls is not None and calls["as_json"]))


# Text up to this many characters is rendered and tokenized with the other short
# prompts of its event-loop pass (PromptEncoder.encode_soon): a lone one on the loop,
# where it takes 0.1-0.5 ms, less than a worker-thread hop, which added about 1 ms to
# the time to first token under load; a burst's together on one worker thread. Longer
# text (a long prompt is CPU work) goes to a thread of its own, where the encoder
# releases the interpreter lock (prompt_encoder.py).
INLINE_TEXT_CHARS = KEEP_LOCK_UP_TO_CHARS


async def off_loop_if_long(chars: int | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the event loop for short input; in a worker thread otherwise.

    ``chars`` None: the input's size is not known cheaply, so it goes to a thread.
    """
    if chars is not None and chars <= INLINE_TEXT_CHARS:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


async def _rendered(body: ChatCompletionRequest, runner: Any) -> Rendered:
    """A short chat is rendered and encoded with the other prompts of this loop pass
    (``PromptEncoder.encode_soon``: alone, on the loop; in a burst, on a worker thread);
    a long one, or one with tools, in a worker thread of its own."""
    chars = _chat_chars(body)
    if chars is None or chars > INLINE_TEXT_CHARS:
        return await anyio.to_thread.run_sync(render_chat, runner.tokenizer, runner.encode,
                                              body)
    made: list[ChatText] = []

    def text() -> str:  # where the encoder runs it
        made.append(chat_text(runner.tokenizer, body))
        return made[0].text

    tokens = await runner.encode.encode_soon(text, add_special_tokens=False)
    return rendered_chat(runner.tokenizer, runner.encode, body, made[0], tokens)


# The fixed work of each message a template renders (role markers, separators) or each
# prompt encoded, in characters: many short items are as much work as one long one.
ITEM_OVERHEAD_CHARS = 64


def _chat_chars(body: ChatCompletionRequest) -> int | None:
    """The text a chat template renders, roughly; None when tools add schemas to it."""
    if body.tools:
        return None
    return sum(ITEM_OVERHEAD_CHARS + len(m.text())
               + len(m.reasoning or m.reasoning_content or "")
               + sum(len(c.function.arguments) for c in m.tool_calls or ())
               for m in body.messages)


async def _completion_prompts(body: CompletionRequest, runner: Any) -> list[list[int]]:
    field = body.prompt
    if isinstance(field, str):
        field = [field]
    if isinstance(field[0], int):
        prompts = [list(field)]  # type: ignore[arg-type]
    elif isinstance(field[0], list):
        prompts = [list(p) for p in field]  # type: ignore[union-attr]
    else:
        if any(not p for p in field):
            raise RequestError("'prompt' must not be empty", param="prompt")
        chars = sum(ITEM_OVERHEAD_CHARS + len(p) for p in field)  # many short ones add up
        if chars <= INLINE_TEXT_CHARS:  # with the other prompts of this loop pass
            prompts = list(await asyncio.gather(*map(runner.encode.encode_soon, field)))
        else:  # one hop for all of them, not one each
            prompts = await anyio.to_thread.run_sync(runner.encode.encode_many, field)
    if any(not 0 <= t < runner.vocab_size for p in prompts for t in p):
        raise RequestError("'prompt' holds a token id outside the vocabulary", param="prompt")
    return prompts


async def build_completion_request(
    body: CompletionRequest, runner: Any, settings: Settings, request_id: str
) -> Prepared:
    check_shared_fields(body, settings)
    check_completion_fields(body)
    prompts = await _completion_prompts(body, runner)
    if len(prompts) * body.n > settings.max_n:
        _unsupported("prompt", f"times n may make at most {settings.max_n} choices")
    # A completion continues the prompt: its first token's leading space is real text.
    # With echo, logprobs cover the echoed prompt's tokens too (as at OpenAI and vLLM);
    # vLLM's prompt_logprobs asks for them on their own. Scored once, for both.
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs)
             if k is not None]
    prompt_only = _prompt_only(body)
    response_format, format_param = await compile_format(body, runner)
    output = OutputOptions(logprobs=body.logprobs, keep_leading_space=True,
                           skip_special_tokens=body.skip_special_tokens,
                           response_format=response_format, format_param=format_param,
                           prompt_logprobs=max(asked) if asked else None,
                           prompt_ranks=body.prompt_logprobs is not None,
                           prompt_only=prompt_only)
    # The prompt only still runs one step: its one token is sampled, then dropped.
    max_tokens = 1 if prompt_only else body.max_tokens
    reqs: list[GenerationRequest] = []
    for i, prompt in enumerate(prompts):  # OpenAI numbers choices prompt by prompt
        params = sampling_params(body, max_tokens, len(prompt), runner, settings)
        reqs += choices(request_id, prompt, params, body.n, i * body.n, body.user, output)
    echo = _echoes(body, prompts, runner) if body.echo else {}
    return Prepared(tuple(reqs), sum(len(p) for p in prompts), body.logprobs, echo=echo,
                    choices_per_prompt=body.n,
                    prompt_logprobs=body.prompt_logprobs)


def _prompt_only(body: CompletionRequest) -> bool:
    """Whether the reply is about the prompt alone: ``max_tokens`` 0 with ``echo``
    (OpenAI's legacy way to score a prompt) or with vLLM's ``prompt_logprobs``. Without
    either, 0 asks for nothing."""
    if body.max_tokens != 0:
        return False
    if not body.echo and body.prompt_logprobs is None:
        raise RequestError("'max_tokens' must be at least 1 (0 scores the prompt alone, "
                           "with 'echo' or 'prompt_logprobs')", param="max_tokens")
    if body.min_tokens:
        raise RequestError(f"'min_tokens' ({body.min_tokens}) must be at most max_tokens (0)",
                           param="min_tokens")
    return True


def _echoes(body: CompletionRequest, prompts: list[list[int]], runner: Any) -> dict[int, str]:
    """Each choice's prompt as text: as sent, or decoded when sent as token ids."""
    texts: list[str]
    if isinstance(body.prompt, str):
        texts = [body.prompt]
    elif isinstance(body.prompt[0], str):
        texts = [str(p) for p in body.prompt]
    else:  # token ids, one prompt or several
        texts = [runner.tokenizer.decode(p) for p in prompts]
    return {i * body.n + j: text for i, text in enumerate(texts) for j in range(body.n)}
