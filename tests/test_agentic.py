"""Tools, reasoning and the reply shapes for them, on a tiny model with marker tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_serve.generation import (
    Delta,
    FinishReason,
    GenerationRequest,
    OutputOptions,
    SamplingParams,
)
from mlx_serve.replies import Choice, ReplyShape
from tests.server_process import ServerProcess

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SCRIPT = ('Let me check.</think>Sure. <tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}</tool_call>')


# A finished call and its result, as chat messages.
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def run_script(tokenizer, text: str, *, split: bool = True, finish: str = "stop"):
    from mlx_lm.generate import make_text_state_machine

    from mlx_serve.runner.text import TextPipeline

    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=100), output=OutputOptions(
        split_reasoning=split, initial_state="reasoning"))
    pipe = TextPipeline(tokenizer.detokenizer, request, make_text_state_machine(tokenizer))
    tokens = tokenizer.encode(text, add_special_tokens=False) + [2]  # then <|im_end|>
    pieces = [pipe.advance(t, finish if i == len(tokens) - 1 else None)
              for i, t in enumerate(tokens)]
    return pieces


def test_reasoning_content_and_tool_calls_are_routed_apart(agentic_tokenizer):
    pieces = run_script(agentic_tokenizer, SCRIPT)
    assert "".join(p.reasoning for p in pieces) == "Let me check."
    assert "".join(p.content for p in pieces) == "Sure. "
    calls = [c for p in pieces for c in p.tool_calls]
    assert len(calls) == 1 and json.loads(calls[0])["arguments"] == {"city": "Paris"}
    assert pieces[-1].finish is FinishReason.STOP


def test_without_splitting_the_markers_stay_in_the_text(agentic_tokenizer):
    pieces = run_script(agentic_tokenizer, "a<think>b</think>c", split=False)
    assert "".join(p.content for p in pieces) == "a<think>b</think>c"


def shape_for(tokenizer, chat: bool = True, **kw) -> ReplyShape:
    return ReplyShape(chat=chat, model="m", prompt_tokens=5, tool_parser=tokenizer.tool_parser,
                      tools=TOOLS, **kw)


def scripted_deltas(tokenizer) -> list[Delta]:
    return [Delta(p.content, 1, p.finish, 0, p.reasoning, p.tool_calls, tool_text=p.tool_text)
            for p in run_script(tokenizer, SCRIPT)]


def test_whole_reply_with_tool_calls_validates_as_an_openai_chat_completion(agentic_tokenizer):
    shape = shape_for(agentic_tokenizer)
    choice = Choice(0)
    for delta in scripted_deltas(agentic_tokenizer):
        shape.absorb(choice, delta)
    reply = ChatCompletion.model_validate(shape.completion([choice]))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure. "
    assert message.model_extra["reasoning"] == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_calls_validate_as_openai_chunks(agentic_tokenizer):
    shape = shape_for(agentic_tokenizer, reasoning_format="reasoning_content")
    choice = Choice(0)
    chunks = []
    for delta in scripted_deltas(agentic_tokenizer):
        chunk = shape.delta_chunk(choice, delta, shape.absorb(choice, delta))
        if chunk is not None:
            chunks.append(ChatCompletionChunk.model_validate_json(chunk))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    # Announced once with its id and name, then its arguments as the model writes them.
    first, *rest = calls
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_")
    assert rest and all((c.index, c.id, c.function.name) == (0, None, None) for c in rest)
    assert "".join(c.function.arguments for c in calls) == '{"city": "Paris"}'
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content", "")
                        for ch in chunks)
    assert reasoning == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def chat(server: ServerProcess, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "What is the weather?"}])
    body.setdefault("max_tokens", 6)
    body.setdefault("temperature", 0)
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)


def test_thinking_models_return_reasoning_separately(agentic_server):
    thinking = chat(agentic_server).json()
    plain = chat(agentic_server, chat_template_kwargs={"enable_thinking": False}).json()
    assert thinking["choices"][0]["message"]["reasoning"]  # the template opened <think>
    assert "reasoning" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["content"]
    assert plain["usage"]["prompt_tokens"] < thinking["usage"]["prompt_tokens"]
    # Tokens that wrote only reasoning count as reasoning tokens, as OpenAI reports them.
    assert 0 < thinking["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 6
    assert plain["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize("tools", [{}, {"tool_choice": "none", "tools": [{
    "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}])
def test_without_tools_a_tool_call_marker_is_a_special_token_and_the_text_stays(
        agentic_server, agentic_tokenizer, tools):
    """No call is parsed without tools (or with tool_choice none), as in vLLM: the text
    after a <tool_call> marker stays in the content, the marker left out like any special
    token (shown with skip_special_tokens false)."""
    ask = {"max_tokens": 30, "temperature": 1.0, "seed": 1, "logit_bias": {"514": 8},
           "chat_template_kwargs": {"enable_thinking": False}, **tools}
    shown = chat(agentic_server, skip_special_tokens=False, **ask).json()["choices"][0]
    skipped = chat(agentic_server, **ask).json()["choices"][0]
    raw = shown["message"]["content"]
    assert "<tool_call>" in raw and not shown["message"].get("tool_calls"), shown
    without_special = raw
    for token in agentic_tokenizer.added_tokens_decoder.values():
        if token.special:
            without_special = without_special.replace(token.content, "")
    assert skipped["message"]["content"] == without_special
    assert len(raw.split("<tool_call>", 1)[1]) > 0  # text after the marker, kept


@pytest.mark.parametrize(("thinking", "marker", "where"), [
    (False, 513, "content"),  # </think> outside reasoning
    (False, 515, "content"),  # </tool_call> outside a call
    (True, 512, "reasoning"),  # <think> inside reasoning
])
def test_a_marker_where_it_moves_nothing_is_a_special_token(agentic_server, thinking,
                                                            marker, where):
    """As vLLM's skip_special_tokens: such a marker adds no text (shown with it false)."""
    ask = {"max_tokens": 20, "temperature": 1.0, "seed": 3, "logit_bias": {str(marker): 8},
           "chat_template_kwargs": {"enable_thinking": thinking}}
    text = {}
    for skip in (True, False):
        reply = chat(agentic_server, skip_special_tokens=skip, **ask).json()
        text[skip] = reply["choices"][0]["message"].get(where) or ""
    marker_text = {512: "<think>", 513: "</think>", 515: "</tool_call>"}[marker]
    assert marker_text in text[False]
    assert marker_text not in text[True] and text[True]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "broken"}}])
