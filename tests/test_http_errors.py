"""Black-box tests of every HTTP error: its status and OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}``, against a real ``python -m mlx_serve``
process with small limits (``tests/error_server.py``). Errors of request bodies (size,
slow and unfinished bodies) are in ``test_http_body_limits.py``. Every wait is bounded;
nothing sleeps to synchronise.

The deeply nested body test runs after the log check, so a regression that logs a
traceback there shows up in its own test.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import openai
import pytest

from tests.error_server import (
    HI,
    MAX_CONTEXT,
    MODEL,
    TIMEOUT,
    assert_serving_without_a_trace,
    error_of,
    error_server_fixture,
    http_fixture,
    param_matches,
)

server = error_server_fixture("http_errors")
http = http_fixture()


# -- malformed bodies ---------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"{bad json", b"", b'{"messages": [', b"\xff\xfe{"])
def test_malformed_json_is_400(http, raw):
    response = http.post("/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [
    b'{"messages": [], "temperature": NaN}', b'{"x": Infinity}', b'{"x": -Infinity}',
    b'{"x": 1e999}', b'{"metadata": {"a": NaN}}'])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_numbers_json_cannot_hold_are_400(http, raw, path):
    """Python's json reads them; a Response echoing one in its metadata could not be sent."""
    error = error_of(http.post(path, content=raw, headers={"content-type": "application/json"}),
                     400)
    assert "JSON" in error["message"] or "range" in error["message"]


def test_numbers_out_of_reach_are_named_as_such(http):
    """An integer past Python's 4,300 digits: its own refusal named
    sys.set_int_max_str_digits. A string "nan" read as a float said the temperature
    should be at most 100."""
    from mlx_serve.errors import RequestError
    from mlx_serve.http_input import _parsed

    with pytest.raises(RequestError) as info:  # past this server's 2 KiB bodies: unit
        _parsed(bytearray(b'{"messages": [], "seed": ' + b"9" * 5000 + b"}"))
    assert "more digits than any field takes" in info.value.message
    assert "int_max_str_digits" not in info.value.message
    for path, body in (("/v1/chat/completions", {"messages": HI, "temperature": "nan"}),
                       ("/v1/responses", {"input": "hi", "top_p": "nan"})):
        error = error_of(http.post(path, json=body), 400)
        assert "finite number" in error["message"], error


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800"}]}'),
    ("/v1/completions", rb'{"prompt": "\udfff", "max_tokens": 1}'),
    ("/tokenize", rb'{"prompt": "x\udc00y"}'),
    ("/v1/responses", rb'{"input": "hi", "metadata": {"\ud83d": "v"}}')])
def test_a_lone_surrogate_is_400(http, path, raw):
    """JSON lets a string escape half of a UTF-16 pair; no text holds it (the tokenizer
    raised, a 500)."""
    error = error_of(http.post(path, content=raw, headers={"content-type": "application/json"}),
                     400)
    assert "surrogate" in error["message"]


def test_an_escaped_pair_is_one_character(http):
    raw = rb'{"prompt": "\ud83d\ude00", "return_token_strs": true}'  # what ensure_ascii writes
    response = http.post("/tokenize", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200 and "".join(response.json()["token_strs"]) != ""


def test_a_response_json_schema_format_needs_its_name_and_schema(http):
    body = {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}
    error = error_of(http.post("/v1/responses", json=body), 400)
    assert error["param"] == "text.format" and "'name'" in error["message"]


@pytest.mark.parametrize("metadata, param", [
    ("x", "metadata"), ({"k": 1}, "metadata.k"), ({"k": "v" * 513}, "metadata.k"),
    ({str(i): "v" for i in range(17)}, "metadata")])
def test_response_metadata_is_openais_pairs_of_strings(http, metadata, param):
    body = {"input": "hi", "max_output_tokens": 1, "metadata": metadata}
    error = error_of(http.post("/v1/responses", json=body), 400)
    assert param_matches(error, param), error


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/completions", {"prompt": 5}, "prompt", "valid string"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt.1", "valid integer"),
    ("/v1/completions", {"prompt": []}, "prompt", "at least 1 item"),
    ("/v1/responses", {"input": [{"role": 5, "content": "hi"}]}, "input.0.role", "'user'"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input.0.output", "valid string"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]},
     "input.0.output", "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text", "Field required"),
])
def test_a_value_that_fits_no_member_of_a_union_is_named_as_written(http, path, body, param,
                                                                    says):
    """Not pydantic's first member's error (``prompt.str``, or the message item's ``type``
    for a function call's output): the place in the body, in the member the client meant."""
    error = error_of(http.post(path, json=body), 400)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"null", b"42"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_body_that_is_not_an_object_is_400(http, raw, path):
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert error_of(response, 400)["type"] == "invalid_request_error"


