"""Black-box tests of the OpenAI-compatible HTTP API: a real server process, real clients.

The official ``openai`` SDK (sync and async) and raw ``httpx`` talk to ``python -m
mlx_serve`` on 127.0.0.1 serving the tiny random-weight llama. Every wait is bounded by a
client timeout or a bounded poll of ``/health``; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.http_helpers import (
    HI,
    MODEL,
    NO_EOS,
    TIMEOUT,
    chat_prompt_tokens,
    client_fixture,
    health,
    printable_window,
    server_fixture,
    sse_data,
)

server = server_fixture("http_api")
client = client_fixture()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


# -- non-streaming ------------------------------------------------------------------------

def test_a_large_whole_reply_arrives_whole(client):
    """Four choices of 256 tokens with 20 alternatives each: more than json_response's
    LARGE_REPLY_ITEMS, so built and encoded in a worker thread, a slice at a time."""
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=256, n=4,
                                           temperature=0, logit_bias=NO_EOS, logprobs=True,
                                           top_logprobs=20)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    for choice in reply.choices:
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.content) == 256
        assert {len(t.top_logprobs) for t in choice.logprobs.content} == {20}
    assert reply.usage.completion_tokens == 1024


def test_chat_completion_non_streaming_shape_and_usage(client, tokenizer):
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=7,
                                           temperature=0, logit_bias=NO_EOS)
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.id
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == chat_prompt_tokens(tokenizer, HI) == 17
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == 24


def test_completion_non_streaming_shape_and_usage(client, tokenizer):
    prompt = "Hello, how are you?"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0,
                                      logit_bias=NO_EOS)
    assert reply.object == "text_completion"
    assert reply.model == MODEL
    choice = reply.choices[0]
    assert choice.index == 0
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
    assert reply.usage.completion_tokens == 9
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 9


def test_model_field_may_be_omitted(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=TIMEOUT,
                          json={"messages": HI, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL


def test_max_completion_tokens_limits_the_reply(client):
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3,
                                           temperature=0, logit_bias=NO_EOS)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_completion_with_a_token_id_prompt(client, tokenizer):
    text = "The quick brown fox"
    ids = tokenizer.encode(text).ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.completion_tokens == by_text.usage.completion_tokens


# -- streaming ----------------------------------------------------------------------------

def test_chat_streaming_with_the_sdk_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me a story about a dragon"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=20, temperature=0, stream=True))
    assert chunks, "no chunks streamed"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content


def test_completion_streaming_with_the_sdk_matches_non_streaming(client):
    prompt = "Once upon a time"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                            temperature=0, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def stream_with_usage(server, tokenizer, path: str, options: dict[str, Any] | None = None,
                      **fields: Any) -> tuple[bool, int, list[str]]:
    """Stream 6 tokens of ``hi`` from ``path`` with ``include_usage`` (plus ``options``
    and ``fields``); return whether it was chat, the prompt's tokens and the SSE data."""
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True, **(options or {})},
                            "logit_bias": NO_EOS, **fields}
    if chat:
        body["messages"] = HI
        prompt_tokens = chat_prompt_tokens(tokenizer, HI)
    else:
        body["prompt"] = "hi"
        prompt_tokens = len(tokenizer.encode("hi").ids)
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        with c.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            data = sse_data(list(response.iter_lines()))
    assert data[-1] == "[DONE]"
    return chat, prompt_tokens, data


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_sse_stream_with_include_usage(server, tokenizer, path):
    chat, prompt_tokens, data = stream_with_usage(server, tokenizer, path)
    assert data.count("[DONE]") == 1
    events = [json.loads(d) for d in data[:-1]]
    *chunks, usage_chunk = events
    # The usage chunk: empty choices, exact usage.
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        prompt_tokens, 6, prompt_tokens + 6)
    # Every other chunk carries usage null (OpenAI's shape with include_usage).
    assert all(c["usage"] is None for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert len({c["id"] for c in events}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(
        server, tokenizer, path):
    # vLLM's stream option: usage in every chunk, counting the chunk's own choice's tokens.
    chat, prompt_tokens, data = stream_with_usage(
        server, tokenizer, path, n=2, options={"continuous_usage_stats": True})
    *chunks, final = [json.loads(d) for d in data[:-1]]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        usage, (choice,) = chunk["usage"], chunk["choices"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        counts[choice["index"]].append(usage["completion_tokens"])
    for index, seen in counts.items():
        # The role chunk (chat) counts none; each later chunk its choice's tokens so far
        # (more than one more when a token had no text of its own), up to all six.
        if chat:
            assert seen[0] == 0, (index, seen)
            seen = seen[1:]
        assert seen == sorted(set(seen)) and seen[0] >= 1 and seen[-1] == 6, (index, seen)


def test_continuous_usage_stats_count_each_prompts_own_tokens(server, tokenizer):
    prompts = ["hi", "hello world how are you"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "temperature": 0,
            "stream": True, "logit_bias": NO_EOS,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as http:
        lines = http.post("/v1/completions", json=body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    own = [len(tokenizer.encode(p).ids) for p in prompts]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        assert chunk["usage"]["prompt_tokens"] == own[choice["index"]], chunk
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(own)  # the request's, all prompts


def test_continuous_usage_stats_need_include_usage(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            data = sse_data(list(response.iter_lines()))
    assert data[-1] == "[DONE]"
    assert all("usage" not in json.loads(d) for d in data[:-1])  # as vLLM: none at all


def test_sdk_stream_include_usage_final_chunk(client, tokenizer):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, temperature=0, stream=True, logit_bias=NO_EOS,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == chat_prompt_tokens(tokenizer, HI)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert chunks[-2].choices[0].finish_reason == "length"


# -- sampling parameters ------------------------------------------------------------------

def test_stop_string_ends_the_output_before_it(client):
    prompt = "Please tell me a story"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     logit_bias=NO_EOS).choices[0].text
    start = printable_window(full, 4, 3)
    assert start is not None, f"no plain 3-character window in {full!r}"
    stop = full[start:start + 3]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                    logit_bias=NO_EOS, stop=stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:start]
    assert stop not in cut.choices[0].text
    assert cut.usage.completion_tokens < 40
    # The same through the chat endpoint, streamed, with the stop in a list.
    chat_full = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40,
                                               temperature=0, logit_bias=NO_EOS)
    text = chat_full.choices[0].message.content
    start = printable_window(text, 3, 2)
    assert start is not None, f"no plain 2-character window in {text!r}"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=40, temperature=0, logit_bias=NO_EOS,
        stop=["never-generated", text[start:start + 2]], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:start]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="The weather is", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    first, again = sample(1234), sample(1234)
    assert first == again
    others = {sample(s) for s in (1, 2, 3)}
    assert others != {first}, "different seeds should not all give the same text"


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_a_400(client, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, seed=seed)
    assert info.value.body["param"] == "seed"


def test_the_int64_seeds_at_either_end_sample_apart_from_their_neighbours(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="The weather is", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    # Keys were taken modulo 2**63: -1 and 2**63 - 1 drew the same text, and so did 0.
    texts = [sample(s) for s in (-1, 2**63 - 1, 0, -(2**63))]
    assert len(set(texts)) == len(texts), texts


def test_a_temperature_too_small_to_divide_by_is_greedy(client):
    def sample(temperature: float) -> str:
        return client.completions.create(model=MODEL, prompt="The weather is", max_tokens=16,
                                         temperature=temperature, seed=1).choices[0].text

    # Logits divided by 1e-38 overflowed float32 and sampled noise; under 1e-5 is greedy
    # (as in vLLM), a temperature above it still samples.
    greedy = sample(0)
    assert sample(1e-38) == sample(1e-300) == sample(9e-6) == greedy
    assert sample(1.0) != greedy


def test_logit_bias_forces_a_token(client, tokenizer):
    the = tokenizer.token_to_id("Ġthe")  # " the"
    assert the is not None and tokenizer.decode([the] * 3) == " the the the"
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                      temperature=0, logit_bias={str(the): 100})
    # (Whether the first token keeps its leading space: see the test below.)
    assert reply.choices[0].text.split() == ["the"] * 6
    assert reply.usage.completion_tokens == 6
    # And via chat, streamed.
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                                 temperature=0, logit_bias={str(the): 100},
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).split() == ["the"] * 4


def test_completion_keeps_the_leading_space_of_its_first_token(client, tokenizer):
    the = tokenizer.token_to_id("Ġthe")
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                      temperature=0, logit_bias={str(the): 100})
    # prompt + completion must read "Once upon a time the the", not "...timethe the".
    assert reply.choices[0].text == " the the"


