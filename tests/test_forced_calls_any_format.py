"""A forced tool call (``tool_choice`` required or a named function) on a model whose own
call format is not JSON: the call is written as JSON between the model's markers, as
vLLM forces calls, and read as JSON, whole and streamed, in chat and in Responses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server_process import ServerProcess
from tests.test_agentic import BOUNDED_TOOLS, RESPONSES_TOOL

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
