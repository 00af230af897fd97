"""OpenAI's Responses API through the official SDK (``client.responses``): the same
generation as the equivalent chat request, whole or as its stream of events."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from tests.http_helpers import (
    MODEL,
    TIMEOUT,
    client_fixture,
    health,
    read_then_leave,
    server_fixture,
    wait_health,
)

server = server_fixture("responses")
client = client_fixture()
QUESTION = "Tell me a story."


def chat_text(client, messages, max_tokens: int) -> tuple[str, str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=max_tokens)
    choice = reply.choices[0]
    return choice.message.content, choice.finish_reason, reply.usage.prompt_tokens


@pytest.mark.parametrize("max_tokens", [4, 40])  # the tiny model runs on to the limit
def test_a_response_is_what_the_chat_request_generates(client, max_tokens):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                       instructions="Be brief.", max_output_tokens=max_tokens,
                                       metadata={"ticket": "42"})
    assert response.metadata == {"ticket": "42"}
    text, finish, prompt_tokens = chat_text(client, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.total_tokens == prompt_tokens + response.usage.output_tokens
    # What sampled it, echoed as OpenAI does (before: no reasoning, top_p null).
    assert (response.temperature, response.top_p) == (0.0, 1.0)
    assert response.reasoning.effort is None and response.reasoning.summary is None
    if response.status == "completed":
        assert response.completed_at >= response.created_at
    else:
        assert response.completed_at is None


def test_the_stream_carries_the_same_text_in_order(client):
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.responses.create(model=MODEL, input=messages, temperature=0,
                                    max_output_tokens=6)
    events = list(client.responses.create(model=MODEL, input=messages, temperature=0,
                                          max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 6


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_text_format_is_enforced_and_completes(client, stream):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = client.responses.create(
        model=MODEL, input="A number, as JSON.", temperature=0, max_output_tokens=200,
        stream=stream, text={"format": {"type": "json_schema", "name": "number",
                                        "schema": schema, "strict": True}})
    if stream:
        events = list(reply)
        assert events[-1].type == "response.completed"
        reply = events[-1].response
    # The grammar ends the reply with the end-of-sequence token: completed, not cut off.
    assert reply.status == "completed" and reply.incomplete_details is None
    assert isinstance(json.loads(reply.output_text)["n"], int)


def test_a_text_format_that_fails_mid_reply_names_the_responses_field(client):
    # A $ref cycle with no way out: the grammar gives up once the reply is under way.
    looped = {"type": "object", "properties": {"b": {"$ref": "#/$defs/x"}}, "required": ["b"],
              "additionalProperties": False}
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
              "$defs": {"x": looped}, "additionalProperties": False}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", temperature=0, max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": schema}})
    assert info.value.body["param"] == "text.format"  # not the chat request's field


def test_output_text_logprobs_are_the_chat_requests(client):
    """include message.output_text.logprobs: each token's log-probability and top
    alternatives, as the chat request gives them, whole and streamed."""
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=2)
    expected = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    ask = {"model": MODEL, "input": messages, "temperature": 0, "max_output_tokens": 6,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = client.responses.create(**ask)
    part = whole.output[0].content[0]
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs])
            for t in part.logprobs] == expected
    assert whole.top_logprobs == 2
    events = list(client.responses.create(**ask, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(e[0], e[1]) for e in expected]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == len(expected)
    plain = client.responses.create(**{k: v for k, v in ask.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == []  # only when included, as at OpenAI


@pytest.mark.parametrize(("extra", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),  # no template
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                 "encrypted_content": "gAAAAB"}]}, "input"),  # another server's reasoning
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"input": [{"type": "function_call_outpt", "call_id": "c", "output": "x"}]},
     "input"),  # a type not served: said so, not "input should be a string"
    # Checked on the chat request it is built as, named as the Responses request names it.
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # no reasoning in the template
    ({"max_output_tokens": 100_000}, "max_output_tokens"),  # over the context
])
def test_what_is_not_served_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": QUESTION, **extra})
    assert info.value.param is not None and info.value.param.startswith(param)
    if param in ("reasoning.effort", "max_output_tokens"):
        assert param in info.value.message and "max_tokens" not in info.value.message
    if "function_call_outpt" in str(extra):
        assert "input.0.type 'function_call_outpt' is not an input item type" in (
            info.value.message)


@pytest.mark.parametrize("lines", [1, 6])  # at response.created; after two text deltas
def test_a_client_leaving_a_stream_ends_its_request(server, lines):
    steps = health(server)["steps"]

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as http:
            await read_then_leave(http, "/v1/responses", {
                "model": MODEL, "input": QUESTION, "max_output_tokens": 1500,
                "stream": True}, lines=lines)

    anyio.run(leave)
    # Without its client the request leaves the batch, long before its 1,500 tokens.
    body = wait_health(server, lambda body: body["running"] == 0 and body["waiting"] == 0)
    assert body["steps"] - steps < 1000, body


def test_a_seed_makes_a_sampled_response_repeat_as_in_chat(client):
    """Not an OpenAI Responses field, but chat's (and vLLM's): honoured alike."""
    ask = {"model": MODEL, "input": QUESTION, "max_output_tokens": 12, "temperature": 1.0}
    seeded = [client.responses.create(**ask, extra_body={"seed": seed}).output_text
              for seed in (5, 5, 6)]
    assert seeded[0] == seeded[1] != seeded[2]
