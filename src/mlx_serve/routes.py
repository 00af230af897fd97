"""HTTP endpoints: OpenAI protocol <-> engine requests. No generation logic here."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_serve.engine import ALIVE_STATES, Engine, EngineState
from mlx_serve.errors import (
    AuthenticationError,
    EngineUnavailableError,
    ModelNotFoundError,
    PayloadTooLargeError,
    RequestError,
    UnsupportedParameterError,
)
from mlx_serve.metrics import RequestTracker
from mlx_serve.prompts import render_chat
from mlx_serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.replies import Choice, ReplyShape
from mlx_serve.request_building import (
    Prepared,
    build_chat_request,
    build_completion_request,
    off_loop_if_long,
)
from mlx_serve.responses_api import (
    ResponseBuilder,
    as_chat_request,
    response_events,
    whole_response,
)
from mlx_serve.server_state import ServerState
from mlx_serve.streaming import SSEResponse, collect, fail_fast, sse_events

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request, limit: int) -> Any:
    """Read the body, refusing it as soon as it passes ``limit`` bytes (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body exceeds {limit} bytes")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply") from None


def parse(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise RequestError(f"invalid value for '{param}': {first['msg']}", param=param) from None


def _ready_engine(state: ServerState) -> Engine | RemoteEngine:
    engine = state.engine
    if engine.state not in (EngineState.READY, EngineState.RECOVERING):
        raise engine.unavailable_error()
    if engine.runner is None:
        raise EngineUnavailableError("the model is still loading")
    return engine


def _authorize(request: Request, state: ServerState) -> None:
    """With ``--api-key``: the /v1 endpoints need ``Authorization: Bearer KEY`` (the
    health probes and /metrics stay open, as in vLLM)."""
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             key.encode()):
        raise AuthenticationError("invalid or missing API key: send 'Authorization: "
                                  "Bearer <key>'")


def _check_model(state: ServerState, name: str | None) -> str:
    if name is not None and name != state.model_name:
        raise ModelNotFoundError(
            f"the model '{name}' does not exist; this server serves '{state.model_name}'",
            param="model",
        )
    return state.model_name


async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, build_chat_request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, build_completion_request, chat=False)


async def _open(request: Request, model_type: type[Any]
                ) -> tuple[ServerState, Any, str, Engine | RemoteEngine]:
    """What every generating endpoint does first: authorize, read and validate the body,
    check its model, and make sure the engine takes work."""
    state = _state(request)
    _authorize(request, state)
    body = parse(model_type, await read_json(request, state.settings.max_body_bytes))
    return state, body, _check_model(state, body.model), _ready_engine(state)


async def _generate(request: Request, model_type: type[Any], build: Any, *, chat: bool
                    ) -> Response:
    """Read, validate and build the engine requests; then reply (streamed or whole)."""
    arrived = time.monotonic()
    state, body, model, engine = await _open(request, model_type)
    request_id = _request_id("chatcmpl" if chat else "cmpl")
    prepared = await build(body, engine.runner, state.settings, request_id)
    tracker = state.metrics.track(prepared.prompt_tokens, arrived)
    return await _reply(request, state, body, prepared, request_id, tracker, chat=chat,
                        model=model)


async def _reply(request: Request, state: ServerState, body: Any, prepared: Prepared,
                 request_id: str, tracker: RequestTracker, *, chat: bool, model: str
                 ) -> Response:
    options = body.stream_options if body.stream else None
    include_usage = bool(options and options.include_usage)
    # As vLLM: usage in every chunk only on top of the final usage chunk.
    continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
    shape = _reply_shape(state, prepared, request_id, model, chat=chat,
                         include_usage=include_usage, continuous_usage=continuous_usage)
    interval = state.settings.stream_interval
    # A whole reply wakes its handler once, at the end; a stream every `interval` tokens.
    handle = state.engine.submit(*prepared.requests,
                                 wake_every=interval if body.stream else None)
    choices = len(prepared.requests)
    if body.stream:
        await fail_fast(handle, request, state.settings.sse_ping_seconds)
        return SSEResponse(sse_events(handle, shape, choices, state.failpoints, body.user,
                                      state.settings.sse_ping_seconds,
                                      merge_text=interval > 1, tracker=tracker))
    return JSONResponse(await collect(handle, shape, choices, request, tracker))