# -- invalid or unsupported parameters (400 naming the parameter) -------------------------

CHAT_400 = [
    ({"model": MODEL}, "messages"),
    ({"messages": None}, "messages"),  # a required field's null is no default
    ({"messages": [{"role": "user"}]}, "messages"),  # only an assistant may leave it out
    ({"messages": [*HI, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
                   *HI]}, "messages.1.function_call"),  # the deprecated functions API
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": HI, "temperature": -0.5}, "temperature"),
    ({"messages": HI, "top_p": 0}, "top_p"),
    ({"messages": HI, "top_p": 1.5}, "top_p"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": HI, "n": 1000}, "n"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HI, "logprobs": "yes please"}, "logprobs"),
    ({"messages": HI, "tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": HI, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"messages": HI, "web_search_options": {}}, "web_search_options"),  # {}: search on
    ({"messages": HI, "verbosity": "low"}, "verbosity"),
    ({"messages": HI, "moderation": {"input": {"mode": "block"}}}, "moderation"),
    ({"messages": HI, "logit_bias": {"100000": 5}}, "logit_bias"),
    ({"messages": HI, "logit_bias": {"7": 150}}, "logit_bias"),
    ({"messages": HI, "stop": [str(i) for i in range(17)]}, "stop"),
    ({"messages": HI, "echo": True}, "echo"),  # vLLM's: the last message before the reply
    ({"messages": HI, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HI, "user": 42}, "user"),
    ({"messages": HI, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": HI, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": HI, "min_p": 1.5}, "min_p"),
    ({"messages": HI, "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"messages": HI, "min_tokens": -1}, "min_tokens"),
    ({"messages": HI, "ignore_eos": True, "response_format": {"type": "json_object"}},
     "ignore_eos"),
    ({"messages": HI, "min_tokens": 2, "response_format": {"type": "json_object"}},
     "min_tokens"),
]

COMPLETION_400 = [
    ({"model": MODEL}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [100000]}, "prompt"),  # a token id outside the 512-token vocabulary
    ({"prompt": [True]}, "prompt"),  # JSON's true is no token id
    ({"prompt": [1.0]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ({"prompt": "hi", "suffix": "and then"}, "suffix"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),  # fewer candidates than choices
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
     "stream_options"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_400,
                         ids=[f"chat-{p}-{i}" for i, (_, p) in enumerate(CHAT_400)])
def test_invalid_chat_parameter_is_400_naming_it(http, body, param):
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert param_matches(error, param), error


@pytest.mark.parametrize(("body", "param"), COMPLETION_400,
                         ids=[f"completion-{p}-{i}" for i, (_, p) in enumerate(COMPLETION_400)])
def test_invalid_completion_parameter_is_400_naming_it(http, body, param):
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert param_matches(error, param), error


def test_an_assistant_refusal_is_text_it_said(http):
    """As OpenAI returns it and clients send it back: in the prompt, as its content."""
    def prompt_tokens(assistant: dict) -> int:
        body = {"messages": [*HI, {"role": "assistant", **assistant}, *HI], "max_tokens": 1}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    said = "I cannot help with that."
    assert prompt_tokens({"refusal": said}) == prompt_tokens({"content": said}) \
        > prompt_tokens({"content": ""})


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stream": None, "n": None,
                              "ignore_eos": None}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": None, "n": None,
                         "echo": None}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": None, "store": None}),
])
def test_a_null_takes_the_fields_default(http, path, body):
    """OpenAI marks these nullable and its clients send null for "not set"."""
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("application/json")  # not streamed
    data = reply.json()
    if path == "/v1/responses":  # stored, as by default
        assert http.get(f"/v1/responses/{data['id']}").status_code == 200
    else:
        assert len(data["choices"]) == 1


