"""response_format over HTTP: a random model's output still parses and validates."""

from __future__ import annotations

import json

import httpx
import pytest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "maximum": 999}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(server, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Describe a person."}])
    body.setdefault("max_tokens", 120)
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_output_validates(tiny_server, seed):
    reply = chat(tiny_server, temperature=1.0, seed=seed, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_json_object_streams_valid_json(tiny_server):
    with httpx.stream("POST", tiny_server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "json please"}],
                            "max_tokens": 120, "stream": True, "temperature": 0,
                            "response_format": {"type": "json_object"}}) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_an_invalid_schema_is_a_400(tiny_server):
    reply = chat(tiny_server, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "response_format"


def test_a_schema_that_admits_no_value_is_a_400(tiny_server):
    reply = chat(tiny_server, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}})
    assert reply.status_code == 400, reply.text
    assert "admits no value" in reply.json()["error"]["message"]


# `{"a": ` is forced, then "a" must hold itself: the format fails only mid-reply.
DEEP_CYCLE = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}},
              "required": ["a"]}


def test_a_format_that_fails_mid_reply_ends_that_reply_alone(tiny_server):
    cycle = {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_CYCLE}}
    for _ in range(3):  # three in a row once failed the engine for good
        reply = chat(tiny_server, response_format=cycle)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "response_format"
    with httpx.stream("POST", tiny_server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 50, "response_format": cycle}) as streamed:
        lines = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["param"] == "response_format"
    assert chat(tiny_server, max_tokens=4).status_code == 200
    assert httpx.get(tiny_server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_constraint_that_fails_mid_reply_names_its_own_field(tiny_server, field):
    # Before, every such fault named response_format and asked about $ref cycles.
    body = ({"guided_json": DEEP_CYCLE} if field == "guided_json"
            else {"structured_outputs": {"json": DEEP_CYCLE}})
    reply = chat(tiny_server, **body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    param = "guided_json" if field == "guided_json" else "structured_outputs.json"
    assert error["param"] == param
    assert f"cannot go on under '{param}'" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_honour_response_format_as_vllm_does(tiny_server, stream):
    """Not in OpenAI's legacy completions, but vLLM takes it there: the text validates."""
    body = {"prompt": "A person:", "max_tokens": 120, "seed": 3, "temperature": 1.0,
            "stream": stream, "response_format": {
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    reply = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if stream:
        lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(line) for line in lines[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = reply.json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    value = json.loads(text)
    assert finish == "stop" and set(value) == {"name", "age"} and isinstance(value["age"], int)