def test_penalties_are_accepted_and_change_the_output(client):
    prompt = "the the the the the the"
    common: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 32,
                              "temperature": 0, "logit_bias": NO_EOS}
    plain = client.completions.create(**common).choices[0].text
    variants = {
        "repetition_penalty": client.completions.create(
            **common, extra_body={"repetition_penalty": 2.0}),
        "presence_penalty": client.completions.create(**common, presence_penalty=2.0),
        "frequency_penalty": client.completions.create(**common, frequency_penalty=2.0),
    }
    for reply in variants.values():
        assert reply.usage.completion_tokens == 32
    changed = [name for name, reply in variants.items() if reply.choices[0].text != plain]
    assert changed, "no penalty changed the greedy output"


def test_each_penalty_looks_back_over_its_context_size(client):
    # mlx-lm's fields: how many recent tokens a penalty sees (64 by default here, 20 in
    # mlx_lm.server). Before, they were ignored with a warning while changing nothing.
    common: dict[str, Any] = {"model": MODEL, "prompt": "the the the the the the",
                              "max_tokens": 32, "temperature": 0, "logit_bias": NO_EOS}
    for penalty, value in (("repetition", 2.0), ("presence", 2.0), ("frequency", 2.0)):
        texts = {}
        for size in (None, 64, 1):
            extra = {f"{penalty}_penalty": value}
            if size is not None:
                extra[f"{penalty}_context_size"] = size
            texts[size] = client.completions.create(**common, extra_body=extra).choices[0].text
        assert texts[None] == texts[64], penalty  # the default, said aloud
        assert texts[1] != texts[64], penalty  # one token back penalises less
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**common, extra_body={"repetition_context_size": 0})
    assert caught.value.body["param"] == "repetition_context_size"


