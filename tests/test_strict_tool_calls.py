"""A function's ``strict: true`` with ``tool_choice`` "auto": text stays free, and a call
the model chooses to write follows the function's schema (a grammar from the tool-call
marker on, as llama.cpp's lazy grammars). Over HTTP on a model whose own calls are JSON
and on one whose own calls are XML, where a held call is written as JSON."""

from __future__ import annotations

import json

import pytest

from mlx_serve.protocol import FunctionDefinition
from mlx_serve.runner.formats import compile_format
from mlx_serve.strict_calls import calls_format, json_calls
from tests.test_agentic import BOUNDED_TOOLS, TIME_TOOL, allowed, chat

CITIES = ["Paris", "Rome", "Oslo"]
STRICT = FunctionDefinition(name="get_weather", strict=True, parameters={
    "type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"],
    "additionalProperties": False})
LOOSE = FunctionDefinition(name="get_time", parameters={"type": "object"})


def strict_calls_format(functions, tokenizer) -> dict | None:
    """The format a reply with these functions and no response_format gets."""
    return calls_format(json_calls(functions, tokenizer), None)


@pytest.fixture(scope="module")
def strict_format(agentic_tokenizer):
    fmt = strict_calls_format([STRICT, LOOSE], agentic_tokenizer)
    assert fmt is not None
    return compile_format(agentic_tokenizer, fmt, len(agentic_tokenizer._tokenizer))


def reply_tokens(tokenizer, *pieces: str | int) -> list[int]:
    """Text pieces encoded, ints as they are (special tokens)."""
    out: list[int] = []
    for piece in pieces:
        out += [piece] if isinstance(piece, int) else tokenizer.encode(
            piece, add_special_tokens=False)
    return out


def markers(tokenizer) -> tuple[int, int]:
    return tuple(tokenizer.encode(m, add_special_tokens=False)[0]
                 for m in (tokenizer.tool_call_start, tokenizer.tool_call_end))


def test_no_strict_function_means_no_grammar(agentic_tokenizer, tiny_model_dir):
    from mlx_lm import load

    assert strict_calls_format([LOOSE], agentic_tokenizer) is None
    assert strict_calls_format([], agentic_tokenizer) is None
    # A model without tool-call markers (its calls could not be told apart): none either.
    assert strict_calls_format([STRICT], load(str(tiny_model_dir))[1]) is None


def test_text_and_a_valid_call_pass(strict_format, agentic_tokenizer):
    start, end = markers(agentic_tokenizer)
    think_end = agentic_tokenizer.encode(agentic_tokenizer.think_end,
                                         add_special_tokens=False)[0]
    valid = reply_tokens(
        agentic_tokenizer, "Let me think", think_end, "I'll look it up.", start,
        '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', end,
        "Then the time:", start, '\n{"name": "get_time", "arguments": {"zone": 1}}\n', end)
    strict_format.make_processor_at(0, valid)  # raises if a token breaks the grammar


def test_the_grammar_masks_only_inside_a_call(strict_format, agentic_tokenizer):
    """Free text goes unmasked (no grammar work a token); the marker opens the mask, the
    end marker closes it."""
    import mlx.core as mx

    start, end = markers(agentic_tokenizer)
    logits = mx.zeros((1, len(agentic_tokenizer._tokenizer)))
    processor = strict_format.make_processor(0)
    said = reply_tokens(agentic_tokenizer, "Sure.")
    assert mx.array_equal(processor(mx.array(said), logits), logits)
    said += [start]
    masked = processor(mx.array(said), logits)
    assert mx.isinf(masked).any().item() and not mx.isinf(masked).all().item()
    said += reply_tokens(agentic_tokenizer,
                         '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n') + [end]
    assert mx.array_equal(processor(mx.array(said), logits), logits)