def test_a_forced_call_to_a_tool_with_an_invalid_schema_names_the_tools(agentic_server,
                                                                        tool_choice):
    broken = [{"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]
    reply = chat(agentic_server, tools=broken, tool_choice=tool_choice)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools"


def test_tools_and_tool_results_go_through_the_template(agentic_server):
    without = chat(agentic_server).json()["usage"]["prompt_tokens"]
    reply = chat(agentic_server, messages=HISTORY, tools=TOOLS, tool_choice="auto")
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > without + 20
    auto = chat(agentic_server, tools=TOOLS).json()["usage"]["prompt_tokens"]
    none = chat(agentic_server, tools=TOOLS, tool_choice="none").json()
    # As OpenAI and vLLM: the tools stay in the prompt; no call is parsed.
    assert none["usage"]["prompt_tokens"] == auto > without
    tokenized = httpx.post(agentic_server.base_url + "/tokenize", timeout=30, json={
        "messages": [{"role": "user", "content": "What is the weather?"}], "tools": TOOLS})
    assert tokenized.json()["count"] == auto  # what /tokenize renders, either way


# Bounded strings: a random model would otherwise write one until max_tokens.
BOUNDED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}]


def forced_call(server, tool_choice, tools=BOUNDED_TOOLS) -> dict:
    reply = chat(server, tools=tools, tool_choice=tool_choice, max_tokens=80,
                 temperature=1.0, seed=3)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_a_named_tool_choice_forces_a_valid_call_of_that_function(agentic_server):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    choice = forced_call(agentic_server, tool_choice)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_required_tool_choice_calls_one_of_the_tools(agentic_server):
    tools = BOUNDED_TOOLS + [{"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
            "additionalProperties": False}}}]
    for seed in (1, 2, 3):
        reply = chat(agentic_server, tools=tools, tool_choice="required", max_tokens=80,
                     temperature=1.0, seed=seed)
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in {"get_weather", "get_time"}
        json.loads(call["function"]["arguments"])


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}}}


def allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


def test_allowed_tools_required_calls_one_of_the_allowed(agentic_server):
    for seed in (1, 2, 3):
        reply = chat(agentic_server, tools=BOUNDED_TOOLS + [TIME_TOOL], max_tokens=80,
                     tool_choice=allowed("required", "get_time"), temperature=1.0, seed=seed)
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        assert set(json.loads(call["function"]["arguments"])) == {"zone"}


def test_allowed_tools_auto_offers_only_the_allowed(agentic_server):
    def prompt_tokens(**body) -> int:
        reply = chat(agentic_server, max_tokens=1, **body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    both = prompt_tokens(tools=BOUNDED_TOOLS + [TIME_TOOL], tool_choice="auto")
    only_time = prompt_tokens(tools=[TIME_TOOL], tool_choice="auto")
    assert only_time < both
    assert prompt_tokens(tools=BOUNDED_TOOLS + [TIME_TOOL],
                         tool_choice=allowed("auto", "get_time")) == only_time


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": allowed("auto", "nope")}, "tool_choice"),
    ({"tool_choice": allowed("required", "get_weather")}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "custom", "custom": {"name": "x"}}]}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": "get_weather"}]}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
])
def test_tool_and_template_fields_we_cannot_honour_are_400(agentic_server, body, param):
    reply = chat(agentic_server, **body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


# -- the Responses API's function tools ---------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "get_weather",
                  "parameters": BOUNDED_TOOLS[0]["function"]["parameters"]}


def sdk(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=30,
                         max_retries=0)


def test_a_forced_function_call_comes_back_as_a_function_call_item(agentic_server):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    chat_call = chat(agentic_server, tools=BOUNDED_TOOLS, tool_choice=forced, max_tokens=80,
                     messages=[{"role": "user", "content": "What is the weather in Paris?"}]
                     ).json()["choices"][0]["message"]["tool_calls"][0]
    with sdk(agentic_server) as client:
        response = client.responses.create(
            model="agentic", input="What is the weather in Paris?", tools=[RESPONSES_TOOL],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
            temperature=0)
        events = list(client.responses.create(
            model="agentic", input="What is the weather in Paris?", tools=[RESPONSES_TOOL],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
            temperature=0, stream=True))
    assert response.status == "completed"
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("get_weather", chat_call["function"]["arguments"])
    assert call.call_id == call.id.removeprefix("fc_")
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    kinds = [e.type for e in events if e.type not in (
        "response.output_text.delta", "response.function_call_arguments.delta")]
    assert kinds == [  # no message: the reply is the call alone, item 0, as at OpenAI
        "response.created", "response.in_progress",
        # the call: opened once its name is written, its arguments as they come
        "response.output_item.added",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments, done.output_index) == (
        "get_weather", chat_call["function"]["arguments"], 0)
    assert len(pieces) > 1 and "".join(pieces) == done.arguments
    final = events[-1].response
    assert final.status == "completed"
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [
        ("function_call", "get_weather")]