@pytest.mark.parametrize(("prompt", "kinds"), [
    (["hi", [1, 2]], "a string and a token-id list"),
    ([1, "hi"], "a string and a token id"),
    ([1, [2]], "a token id and a token-id list"),
])
def test_a_prompt_list_of_mixed_kinds_says_so(http, prompt, kinds):
    error = error_of(http.post("/v1/completions", json={"prompt": prompt}), 400)
    assert error["param"] == "prompt"
    assert error["message"].endswith(f"this one mixes {kinds}"), error


def test_unsupported_openai_field_has_its_code(http):
    error = error_of(http.post("/v1/chat/completions",
                               json={"messages": HI, "audio": {"voice": "alloy"}}), 400)
    assert error["param"] == "audio"
    assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("path", "body", "kind"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "input_audio"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input_image"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]}, "input_file"),
])
def test_a_content_part_that_is_not_text_is_refused_by_its_type(http, path, body, kind):
    error = error_of(http.post(path, json=body), 400)
    assert f"content parts of type '{kind}' are not supported" in error["message"], error
    assert error["param"] in ("messages.0.content", "input.0.content")


def test_a_response_text_verbosity_is_refused_unless_the_default(http):
    body = {"input": "hi", "max_output_tokens": 1}
    error = error_of(http.post("/v1/responses", json={**body, "text": {"verbosity": "low"}}),
                     400)
    assert error["param"] == "text.verbosity" and error["code"] == "unsupported_parameter"
    assert http.post("/v1/responses", json={**body, "text": {"verbosity": "medium"}}
                     ).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1,
                                                   "verbosity": "medium"}).status_code == 200


def test_defaults_and_unknown_fields_that_change_nothing_are_accepted(http):
    for extra in ({"modalities": ["text"]}, {"echo": False},
                  {"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}):
        reply = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1,
                                                        **extra})
        assert reply.status_code == 200, (extra, reply.text)


def test_stream_options_the_sdk_sends_are_accepted(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_the_sdk_sees_a_bad_request_error(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)
        assert info.value.status_code == 400
        assert info.value.param == "temperature"
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=1)
        assert info.value.code == "model_not_found"


# -- model names --------------------------------------------------------------------------