def test_top_k_top_p_min_p_are_accepted_and_honoured(client):
    # Each of these, set to its most restrictive value, leaves only the most likely token:
    # temperature-1 sampling must then reproduce the greedy (temperature-0) output.
    common: dict[str, Any] = {"model": MODEL, "prompt": "What is the capital of France?",
                              "max_tokens": 12, "logit_bias": NO_EOS}
    greedy = client.completions.create(**common, temperature=0).choices[0].text
    restrictive = [{"extra_body": {"top_k": 1}}, {"top_p": 1e-9},
                   {"extra_body": {"min_p": 1.0}}]
    for extra in restrictive:
        reply = client.completions.create(**common, temperature=1.0, **extra)
        assert reply.choices[0].text == greedy, extra
    # Ordinary values are accepted and keep the token count.
    reply = client.completions.create(**common, temperature=0.8, top_p=0.9,
                                      extra_body={"top_k": 40, "min_p": 0.05})
    assert reply.usage.completion_tokens == 12


def test_unknown_vendor_field_and_user_are_accepted(client, server):
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                           temperature=0, user="alice", extra_body={"foo": 1},
                                           logit_bias=NO_EOS)
    assert reply.usage.completion_tokens == 3
    raw = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "foo": {"bar": [1, 2]},
        "user": "bob", "store": False, "metadata": {"k": "v"}, "safety_identifier": "u1",
        "prompt_cache_key": "conversation-1"})
    assert raw.status_code == 200, raw.text


# -- models, health -----------------------------------------------------------------------

def test_models_lists_exactly_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    raw = httpx.get(server.base_url + "/v1/models", timeout=5).json()
    assert raw["object"] == "list"
    assert len(raw["data"]) == 1
    # vLLM's max_model_len: the context, as /tokenize reports it too.
    context = httpx.post(server.base_url + "/tokenize", json={"prompt": "x"},
                         timeout=5).json()["max_model_len"]
    assert raw["data"][0]["max_model_len"] == context > 0


def test_the_openai_paths_answer_without_v1_too(server):
    # As llama.cpp's server and mlx_lm.server: a client whose base URL lacks /v1 works.
    sdk = openai.OpenAI(base_url=server.base_url, api_key="x", timeout=TIMEOUT)
    chat = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                       temperature=0, logit_bias=NO_EOS)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content
    text = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0,
                                  logit_bias=NO_EOS)
    assert text.usage.completion_tokens == 2
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    response = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert sdk.responses.retrieve(response.id).id == response.id
    stored = httpx.get(f"{server.base_url}/v1/responses/{response.id}", timeout=5)
    assert stored.json()["id"] == response.id  # one store behind both paths
    assert httpx.get(server.base_url + "/chat/completions", timeout=5).status_code == 405


def test_every_reply_names_its_request_id_as_openai_does(client):
    # The SDK shows the x-request-id header as ``_request_id`` (before: None).
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                          temperature=0)
    assert chat._request_id == chat.id
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert text._request_id == text.id
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert response._request_id == response.id
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=HI, max_tokens=2, stream=True) as streamed:
        first = next(iter(streamed.parse()))
        assert streamed.headers["x-request-id"] == first.id