@pytest.mark.parametrize("call", [
    '{"name": "get_weather", "arguments": {"city": "Lyon"}}',  # not in its enum
    '{"name": "get_weather", "arguments": {"town": "Oslo"}}',  # not its parameter
    '{"name": "get_news", "arguments": {}}',  # not an offered function
    '{"name": "get_time", "arguments": []}',  # a loose function's arguments: an object
    'get_weather(city="Oslo")',  # not JSON
])
def test_a_call_off_its_schema_is_refused(strict_format, agentic_tokenizer, call):
    start, _ = markers(agentic_tokenizer)
    with pytest.raises(RuntimeError, match="breaks a strict tool call"):
        strict_format.make_processor_at(0, reply_tokens(agentic_tokenizer, "Ok.", start,
                                                         "\n" + call))


STRICT_TOOLS = [{"type": "function", "function": STRICT.model_dump(exclude_none=True)}]


def biased_call(server, tools, seed: int, **body) -> dict:
    """A reply pushed into a tool call at once: the random model's marker token is biased
    up, so the model calls, and what follows the marker shows whether it is constrained."""
    start = 514  # the agentic tiny model's <tool_call> (test_the_marker_id_is_the_agentic_models)
    reply = chat(server, tools=tools, max_tokens=60, temperature=1.0, seed=seed,
                 logit_bias={str(start): 100}, parallel_tool_calls=False, **body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_the_marker_id_is_the_agentic_models(agentic_tokenizer):
    assert markers(agentic_tokenizer)[0] == 514


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_strict_functions_call_follows_its_schema(calls_server, seed):
    choice = biased_call(calls_server, STRICT_TOOLS, seed)
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in CITIES


def test_allowed_tools_auto_keeps_strict_calls_to_the_allowed(agentic_server):
    """Only the allowed functions are offered, so a call may only name one of them."""
    for seed in (0, 1):
        choice = biased_call(agentic_server, STRICT_TOOLS + [TIME_TOOL], seed,
                             tool_choice=allowed("auto", "get_weather"))
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in CITIES


def test_without_strict_the_same_calls_are_not_constrained(calls_server):
    """The control: the same seeds and bias with the schema not strict give no valid call
    (the random model writes noise after the marker, in its own format), so the test
    above could fail."""
    loose = [{"type": "function", "function": {**BOUNDED_TOOLS[0]["function"],
                                               "parameters": STRICT.parameters}}]
    for seed in (0, 1, 2):
        choice = biased_call(calls_server, loose, seed)
        calls = choice["message"].get("tool_calls") or []
        assert not any(json.loads(c["function"]["arguments"] or "{}").get("city") in CITIES
                       for c in calls), choice


def test_ignore_eos_and_min_tokens_work_beside_strict_calls(agentic_server):
    """The grammar sleeps in free text, so an ignored end of sequence passes there."""
    reply = chat(agentic_server, tools=STRICT_TOOLS, max_tokens=12, ignore_eos=True,
                 min_tokens=12, temperature=1.0, seed=0)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] == 12


def test_a_streamed_strict_call_is_the_whole_ones(calls_server):
    import openai

    sdk = openai.OpenAI(base_url=calls_server.base_url + "/v1", api_key="unused",
                        timeout=30)
    ask = dict(model=sdk.models.list().data[0].id, tools=STRICT_TOOLS, max_tokens=60,
               temperature=1.0, seed=5, parallel_tool_calls=False,
               messages=[{"role": "user", "content": "What is the weather?"}],
               extra_body={"logit_bias": {"514": 100}})
    whole = sdk.chat.completions.create(**ask)
    (call,) = whole.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] in CITIES
    chunks = list(sdk.chat.completions.create(**ask, stream=True))
    streamed = "".join(d.function.arguments or "" for c in chunks if c.choices
                       for d in c.choices[0].delta.tool_calls or [])
    assert streamed == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_strict_schema_that_cannot_be_enforced_is_a_400_naming_why(agentic_server):
    lookahead = [{"type": "function", "function": {
        "name": "get_weather", "strict": True, "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "pattern": "(?=P)."}}}}}]
    reply = chat(agentic_server, tools=lookahead)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools"
    assert "cannot be enforced" in error["message"] and "look-around" in error["message"]
    # The same schema without strict is served: its arguments are not held to it.
    lookahead[0]["function"]["strict"] = False
    assert chat(agentic_server, tools=lookahead).status_code == 200
