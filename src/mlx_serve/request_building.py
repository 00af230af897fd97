"""OpenAI request bodies -> GenerationRequest: field policy, prompt rendering, limits.

Field policy: an OpenAI field that would change the output is honoured or rejected with
a 400; fields that change nothing are accepted; unknown vendor fields are ignored with a
logged warning, as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from mlx_serve.config import Settings
from mlx_serve.errors import ContextLengthExceededError, RequestError, UnsupportedParameterError
from mlx_serve.generation import GenerationRequest, SamplingParams
from mlx_serve.protocol import (
    ACCEPTED_NO_EFFECT,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

log = logging.getLogger(__name__)


def _unsupported(param: str, why: str = "is not supported by this server") -> None:
    raise UnsupportedParameterError(f"'{param}' {why}", param=param)


def check_extra_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS:
            if value not in (None, False, [], {}):
                _unsupported(name)
        elif name not in ACCEPTED_NO_EFFECT:
            log.warning("ignoring unknown request field %r", name)
    if body.n != 1:
        _unsupported("n", "must be 1 (several choices are not supported yet)")


def check_chat_fields(body: ChatCompletionRequest) -> None:
    if body.logprobs or body.top_logprobs:
        _unsupported("logprobs" if body.logprobs else "top_logprobs")
    if body.response_format is not None and body.response_format.type != "text":
        _unsupported("response_format", f"type '{body.response_format.type}' is not supported")
    if body.tools:
        _unsupported("tools")
    if body.tool_choice not in (None, "none", "auto"):
        _unsupported("tool_choice")


def check_completion_fields(body: CompletionRequest) -> None:
    if body.echo:
        _unsupported("echo")
    if body.best_of not in (None, 1):
        _unsupported("best_of", "must be 1")
    if body.suffix:
        _unsupported("suffix")
    if body.logprobs is not None:
        _unsupported("logprobs")


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    prompt_len: int,
    context: int,
    settings: Settings,
    vocab_size: int,
) -> SamplingParams:
    room = context - prompt_len
    if room < 1:
        raise ContextLengthExceededError(
            f"the prompt has {prompt_len} tokens; this model's context is {context}",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    if max_tokens is None:
        max_tokens = min(room, settings.default_max_tokens or room)
    elif prompt_len + max_tokens > context:
        raise ContextLengthExceededError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
            f"context of {context} tokens",
            param="max_tokens",
        )
    for token_id in body.logit_bias or {}:
        if not 0 <= token_id < vocab_size:
            raise RequestError(f"logit_bias token id {token_id} is out of range",
                               param="logit_bias")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        stop=stop,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(sorted((body.logit_bias or {}).items())),
    )


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None and not getattr(
        tokenizer, "has_chat_template", False
    ):
        raise RequestError("this model has no chat template; use /v1/completions")
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as exc:  # template errors (e.g. a role the template refuses)
        raise RequestError(f"the chat template rejected the messages: {exc}",
                           param="messages") from None


async def build_chat_request(
    body: ChatCompletionRequest, runner: Any, settings: Settings, request_id: str
) -> GenerationRequest:
    check_extra_fields(body)
    check_chat_fields(body)
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    # Tokenizing a long prompt is CPU work: keep it off the event loop.
    prompt = await anyio.to_thread.run_sync(_render_chat, runner.tokenizer, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens, len(prompt), runner.context_length, settings,
                             runner.vocab_size)
    return GenerationRequest(request_id, tuple(prompt), params, body.user)


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer.encode(prompt))


async def build_completion_request(
    body: CompletionRequest, runner: Any, settings: Settings, request_id: str
) -> GenerationRequest:
    check_extra_fields(body)
    check_completion_fields(body)
    prompt_field = body.prompt
    if isinstance(prompt_field, list) and isinstance(prompt_field[0], str):
        if len(prompt_field) != 1:
            _unsupported("prompt", "as a list of several strings is not supported yet")
        prompt_field = prompt_field[0]
    if isinstance(prompt_field, str):
        if not prompt_field:
            raise RequestError("'prompt' must not be empty", param="prompt")
        prompt = await anyio.to_thread.run_sync(_encode, runner.tokenizer, prompt_field)
    else:
        prompt = list(prompt_field)
        if any(not 0 <= t < runner.vocab_size for t in prompt):
            raise RequestError("'prompt' holds a token id outside the vocabulary",
                               param="prompt")
    params = sampling_params(body, body.max_tokens, len(prompt), runner.context_length,
                             settings, runner.vocab_size)
    return GenerationRequest(request_id, tuple(prompt), params, body.user)
