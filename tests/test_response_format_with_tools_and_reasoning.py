"""A JSON ``response_format`` beside tools and beside a reasoning span: tools stay
callable (the reply is the answer in its schema or tool calls), and a reasoning span the
template opened stays free, the format applying after its end marker."""

from __future__ import annotations

import json

import pytest

from mlx_serve.prompts import Rendered
from mlx_serve.reply_constraint import reasoning_markers
from mlx_serve.runner.formats import compile_format
from tests.test_agentic import chat
from tests.test_strict_tool_calls import (
    CITIES,
    STRICT,
    STRICT_TOOLS,
    biased_call,
    reply_tokens,
)

ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"], "additionalProperties": False}}}


@pytest.mark.parametrize("strict", [True, False])
def test_a_json_response_format_leaves_tools_callable(calls_server, strict):
    """As with OpenAI's models, a reply with a response_format may call a tool: it is the
    answer in its schema, or calls between the markers (a strict one in its schema), in
    JSON whatever the model's own call format."""
    tools = [{"type": "function", "function": {**STRICT.model_dump(exclude_none=True),
                                               "strict": strict}}]
    for seed in (0, 1):
        choice = biased_call(calls_server, tools, seed, response_format=ANSWER,
                             chat_template_kwargs={"enable_thinking": False})
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        if strict:
            assert choice["finish_reason"] == "tool_calls", choice
            assert json.loads(call["function"]["arguments"])["city"] in CITIES
        else:  # any object: the random model may write its strings until max_tokens
            assert call["function"]["arguments"].startswith("{")


def test_without_a_call_the_reply_is_the_answer_in_its_schema(calls_server):
    for seed in (0, 1, 2):
        reply = chat(calls_server, tools=STRICT_TOOLS, response_format=ANSWER,
                     max_tokens=40, temperature=1.0, seed=seed,
                     chat_template_kwargs={"enable_thinking": False},  # no reasoning span
                     # no call, and no reasoning span opened by the model: the answer
                     logit_bias={"514": -100, "512": -100})
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")


def test_a_response_format_applies_after_the_open_reasoning(agentic_server):
    """The template opens a reasoning span: the reasoning stays free and the answer, after
    its end marker, follows the schema (as vLLM's structured outputs with a reasoning
    parser). The end marker is biased up so the random model closes it at once."""
    think_end = 513  # the agentic tiny model's </think>
    for seed in (0, 1):
        reply = chat(agentic_server, response_format=ANSWER, max_tokens=40,
                     temperature=1.0, seed=seed, logit_bias={str(think_end): 100})
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")


def test_a_replay_past_the_reasoning_resumes_the_format(agentic_tokenizer):
    fmt = compile_format(agentic_tokenizer, {
        "type": "after_reasoning", "format": ANSWER,
        "think_end": agentic_tokenizer.think_end_id}, len(agentic_tokenizer._tokenizer))
    end = agentic_tokenizer.think_end_id
    fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, "free { text", end,
                                          '{"answer": "y'))
    with pytest.raises(RuntimeError, match="break the response format"):
        fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, "hm", end, '{"other'))
    fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, "not JSON, still reasoning"))


@pytest.mark.parametrize("thinking_off", [{"chat_template_kwargs": {"enable_thinking": False}},
                                          {"reasoning_effort": "none"}])
def test_with_thinking_off_the_format_applies_from_the_first_token(agentic_server,
                                                                    agentic_tokenizer,
                                                                    thinking_off):
    """The request turned thinking off: the model may not open a reasoning span, even with
    both markers biased up, and the reply is the answer alone, in its schema."""
    think_start, think_end = 512, 513  # the agentic tiny model's <think>, </think>
    for seed in (0, 1):
        reply = chat(agentic_server, response_format=ANSWER, max_tokens=60,
                     temperature=1.0, seed=seed, **thinking_off,
                     logit_bias={str(think_start): 100, str(think_end): 100})
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
        assert not choice["message"].get("reasoning_content")
        assert reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize(("initial", "thinking_off", "kind"), [
    ("reasoning", False, "after_reasoning"),  # the template opened the span
    ("normal", False, "may_reason_first"),  # the model may open it (Qwen3 writes <think>)
    ("normal", True, None),  # the request turned thinking off
])
def test_where_a_format_leaves_reasoning_free(agentic_tokenizer, initial, thinking_off, kind):
    rendered = Rendered([1], None, True, initial, thinking_off=thinking_off)
    markers = reasoning_markers(agentic_tokenizer, rendered)
    assert (markers and markers["type"]) == kind


def test_a_replay_of_a_reply_that_opened_its_reasoning(agentic_tokenizer):
    start, end = agentic_tokenizer.think_start_id, agentic_tokenizer.think_end_id
    fmt = compile_format(agentic_tokenizer, {
        "type": "may_reason_first", "format": ANSWER, "think_start": start,
        "think_end": end}, len(agentic_tokenizer._tokenizer))
    fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, start, "free", end,
                                          '{"answer": "n'))
    fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, start, "still reasoning"))
    fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, '{"answer": "y'))  # no span
    with pytest.raises(RuntimeError, match="break the response format"):
        fmt.make_processor_at(0, reply_tokens(agentic_tokenizer, "no span, no JSON"))
