"""HTTP endpoints: OpenAI protocol <-> engine requests. No generation logic here."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_serve import __version__
from mlx_serve.engine import ALIVE_STATES, Engine, EngineState
from mlx_serve.errors import AuthenticationError, MLXServeError
from mlx_serve.http_input import check_model, parse, read_json, ready_engine, server_state
from mlx_serve.json_response import JSONResponse, json_reply
from mlx_serve.metrics import RequestTracker
from mlx_serve.protocol import ChatCompletionRequest, CompletionRequest
from mlx_serve.protocol_responses import ResponsesRequest
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.replies import Choice, ReplyShape, reply_items
from mlx_serve.request_building import (
    Prepared,
    build_chat_request,
    build_completion_request,
    off_loop_if_long,
)
from mlx_serve.responses_api import (
    ResponseBuilder,
    as_chat_request,
    as_responses_error,
    whole_response,
)
from mlx_serve.responses_store import (
    ResponseStore,
    StoredResponse,
    check_retrieval,
    continued,
    input_items_page,
)
from mlx_serve.responses_stream import response_events
from mlx_serve.server_state import ServerState
from mlx_serve.streaming import SSEResponse, collect, fail_fast, sse_events
from mlx_serve.tokenizer_routes import TOKENIZER_ROUTES

log = logging.getLogger(__name__)


def authorize(request: Request, state: ServerState) -> None:
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


async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, build_chat_request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, build_completion_request, chat=False)


async def _open(request: Request, model_type: type[Any]
                ) -> tuple[ServerState, Any, str, Engine | RemoteEngine]:
    """What every generating endpoint does first: wait its turn in a burst of arrivals,
    authorize, read and validate the body, check its model, and make sure the engine
    takes work."""
    state = server_state(request)
    await state.intake.wait_turn()  # a burst is prepared a few requests a loop pass
    authorize(request, state)
    body = parse(model_type, await read_json(request, state))
    return state, body, check_model(state, body.model), ready_engine(state)


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
        await fail_fast(handle, request, state.settings.sse_ping_seconds, tracker)
        return SSEResponse(sse_events(handle, shape, choices, state.failpoints, body.user,
                                      state.settings.sse_ping_seconds,
                                      merge_text=interval > 1, tracker=tracker), request_id)
    collected = await collect(handle, shape, choices, request, tracker)
    # Choices without a finish only happen when the client went away: nobody reads it.
    return await json_reply(reply_items(collected), lambda: shape.completion(collected),
                            request_id)


def _reply_shape(state: ServerState, prepared: Prepared, request_id: str, model: str, *,
                 chat: bool, **options: Any) -> ReplyShape:
    """What the reply needs from the prepared request (tool calls parsed with the model
    family's parser when tools were offered; calls written as JSON, a forced call or
    calls held to a grammar, as JSON)."""
    runner = state.engine.runner
    parser = None
    if prepared.calls_as_json:
        parser = runner.json_tool_parser()
    elif prepared.tools:
        parser = getattr(runner.tokenizer, "tool_parser", None)
    return ReplyShape(chat=chat, model=model, prompt_tokens=prepared.prompt_tokens,
                      logprobs=prepared.logprobs, reasoning_format=prepared.reasoning_format,
                      tool_parser=parser, tools=prepared.tools,
                      one_tool_call=prepared.requests[0].output.one_tool_call,
                      echo=prepared.echo,
                      prompt_lengths=tuple(
                          len(r.prompt_tokens)
                          for r in prepared.requests[::prepared.choices_per_prompt]),
                      choices_per_prompt=prepared.choices_per_prompt,
                      prompt_logprobs=prepared.prompt_logprobs, id=request_id, **options)


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def metrics(request: Request) -> Response:
    """Prometheus text format: the engine's figures as of now, the requests' so far."""
    body, content_type = server_state(request).metrics.render(request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})


def _model_object(state: ServerState) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` (the context a prompt and its
    reply share) once the model is loaded: clients size their requests by it."""
    card: dict[str, Any] = {"id": state.model_name, "object": "model",
                            "created": state.started, "owned_by": "mlx-serve"}
    if state.engine.runner is not None:
        card["max_model_len"] = state.engine.runner.context_length
    return card


