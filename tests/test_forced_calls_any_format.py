"""Calls held to a grammar on a model whose own call format is not JSON: a forced tool
call (``tool_choice`` required or a named function) is written as JSON between the
model's markers, as vLLM forces calls, and read as JSON, whole and streamed, in chat and
in Responses. So are a strict function's call and a call beside a JSON
``response_format`` (tested over both formats in ``test_strict_tool_calls`` and
``test_response_format_with_tools_and_reasoning``); with nothing to hold, the model
keeps its own format."""

from __future__ import annotations

import json

import openai
import pytest

from mlx_serve.strict_calls import json_calls
from tests.server_process import ServerProcess
from tests.test_agentic import BOUNDED_TOOLS, RESPONSES_TOOL
from tests.test_strict_tool_calls import LOOSE, STRICT

NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


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


def test_strict_on_markers_of_several_tokens_is_accepted_with_a_warning(
        agentic_tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(agentic_tokenizer, "_tool_call_start", "<tool_call>call")
    with caplog.at_level("WARNING", logger="mlx_serve.strict_calls"):
        assert json_calls([LOOSE], agentic_tokenizer) is None
        assert not caplog.records  # nothing asked for, nothing to say
        assert json_calls([STRICT], agentic_tokenizer) is None
    assert "'strict' is not enforced" in caplog.records[0].getMessage()
