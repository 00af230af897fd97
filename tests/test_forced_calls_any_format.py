"""Calls held to a grammar on a model whose own call format is not JSON: a forced tool
call (``tool_choice`` required or a named function), a strict function's call and a call
beside a JSON ``response_format`` are written as JSON between the model's markers, as
vLLM forces calls, and read as JSON, whole and streamed, in chat and in Responses. With
nothing to hold, the model keeps its own format."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mlx_serve.strict_calls import json_calls
from tests.server_process import ServerProcess
from tests.test_agentic import BOUNDED_TOOLS, RESPONSES_TOOL, chat
from tests.test_response_format_with_tools_and_reasoning import ANSWER
from tests.test_strict_tool_calls import CITIES, LOOSE, STRICT, STRICT_TOOLS, biased_call

NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def xml_server(agentic_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """The agentic tiny model with Qwen3-Coder's parser: the same <tool_call> markers,
    XML calls inside them."""
    folder = tmp_path_factory.mktemp("xml-model") / "model"
    shutil.copytree(agentic_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tool_parser_type"] = "qwen3_coder"
    config_path.write_text(json.dumps(config))
    with ServerProcess(folder, folder.parent / "server.log") as server:
        yield server


def client(server: ServerProcess) -> tuple[openai.OpenAI, str]:
    sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
    return sdk, sdk.models.list().data[0].id


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_forced_call_is_valid_json_whole_and_streamed(xml_server, tool_choice):
    sdk, model = client(xml_server)
    ask = dict(model=model, messages=ASK, tools=BOUNDED_TOOLS, tool_choice=tool_choice,
               max_tokens=80, temperature=1.0, seed=3)
    whole = sdk.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    deltas = [d for chunk in sdk.chat.completions.create(**ask, stream=True)
              for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert len(deltas) > 1  # announced, then its arguments as they were written
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_a_forced_call_in_a_response_is_a_function_call_item(xml_server):
    sdk, model = client(xml_server)
    response = sdk.responses.create(
        model=model, input="Weather in Paris?", tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
        temperature=1.0)
    (item,) = [o for o in response.output if o.type == "function_call"]
    assert item.name == "get_weather" and set(json.loads(item.arguments)) == {"city"}


def test_a_model_without_tool_markers_still_refuses_a_forced_call(tiny_server):
    """Its chat template takes no tools at all: the tools are the 400."""
    sdk, model = client(tiny_server)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=model, messages=ASK, tools=BOUNDED_TOOLS, tool_choice="required")
    assert info.value.param == "tools"


def test_only_a_grammar_turns_an_xml_models_calls_into_json(agentic_tokenizer, monkeypatch):
    from mlx_lm.tool_parsers import qwen3_coder

    assert json_calls([STRICT], agentic_tokenizer)["as_json"] is False  # JSON already
    monkeypatch.setattr(agentic_tokenizer, "_tool_parser", qwen3_coder.parse_tool_call)
    assert json_calls([LOOSE], agentic_tokenizer) is None  # its own format: nothing held
    assert json_calls([STRICT, LOOSE], agentic_tokenizer)["as_json"] is True
    assert json_calls([LOOSE], agentic_tokenizer, json_answer=True)["as_json"] is True


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_strict_call_on_an_xml_model_is_json_in_its_schema(xml_server, seed):
    choice = biased_call(xml_server, STRICT_TOOLS, seed)
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in CITIES


def test_without_strict_an_xml_model_writes_its_own_unconstrained_calls(xml_server):
    """The control: not strict, the random model writes noise in its own format after the
    marker, so no seed gives a valid call and the test above could fail."""
    loose = [{"type": "function", "function": {**BOUNDED_TOOLS[0]["function"],
                                               "parameters": STRICT.parameters}}]
    for seed in (0, 1, 2):
        calls = biased_call(xml_server, loose, seed)["message"].get("tool_calls") or []
        assert not any(json.loads(c["function"]["arguments"] or "{}").get("city") in CITIES
                       for c in calls), calls


def test_a_streamed_strict_call_on_an_xml_model_is_the_whole_ones(xml_server):
    sdk, model = client(xml_server)
    ask = dict(model=model, messages=ASK, tools=STRICT_TOOLS, max_tokens=60,
               temperature=1.0, seed=5, parallel_tool_calls=False,
               extra_body={"logit_bias": {"514": 100}})
    (call,) = sdk.chat.completions.create(**ask).choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] in CITIES
    chunks = list(sdk.chat.completions.create(**ask, stream=True))
    streamed = "".join(d.function.arguments or "" for c in chunks if c.choices
                       for d in c.choices[0].delta.tool_calls or [])
    assert streamed == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_json_response_format_leaves_an_xml_models_tools_callable(xml_server):
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in (0, 1):
        choice = biased_call(xml_server, BOUNDED_TOOLS, seed, response_format=ANSWER,
                             **no_thinking)
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"].startswith("{")
    # No call and no reasoning span (the model may open one with its first token): the
    # answer in its schema.
    answer = chat(xml_server, tools=BOUNDED_TOOLS, response_format=ANSWER, max_tokens=40,
                  temperature=1.0, seed=0, logit_bias={"514": -100, "512": -100},
                  **no_thinking)
    assert json.loads(answer.json()["choices"][0]["message"]["content"])["answer"] in (
        "yes", "no")
