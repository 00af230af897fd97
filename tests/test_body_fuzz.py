"""Mutated request bodies against a real server: never a 5xx, every refusal an OpenAI error,
every 200 (whole or streamed) what the openai SDK's types read.

Valid chat, completion and Response bodies (tools, tool results, logprobs, formats) get
one to three mutations each: a field set to an odd value (wrong types, NaN, lone
surrogates, huge numbers, nested junk), dropped, or added, at the top or anywhere inside.
``MLX_SERVE_TEST_FUZZED_BODIES`` sets how many (300; 20,000 pass too, in about a minute).
"""

from __future__ import annotations

import copy
import json
import os
import random
from typing import Any

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {
    "model": "agentic", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "stop": ["x"],
    "messages": [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                 {"role": "assistant", "content": None, "tool_calls": [{
                     "id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "n": 1, "seed": 1, "logprobs": True, "top_logprobs": 2, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
    "response_format": {"type": "text"}, "presence_penalty": 0.1, "logit_bias": {"5": 1},
    "min_tokens": 0, "top_k": 5, "stop_token_ids": [3], "skip_special_tokens": True}
COMPLETION = {"model": "agentic", "prompt": "hello", "max_tokens": 3, "temperature": 0,
              "echo": False, "logprobs": 1, "n": 1, "stop": None, "seed": 3, "user": "u",
              "response_format": {"type": "text"}}
RESPONSE = {
    "model": "agentic", "max_output_tokens": 3, "temperature": 0.5, "instructions": "brief",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
              {"type": "function_call", "call_id": "c1", "name": "get_weather",
               "arguments": "{}"},
              {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
    "text": {"format": {"type": "text"}}, "metadata": {"a": "b"}, "store": True}
# The same with the shapes a client may send instead: allowed tools, parts, a refusal.
CHAT_PARTS = {**CHAT, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
    "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}},
    "messages": [*CHAT["messages"][:2], {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "again"}]}
RESPONSE_PARTS = {**RESPONSE, "tool_choice": {
    "type": "allowed_tools", "mode": "required",
    "tools": [{"type": "function", "name": "get_weather"}]},
    "input": [*RESPONSE["input"][:2], {"type": "function_call_output", "call_id": "c1",
                                       "output": [{"type": "input_text", "text": "sunny"}]}],
    "reasoning": {"effort": "max", "mode": "standard", "context": "auto"}}
ODD = [None, True, 0, -1, 2**63, 1e308, float("nan"), 0.5, "", "x", "é😀", "\u0000", "\ud800x",
       "a" * 3000, [], [1], ["x"], [None], {}, {"a": 1}, {"type": "x"}, [{"role": "user"}],
       [{"role": "tool", "content": "x"}], [{"type": "function"}], {"type": "json_object"},
       {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
       {"type": "function", "function": {"name": "nope"}}, "required", "none",
       {"include_usage": True, "continuous_usage_stats": True},
       {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{}]}},
       [{"type": "refusal"}], [{"type": "image_url", "image_url": {"url": "x"}}],
       [{"type": "input_text", "text": "x"}], {"type": "function", "name": "get_weather"}]
BODIES = [("/v1/chat/completions", CHAT), ("/v1/chat/completions", CHAT_PARTS),
          ("/v1/completions", COMPLETION), ("/v1/responses", RESPONSE),
          ("/v1/responses", RESPONSE_PARTS)]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
FUZZED_BODIES = int(os.environ.get("MLX_SERVE_TEST_FUZZED_BODIES", "300"))


def places(node: Any, at: tuple = ()) -> list[tuple]:
    """Every key and index inside a body, as paths."""
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    return [p for k, v in items for p in [at + (k,), *places(v, at + (k,))]]


def mutated(rng: random.Random, body: dict) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randrange(1, 4)):
        where = rng.choice(places(body) + [("x_extra",)])
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.2:
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = copy.deepcopy(rng.choice(ODD))
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def read_as_the_sdk(path: str, response: httpx.Response) -> None:
    if not response.headers["content-type"].startswith("text/event-stream"):
        data = response.json()
        for choice in data.get("choices", []):  # an echoed prompt's first token has none
            logprobs = choice.get("logprobs") or {}
            if path == "/v1/completions" and logprobs:
                logprobs["token_logprobs"] = [x or 0.0 for x in logprobs["token_logprobs"]]
                logprobs["top_logprobs"] = [x or {} for x in logprobs["top_logprobs"] or []]
        {"/v1/chat/completions": ChatCompletion, "/v1/completions": Completion,
         "/v1/responses": Response}[path].model_validate(data)
        return
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" or path == "/v1/responses"
    for line in lines:
        if line == "[DONE]":
            continue
        data = json.loads(line)
        if path == "/v1/responses":
            EVENTS.validate_python(data)
        elif path == "/v1/chat/completions":
            assert "error" not in data, data
            ChatCompletionChunk.model_validate(data)
        else:
            assert "error" not in data, data
            assert data["object"] == "text_completion" and data["choices"] is not None


def test_no_body_makes_a_5xx_and_every_answer_is_openais(agentic_server):
    rng = random.Random(7)
    with httpx.Client(base_url=agentic_server.base_url, timeout=60) as client:
        for _ in range(FUZZED_BODIES):
            path, body = rng.choice(BODIES)
            body = mutated(rng, body)
            response = client.post(path, content=json.dumps(body),  # NaN, \ud800 as written
                                   headers={"content-type": "application/json"})
            assert response.status_code < 500, (body, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"], (body, error)
            else:
                read_as_the_sdk(path, response)
        health = client.get("/health").json()
    assert health["state"] == "ready" and health["running"] == 0


TOKENIZER_BODIES = {
    "/tokenize": [{"prompt": "hello", "add_special_tokens": True, "return_token_strs": True},
                  {"messages": [{"role": "user", "content": "hi"}],
                   "add_generation_prompt": True, "chat_template_kwargs": {}}],
    "/detokenize": [{"tokens": [1, 2, 3]}],
}
QUERY_VALUES = ["", "-1", "0", "1", "101", "asc", "desc", "true", "zzz", "resp-x"]


def test_tokenizer_and_stored_response_endpoints_never_make_a_5xx(agentic_server):
    """The same for the tokenizer endpoints' bodies and for stored responses looked up
    with odd ids and query strings."""
    rng = random.Random(8)
    with httpx.Client(base_url=agentic_server.base_url, timeout=60) as client:
        made = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        ids = [made.json()["id"], "resp-unknown", "a" * 300, "é"]
        for _ in range(200):
            if rng.random() < 0.5:
                path = rng.choice(sorted(TOKENIZER_BODIES))
                body = mutated(rng, rng.choice(TOKENIZER_BODIES[path]))
                body.pop("stream", None)
                response = client.post(path, content=json.dumps(body),
                                       headers={"content-type": "application/json"})
            else:
                query = {rng.choice(["limit", "order", "after", "before", "include",
                                     "stream", "starting_after"]): rng.choice(QUERY_VALUES)
                         for _ in range(rng.randrange(3))}
                suffix = rng.choice(["", "/input_items"])
                response = client.get(f"/v1/responses/{rng.choice(ids)}{suffix}",
                                      params=query)
            assert response.status_code < 500, response.text
            if response.status_code >= 400:
                assert response.json()["error"]["message"]
