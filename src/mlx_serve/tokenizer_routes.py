"""vLLM's tokenizer endpoints: ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``.

Evaluation harnesses use them to tokenize on the server (lm-evaluation-harness checks for
``/tokenizer_info`` and ``/tokenize`` before it falls back to loading the tokenizer from a
model hub). Like vLLM's, they sit outside ``/v1`` and need no API key.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_serve.errors import RequestError, UnsupportedParameterError
from mlx_serve.http_input import check_model, parse, read_json, ready_engine, server_state
from mlx_serve.json_response import JSONResponse
from mlx_serve.prompts import render_chat
from mlx_serve.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from mlx_serve.request_building import check_extra_fields, off_loop_if_long

# vLLM's fields that would change the tokens and are not served here (a chat template of
# the client's own); any other unknown field is logged and ignored.
TOKENIZE_UNSUPPORTED = frozenset({"chat_template"})


async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: the prompt tokens a completion (``prompt``) or a chat
    (``messages``, through the chat template) would have here."""
    state = server_state(request)
    body = parse(TokenizeRequest, await read_json(request, state))
    check_extra_fields(body.model_extra, TOKENIZE_UNSUPPORTED, frozenset())
    check_model(state, body.model)
    runner = ready_engine(state).runner
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either 'prompt' or 'messages'", param="prompt")
    if body.messages is not None:
        if body.add_special_tokens:  # a chat prompt is what a chat request would get
            raise UnsupportedParameterError("'add_special_tokens' is not supported with "
                                            "messages", param="add_special_tokens")
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
        rendered = await off_loop_if_long(None, render_chat, runner.tokenizer, runner.encode,
                                          chat)
        tokens = rendered.tokens
    else:
        special = body.add_special_tokens is not False
        tokens = await off_loop_if_long(len(body.prompt or ""), runner.encode, body.prompt,
                                        special)
    strs = runner.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return JSONResponse({"count": len(tokens), "max_model_len": runner.context_length,
                         "tokens": tokens, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """vLLM's ``/detokenize``: token ids -> text."""
    state = server_state(request)
    body = parse(DetokenizeRequest, await read_json(request, state))
    check_extra_fields(body.model_extra, frozenset(), frozenset())
    check_model(state, body.model)
    runner = ready_engine(state).runner
    if any(not 0 <= t < runner.vocab_size for t in body.tokens):
        raise RequestError("'tokens' holds a token id outside the vocabulary", param="tokens")
    text = await off_loop_if_long(len(body.tokens), runner.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration and chat template."""
    runner = ready_engine(server_state(request)).runner
    return JSONResponse(tokenizer_config(runner.tokenizer, runner.context_length))


# Configuration entries that name files on the server, or hold objects, not settings.
_NOT_SHOWN = frozenset({"tokenizer_object", "added_tokens_decoder", "tokenizer_file",
                        "name_or_path", "vocab_file", "merges_file"})
_SKIP = object()


def tokenizer_config(tokenizer: Any, context_length: int) -> dict[str, Any]:
    """The Hugging Face tokenizer's settings as JSON, with its special tokens as text,
    its class, the served context length and its chat template (as vLLM reports them)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm wraps the HF tokenizer
    config = {}
    for name, value in (getattr(hf, "init_kwargs", None) or {}).items():
        if name not in _NOT_SHOWN and (value := _as_json(value)) is not _SKIP:
            config[name] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        config[name] = getattr(hf, name, None)
    config["tokenizer_class"] = type(hf).__name__
    config["model_max_length"] = context_length
    template = getattr(hf, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def _as_json(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # an AddedToken
        return value.content
    if isinstance(value, list | tuple):
        items = [_as_json(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict):
        pairs = {str(k): _as_json(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in pairs.values()) else pairs
    return _SKIP


TOKENIZER_ROUTES = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
]