def test_version_names_the_server_and_its_mlx(server):
    from importlib.metadata import version

    import mlx_serve

    body = httpx.get(server.base_url + "/version", timeout=5).json()
    assert body == {"version": mlx_serve.__version__, "mlx": version("mlx"),
                    "mlx_lm": version("mlx-lm")}


def test_debug_routes_are_absent_without_the_flag(server):
    response = httpx.get(server.base_url + "/_debug/failpoints", timeout=5)
    assert response.status_code == 404
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}


def test_health_and_live_when_ready(server):
    with httpx.Client(base_url=server.base_url, timeout=5) as c:
        started = time.monotonic()
        h = c.get("/health")
        live = c.get("/live")
        elapsed = time.monotonic() - started
    assert h.status_code == 200
    assert h.json()["status"] == "ok"
    assert h.json()["state"] == "ready"
    assert {"running", "waiting"} <= h.json().keys()
    memory = h.json()["memory"]
    assert memory["active_bytes"] > 0 and memory["prefix_cache_bytes"] >= 0
    assert live.status_code == 200
    assert live.json()["status"] == "ok"
    assert elapsed < 1.0


def test_health_reports_the_mlx_threads_busy_time(server):
    before = health(server)
    response = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": "hi", "max_tokens": 4, "logit_bias": NO_EOS})
    assert response.status_code == 200, response.text
    after = health(server)
    # The request's steps ran on the MLX thread, each counted once it had finished.
    assert after["steps"] > before["steps"]
    assert after["mlx_busy_s"] > before["mlx_busy_s"] >= 0
    # The prompt was prefilled in a step of its own or beside a decode: counted apart.
    assert 1 <= after["prefill_steps"] - before["prefill_steps"] < after["steps"] - before["steps"]


def test_the_startup_heap_is_frozen_out_of_the_garbage_collectors_view(server):
    # Frozen once the structured-output tables are built, shortly after /health says ready.
    deadline = time.monotonic() + TIMEOUT
    while not (lines := [ln for ln in server.log_path.read_text(errors="replace").splitlines()
                         if "startup objects" in ln]):
        assert time.monotonic() < deadline, server.log_text()
        time.sleep(0.05)
    assert int(lines[0].split("froze ")[1].split()[0]) > 10_000, lines
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_no_traceback_in_the_server_log(server):
    # Runs last in this module: nothing above may have produced an unhandled error.
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log_text()


def test_top_k_larger_than_the_vocabulary_is_answered(server):
    # Last in the module: a regression here leaves the server unable to sample.
    with httpx.Client(base_url=server.base_url, timeout=3) as c:
        response = c.post("/v1/chat/completions", json={
            "messages": HI, "max_tokens": 3, "top_k": 100_000})
        assert response.status_code in (200, 400), response.text
        after = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
        assert after.status_code == 200


def test_vllm_fields_that_change_the_output_are_honoured_or_a_400(client, server):
    common = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30,
              "temperature": 0, "logit_bias": NO_EOS}
    plain = client.completions.create(**common).choices[0].text
    stop = plain[len(plain) // 2:][:2]  # text the greedy reply writes
    cut = client.completions.create(**common, stop=[stop]).choices[0]
    kept = client.completions.create(**common, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and plain.startswith(kept.text)
    for field, value in (("use_beam_search", True), ("bad_words", ["x"]),
                         ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 8)):
        reply = httpx.post(server.base_url + "/v1/completions", timeout=TIMEOUT,
                           json={**common, field: value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field


def test_text_and_refusal_parts_read_as_their_text(client):
    """A conversation sent back with content parts renders as the same text in strings: a
    refusal part (the assistant's own words, as OpenAI returns them) included."""
    def prompt_tokens(messages) -> int:
        return client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=1).usage.prompt_tokens

    as_strings = [{"role": "user", "content": "Tell me a secret."},
                  {"role": "assistant", "content": "I can't share that."},
                  {"role": "user", "content": "Then a joke."}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a secret."}]},
                {"role": "assistant", "content": [
                    {"type": "refusal", "refusal": "I can't share that."}]},
                {"role": "user", "content": [{"type": "text", "text": "Then a joke."}]}]
    assert prompt_tokens(as_parts) == prompt_tokens(as_strings)
    response = client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "user", "content": "Tell me a secret."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't share that."}]},
        {"role": "user", "content": "Then a joke."}])
    assert response.usage.input_tokens == prompt_tokens(as_strings)