def test_a_response_echoes_its_tools_and_allowed_tools_choice(agentic_server):
    time_tool = {"type": "function", "name": "get_time",
                 "parameters": TIME_TOOL["function"]["parameters"]}
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "get_time"}]}
    with sdk(agentic_server) as client:
        response = client.responses.create(
            model="agentic", input="What time is it?", tools=[RESPONSES_TOOL, time_tool],
            tool_choice=choice, max_output_tokens=80, temperature=0)
    assert [(o.type, getattr(o, "name", None)) for o in response.output
            if o.type == "function_call"] == [("function_call", "get_time")]
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]
    assert response.tools[1].parameters == time_tool["parameters"]
    assert response.tool_choice.type == "allowed_tools"
    assert (response.tool_choice.mode, response.tool_choice.tools) == ("required",
                                                                       choice["tools"])


@pytest.mark.parametrize("output", [
    "sunny, 21 C",
    [{"type": "input_text", "text": "sunny, "}, {"type": "input_text", "text": "21 C"}],
], ids=["text", "text-parts"])
def test_function_calls_and_their_outputs_go_in_as_the_chat_history(agentic_server, output):
    as_chat = chat(agentic_server, messages=HISTORY, tools=BOUNDED_TOOLS, max_tokens=1).json()
    with sdk(agentic_server) as client:
        response = client.responses.create(model="agentic", tools=[RESPONSES_TOOL],
                                           max_output_tokens=1, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": output}])
    assert response.usage.input_tokens == as_chat["usage"]["prompt_tokens"]


def test_a_function_output_that_is_not_text_is_refused_by_its_type(agentic_server):
    reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30, json={
        "max_output_tokens": 1, "input": [
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input.1.output"
    assert "content parts of type 'input_image' are not supported" in error["message"]


@pytest.mark.parametrize("earlier", [[], [
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}]])
def test_a_function_output_that_answers_no_call_is_a_400_as_at_openai(agentic_server, earlier):
    reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30, json={
        "max_output_tokens": 1, "input": [
            *earlier, {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input"
    assert error["message"] == ("No tool call found for function call output with call_id "
                                "call_nope.")


def test_a_function_call_carries_over_to_the_follow_up_by_id(agentic_server):
    """An agent loop by response id: the model's call is kept with its response, and
    the follow-up sends only the call's output, yet generates what the whole history
    does."""
    def respond(**body) -> dict:
        reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30, json={
            "temperature": 0, "tools": [RESPONSES_TOOL], "max_output_tokens": 80, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    asked = respond(input="What is the weather in Paris?",
                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [o for o in asked["output"] if o["type"] == "function_call"]
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    chained = respond(input=[answer], previous_response_id=asked["id"])
    said = [{"role": "assistant", "content": part["content"]} for part in asked["output"]
            if part["type"] == "message" and part["content"]]
    whole = respond(store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *said,
        {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
         "arguments": call["arguments"]}, answer])
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert chained["output"] == [{**o, "id": c["id"]} for o, c in
                                 zip(whole["output"], chained["output"], strict=True)]
    # What the follow-up was generated from, as listed: the call by the id it had.
    listed = httpx.get(f"{agentic_server.base_url}/v1/responses/{chained['id']}/input_items",
                       params={"order": "asc"}, timeout=10).json()["data"]
    assert [i["type"] for i in listed] == [
        "message", *(["message"] if said else []), "function_call", "function_call_output"]
    assert listed[-2] == call and listed[-1]["output"] == "sunny"


def test_reasoning_sent_back_goes_in_before_the_assistant_text(agentic_server):
    """``input += response.output`` and a follow-up by id both give the chat template the
    earlier turn's reasoning (``reasoning_content``), as a chat request carrying it does."""
    question, again = "What is the weather?", "And tomorrow?"
    with sdk(agentic_server) as client:
        ask = {"model": "agentic", "temperature": 0, "max_output_tokens": 1}
        first = client.responses.create(**{**ask, "max_output_tokens": 6}, input=question)
        (reasoning,) = [o for o in first.output if o.type == "reasoning"]
        thought = "".join(part.text for part in reasoning.content)
        assert thought  # the template opened <think>: the reply starts in it
        stateless = client.responses.create(**ask, store=False, input=[
            {"role": "user", "content": question},
            *[o.model_dump(exclude_none=True) for o in first.output],
            {"role": "user", "content": again}])
        chained = client.responses.create(**ask, input=again, previous_response_id=first.id)

    def prompt_tokens(assistant: dict) -> int:
        return chat(agentic_server, max_tokens=1, messages=[
            {"role": "user", "content": question}, {"role": "assistant", **assistant},
            {"role": "user", "content": again}]).json()["usage"]["prompt_tokens"]

    said = {"content": first.output_text or None}
    with_reasoning = prompt_tokens({**said, "reasoning_content": thought})
    assert with_reasoning > prompt_tokens(said)  # the template renders it
    assert stateless.usage.input_tokens == chained.usage.input_tokens == with_reasoning


@pytest.mark.parametrize(("effort", "thinks"), [("none", False), ("minimal", False),
                                                ("low", True), ("high", True), ("max", True)])
def test_reasoning_effort_sets_the_templates_thinking_switch(agentic_server, effort, thinks):
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses) reach a
    Qwen-style template as its enable_thinking: the same prompt as that switch."""
    switched = chat(agentic_server, chat_template_kwargs={"enable_thinking": thinks}).json()
    by_effort = chat(agentic_server, reasoning_effort=effort).json()
    assert by_effort["usage"]["prompt_tokens"] == switched["usage"]["prompt_tokens"]
    assert ("reasoning" in by_effort["choices"][0]["message"]) is thinks
    with sdk(agentic_server) as client:
        response = client.responses.create(model="agentic", input="What is the weather?",
                                           reasoning={"effort": effort}, max_output_tokens=6,
                                           temperature=0)
    assert response.usage.input_tokens == switched["usage"]["prompt_tokens"]
    assert any(o.type == "reasoning" for o in response.output) is thinks


def test_reasoning_summaries_are_not_made_here(agentic_server):
    reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30, json={
        "input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "reasoning.summary" and "not made" in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"reasoning": {"effort": "low", "mode": "pro"}}, "reasoning.mode"),
    ({"reasoning": {"effort": "low", "context": "all_turns"}}, "reasoning.context"),
    ({"tools": [{**RESPONSES_TOOL, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": [{**RESPONSES_TOOL, "allowed_callers": ["programmatic"]}]},
     "tools.0.allowed_callers"),
])
def test_response_settings_the_server_does_not_do_are_400(agentic_server, body, param):
    reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30,
                       json={"input": "Hi", "max_output_tokens": 1, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_response_settings_that_ask_for_what_the_server_does_are_taken(agentic_server):
    reply = httpx.post(agentic_server.base_url + "/v1/responses", timeout=30, json={
        "input": "Hi", "max_output_tokens": 1,
        "reasoning": {"effort": "low", "mode": "standard", "context": "auto"},
        "tools": [{**RESPONSES_TOOL, "defer_loading": False,
                   "allowed_callers": ["direct", "programmatic"]}]})
    assert reply.status_code == 200, reply.text


def test_reasoning_effort_goes_to_a_template_that_takes_it_or_is_a_400():
    from types import SimpleNamespace

    from mlx_serve.errors import UnsupportedParameterError
    from mlx_serve.prompts import effort_kwargs

    gpt_oss_like = SimpleNamespace(chat_template="Reasoning: {{ reasoning_effort }}")
    assert effort_kwargs("low", gpt_oss_like) == {"reasoning_effort": "low"}
    with pytest.raises(UnsupportedParameterError) as info:
        effort_kwargs("low", SimpleNamespace(chat_template="{{ messages }}"))
    assert info.value.param == "reasoning_effort"