def _reply_shape(state: ServerState, prepared: Prepared, request_id: str, model: str, *,
                 chat: bool, **options: Any) -> ReplyShape:
    """What the reply needs from the prepared request (tool calls parsed with the model
    family's parser when tools were offered)."""
    parser = getattr(state.engine.runner.tokenizer, "tool_parser", None) \
        if prepared.tools else None
    return ReplyShape(chat=chat, model=model, prompt_tokens=prepared.prompt_tokens,
                      logprobs=prepared.logprobs, reasoning_format=prepared.reasoning_format,
                      tool_parser=parser, tools=prepared.tools, echo=prepared.echo,
                      id=request_id, **options)


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def metrics(request: Request) -> Response:
    """Prometheus text format: the engine's figures as of now, the requests' so far."""
    body, content_type = _state(request).metrics.render(request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})


def _model_object(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.started,
            "owned_by": "mlx-serve"}


async def list_models(request: Request) -> Response:
    state = _state(request)
    _authorize(request, state)
    return JSONResponse({"object": "list", "data": [_model_object(state)]})


async def retrieve_model(request: Request) -> Response:
    """OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``)."""
    state = _state(request)
    _authorize(request, state)
    _check_model(state, request.path_params["model"])
    return JSONResponse(_model_object(state))


async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless: generated as the equivalent chat request."""
    arrived = time.monotonic()
    state, body, model, engine = await _open(request, ResponsesRequest)
    request_id = _request_id("resp")
    prepared = await build_chat_request(as_chat_request(body), engine.runner, state.settings,
                                        request_id)
    tracker = state.metrics.track(prepared.prompt_tokens, arrived)
    shape = _reply_shape(state, prepared, request_id, model, chat=True)
    builder = ResponseBuilder(body, model, request_id)
    handle = state.engine.submit(*prepared.requests, wake_every=1 if body.stream else None)
    if body.stream:
        await fail_fast(handle, request, state.settings.sse_ping_seconds)
        return SSEResponse(response_events(handle, shape, builder,
                                           state.settings.sse_ping_seconds, tracker))
    choice = Choice(0)
    await collect(handle, shape, 1, request, tracker, into=[choice])
    return JSONResponse(whole_response(builder, choice, shape.prompt_tokens))


async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: the prompt tokens a completion (``prompt``) or a chat
    (``messages``, through the chat template) would have here."""
    state = _state(request)
    body = parse(TokenizeRequest, await read_json(request, state.settings.max_body_bytes))
    _check_model(state, body.model)
    runner = _ready_engine(state).runner
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give either 'prompt' or 'messages'", param="prompt")
    if body.messages is not None:
        for name, unsupported in (("add_generation_prompt", not body.add_generation_prompt),
                                  ("continue_final_message", body.continue_final_message),
                                  ("add_special_tokens", bool(body.add_special_tokens))):
            if unsupported:  # a chat prompt here is always what a chat request would get
                raise UnsupportedParameterError(f"'{name}' is not supported with messages",
                                                param=name)
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
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
    state = _state(request)
    body = parse(DetokenizeRequest, await read_json(request, state.settings.max_body_bytes))
    _check_model(state, body.model)
    runner = _ready_engine(state).runner
    if any(not 0 <= t < runner.vocab_size for t in body.tokens):
        raise RequestError("'tokens' holds a token id outside the vocabulary", param="tokens")
    text = await off_loop_if_long(len(body.tokens), runner.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


async def health(request: Request) -> Response:
    """Readiness: 200 only while the engine can take work. Never waits on the actor."""
    stats = _state(request).engine.statistics()
    ok = stats.state in (EngineState.READY, EngineState.RECOVERING)
    body = {"status": "ok" if ok else stats.state.value, **stats.as_dict()}
    engine = _state(request).engine
    if engine.runner is not None:
        body["memory"] = engine.runner.memory()
    if isinstance(engine, RemoteEngine) and engine.pid is not None:
        body["engine_pid"] = engine.pid
    return JSONResponse(body, status_code=200 if ok else 503)


async def live(request: Request) -> Response:
    """Liveness: 200 unless the engine is dead, failed or wedged."""
    stats = _state(request).engine.statistics()
    ok = stats.state in ALIVE_STATES
    return JSONResponse({"status": "ok" if ok else stats.state.value, "state": stats.state.value},
                        status_code=200 if ok else 503)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/live", live, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