async def version(request: Request) -> Response:
    """vLLM's ``GET /version``, with the versions of the MLX libraries serving."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def of(package: str) -> str | None:
        try:
            return installed(package)
        except PackageNotFoundError:
            return None

    return JSONResponse({"version": __version__, "mlx": of("mlx"), "mlx_lm": of("mlx-lm")})


async def list_models(request: Request) -> Response:
    state = server_state(request)
    authorize(request, state)
    return JSONResponse({"object": "list", "data": [_model_object(state)]})


async def retrieve_model(request: Request) -> Response:
    """OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``)."""
    state = server_state(request)
    authorize(request, state)
    check_model(state, request.path_params["model"])
    return JSONResponse(_model_object(state))


async def responses(request: Request) -> Response:
    """OpenAI's Responses API: generated as the equivalent chat request, after the stored
    conversation that ``previous_response_id`` names; kept for follow-ups unless
    ``store`` is false."""
    arrived = time.monotonic()
    state, body, model, engine = await _open(request, ResponsesRequest)
    request_id = f"resp_{uuid.uuid4().hex}"  # OpenAI's form (a chat's is "chatcmpl-...")
    body, conversation = await continued(body, state.responses)
    try:
        prepared = await build_chat_request(as_chat_request(body), engine.runner,
                                            state.settings, request_id)
    except MLXServeError as exc:  # built as a chat request: name the Responses fields
        raise as_responses_error(exc) from None
    tracker = state.metrics.track(prepared.prompt_tokens, arrived)
    shape = _reply_shape(state, prepared, request_id, model, chat=True)
    keep = body.store and state.responses.max_bytes > 0
    builder = ResponseBuilder(body, model, request_id, store=keep)

    handle = state.engine.submit(*prepared.requests, wake_every=1 if body.stream else None)
    if body.stream:
        await fail_fast(handle, request, state.settings.sse_ping_seconds, tracker)
        keeper = state.responses.keeper(conversation) if keep else None
        return SSEResponse(response_events(handle, shape, builder,
                                           state.settings.sse_ping_seconds, tracker, keeper),
                           request_id)
    choice = Choice(0)
    try:
        await collect(handle, shape, 1, request, tracker, into=[choice])
    except MLXServeError as exc:  # a fault mid-reply (a format's) names the chat field
        raise as_responses_error(exc) from None
    final = whole_response(builder, choice, shape.prompt_tokens)
    if keep:  # what a follow-up's previous_response_id finds
        state.responses.put(final, conversation)
    return await json_reply(reply_items([choice]), lambda: final, request_id)


def _stored(request: Request) -> tuple[ResponseStore, str, StoredResponse]:
    """The store, the id in the path and the response stored under it (else a 404)."""
    state = server_state(request)
    authorize(request, state)
    response_id = request.path_params["response_id"]
    return state.responses, response_id, state.responses.get(response_id)


async def retrieve_response(request: Request) -> Response:
    """OpenAI's ``GET /v1/responses/{id}``: a stored response."""
    kept = _stored(request)[2]
    check_retrieval(request.query_params)
    return Response(kept.response_json, media_type="application/json")  # stored as JSON


async def list_input_items(request: Request) -> Response:
    """OpenAI's ``GET /v1/responses/{id}/input_items``: the items a stored response was
    generated from, a page at a time (a long conversation is decoded off the loop)."""
    kept = _stored(request)[2]
    return JSONResponse(await off_loop_if_long(len(kept.items_json), input_items_page, kept,
                                               request.query_params))


async def delete_response(request: Request) -> Response:
    """OpenAI's ``DELETE /v1/responses/{id}``."""
    store, response_id, _ = _stored(request)
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def stored_response(request: Request) -> Response:
    """``/v1/responses/{id}``, one route for both methods: a 405 there names both in
    its ``Allow`` header (two routes would name only the first one's)."""
    if request.method == "DELETE":
        return await delete_response(request)
    return await retrieve_response(request)


async def health(request: Request) -> Response:
    """Readiness: 200 only while the engine can take work. Never waits on the actor."""
    stats = server_state(request).engine.statistics()
    ok = stats.state in (EngineState.READY, EngineState.RECOVERING)
    body = {"status": "ok" if ok else stats.state.value, **stats.as_dict()}
    engine = server_state(request).engine
    if engine.runner is not None:
        body["memory"] = engine.runner.memory()
    if isinstance(engine, RemoteEngine) and engine.pid is not None:
        body["engine_pid"] = engine.pid
    return JSONResponse(body, status_code=200 if ok else 503)


async def live(request: Request) -> Response:
    """Liveness: 200 unless the engine is dead, failed or wedged."""
    stats = server_state(request).engine.statistics()
    ok = stats.state in ALIVE_STATES
    return JSONResponse({"status": "ok" if ok else stats.state.value, "state": stats.state.value},
                        status_code=200 if ok else 503)


OPENAI_ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
]
ROUTES = [
    *OPENAI_ROUTES,
    # The same without /v1, as llama.cpp's server and mlx_lm.server answer them: clients
    # set up with a base URL that lacks it keep working.
    *(Route(route.path.removeprefix("/v1"), route.endpoint, methods=route.methods)
      for route in OPENAI_ROUTES),
    Route("/version", version, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/live", live, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    *TOKENIZER_ROUTES,
]