def test_served_model_name_changes_the_model_id(server, http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("tiny")  # the folder's name is not the served id
        assert info.value.code == "model_not_found"
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert reply.model == MODEL


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": HI}),
    ("/v1/completions", {"model": "tiny-but-not-quite", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": HI}),  # the folder's name
])
def test_unknown_model_is_404_model_not_found(http, path, body):
    error = error_of(http.post(path, json=body), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


# -- context length -----------------------------------------------------------------------

def test_prompt_plus_max_tokens_over_the_context_is_400(http):
    error = error_of(http.post("/v1/chat/completions",
                               json={"messages": HI, "max_tokens": MAX_CONTEXT - 17 + 1}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"


def test_prompt_filling_the_context_exactly_is_accepted(http):
    response = http.post("/v1/chat/completions",
                         json={"messages": HI, "max_tokens": MAX_CONTEXT - 17,
                               "logit_bias": {"0": -100, "2": -100}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == MAX_CONTEXT


def test_prompt_alone_over_the_context_is_400(http):
    error = error_of(http.post("/v1/completions",
                               json={"prompt": [5] * MAX_CONTEXT, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded"
    error = error_of(http.post("/v1/completions", json={"prompt": [5] * (MAX_CONTEXT + 10)}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    long_chat = [{"role": "user", "content": "the weather is nice " * 40}]
    error = error_of(http.post("/v1/chat/completions", json={"messages": long_chat}), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"


def test_without_max_tokens_the_reply_fits_the_context(http):
    response = http.post("/v1/completions", json={
        "prompt": [5] * (MAX_CONTEXT - 4), "logit_bias": {"0": -100, "2": -100}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["choices"][0]["finish_reason"] == "length"


# -- routes -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/nope", "/v1/embeddings", "/v2/chat/completions"])
def test_unknown_route_is_404_in_openai_shape(http, path):
    error_of(http.post(path, json={}), 404)
    error_of(http.get(path), 404)


def test_404_and_405_say_which_request_they_answer(http):
    assert error_of(http.post("/v1/embeddings", json={}), 404)["message"].startswith(
        "Invalid URL (POST /v1/embeddings)")
    message = error_of(http.get("/v1/chat/completions"), 405)["message"]
    assert message.startswith("Method not allowed (GET /v1/chat/completions)")
    assert "POST" in message


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("POST", "/v1/models"),
    ("DELETE", "/health"), ("POST", "/live"),
])
def test_wrong_method_is_405_in_openai_shape(http, method, path):
    error_of(http.request(method, path), 405)


def test_405_names_the_allowed_methods(http):
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert "POST" in response.headers.get("allow", "")


def test_405_on_a_stored_response_names_both_its_methods(http):
    response = http.put("/v1/responses/resp_none")
    assert response.status_code == 405
    assert {"GET", "DELETE"} <= {m.strip() for m in response.headers["allow"].split(",")}


# -- overload -----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_overload_answers_429_with_retry_after_at_once(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "temperature": 0}
    accepted: list[asyncio.Task[httpx.Response]] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as c:
        try:
            # From now on every engine step blocks (on the MLX thread) until cleared.
            hang = await c.put("/_debug/failpoints/engine.step", content="hang")
            assert hang.status_code == 200 and hang.json()["engine.step"] == "hang"
            refused = None
            for _ in range(6):  # one runs (its step hangs), one queues, the next is refused
                started = time.monotonic()
                task = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
                while not task.done():  # until the server answers or takes it in
                    stats = (await c.get("/health")).json()
                    if stats["running"] + stats["waiting"] > len(accepted):
                        break
                    assert time.monotonic() - started < 5, stats
                    await asyncio.sleep(0.005)  # a bounded poll, not a synchronisation
                if task.done():
                    refused, elapsed = task.result(), time.monotonic() - started
                    break
                accepted.append(task)
            assert refused is not None, "never overloaded"
            assert len(accepted) == 2  # exactly the batch slot and the queue slot
            error = error_of(refused, 429)
            assert elapsed < 1.0
            assert int(refused.headers["retry-after"]) >= 1
            assert error["type"] == "rate_limit_error"
            # A direct timing of one more refusal, and probes stay fast while stuck.
            started = time.monotonic()
            again = await c.post("/v1/chat/completions", json=body)
            assert again.status_code == 429
            # What the OpenAI SDKs wait: jittered around Retry-After, so turned-away
            # clients come back apart (before, all of them after exactly 1 s).
            waits = {int(r.headers["retry-after-ms"]) for r in (refused, again)}
            for _ in range(8):
                waits.add(int((await c.post("/v1/chat/completions",
                                            json=body)).headers["retry-after-ms"]))
            assert all(500 <= w <= 1500 for w in waits) and len(waits) > 1, waits
            assert time.monotonic() - started < 1.0
            for path in ("/health", "/live"):
                started = time.monotonic()
                assert (await c.get(path)).status_code == 200
                assert time.monotonic() - started < 1.0
            # Release the hang: the two accepted requests complete normally.
            cleared = await c.delete("/_debug/failpoints/engine.step")
            assert cleared.status_code == 200
            assert "engine.step" not in cleared.json()
            for response in await asyncio.wait_for(asyncio.gather(*accepted), TIMEOUT):
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] >= 1
        finally:
            await c.delete("/_debug/failpoints/engine.step")
            for task in accepted:
                task.cancel()


# -- nothing above left a trace -----------------------------------------------------------

def test_still_serving_and_no_traceback_in_the_log(server, http):
    assert_serving_without_a_trace(server, http)


def test_deeply_nested_json_is_400(http):
    # Runs after the traceback check above. 1500 levels: deeper than
    # Python's recursion limit, yet under this server's 2048-byte body limit.
    response = http.post("/v1/chat/completions", content=b"[" * 1500,
                         headers={"content-type": "application/json"})
    error_of(response, 400)


def test_server_stops_cleanly_on_sigterm(server):
    # Last in the module. The overload test hung engine steps and released them through
    # the fail-point HTTP control; the MLX thread is free again, so a drain-and-exit works.
    server.terminate()
    try:
        code: int | str = server.wait_exit(60)
    except subprocess.TimeoutExpired:
        code = "still running 60 s after SIGTERM"
    assert code == 0, f"{code}\n{server.log_text()}"
