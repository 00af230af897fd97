"""The Responses stream item by item: reasoning, then the message, then function calls,
with the ids and output indexes of the final Response."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from mlx_serve.generation import Delta, FinishReason
from mlx_serve.protocol_responses import ResponsesRequest
from mlx_serve.replies import Choice, ReplyShape
from mlx_serve.responses_api import ResponseBuilder
from mlx_serve.responses_stream import _OutputItems
from tests.test_agentic import scripted_deltas, sdk, shape_for

EVENTS = TypeAdapter(ResponseStreamEvent)


def sdk_events(frames: list[bytes]) -> list:
    """Each SSE frame's data as the SDK's typed event (a wrong field fails validation)."""
    return [EVENTS.validate_json(block.split("data: ", 1)[1])
            for block in b"".join(frames).decode().split("\n\n") if block]


def test_reasoning_message_and_call_stream_in_the_order_of_the_final_response(
        agentic_tokenizer):
    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_1")
    items = _OutputItems(builder, shape_for(agentic_tokenizer))
    frames = [f for delta in scripted_deltas(agentic_tokenizer) for f in items.delta(delta)]
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)

    kinds: list[str] = []
    for e in events:  # runs of deltas as one entry
        if not (e.type.endswith(".delta") and kinds and kinds[-1] == e.type):
            kinds.append(e.type)
    assert kinds == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]

    output = final["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call"]
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    for stream_items in (added, done):  # the final Response's ids at its indexes
        assert sorted((e.output_index, e.item.id) for e in stream_items) == [
            (i, o["id"]) for i, o in enumerate(output)]
    assert all(e.output_index == 0 for e in events if "reasoning_text" in e.type)

    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Let me check." == output[0]["content"][0]["text"]
    assert next(e.item for e in done if e.output_index == 0).content[0].text == reasoning
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Sure. " == output[1]["content"][0]["text"]
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} and output[2]["arguments"] == arguments


def test_the_sdks_stream_helper_rebuilds_a_thinking_models_response(agentic_server):
    with sdk(agentic_server) as client, client.responses.stream(
            model="agentic", input="What is the weather?", max_output_tokens=12,
            temperature=0) as stream:
        events = list(stream)  # the helper checks each event against what came before
    final = events[-1].response  # at max_output_tokens: response.incomplete
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning  # the template opens the thinking span: the reply starts there
    first = final.output[0]
    assert first.type == "reasoning" and first.content[0].text == reasoning
    opened = next(e for e in events if e.type == "response.output_item.added")
    assert (opened.output_index, opened.item.id) == (0, first.id)
    # Cut off while reasoning: no message item, as OpenAI lists such a Response.
    assert [o.type for o in final.output] == ["reasoning"]
    assert not [e for e in events if e.type == "response.content_part.added"]
    assert 0 < final.usage.output_tokens_details.reasoning_tokens <= 12


def test_a_call_cut_off_at_max_output_tokens_is_an_incomplete_item(agentic_tokenizer):
    from mlx_lm.generate import make_text_state_machine

    from mlx_serve.generation import Delta, GenerationRequest, OutputOptions, SamplingParams
    from mlx_serve.runner.text import TextPipeline

    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=100),
                                output=OutputOptions(split_reasoning=True))
    pipe = TextPipeline(agentic_tokenizer.detokenizer, request,
                        make_text_state_machine(agentic_tokenizer))
    tokens = agentic_tokenizer.encode(text, add_special_tokens=False)
    pieces = [pipe.advance(t, "length" if i == len(tokens) - 1 else None)
              for i, t in enumerate(tokens)]
    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_1")
    items = _OutputItems(builder, shape_for(agentic_tokenizer))
    frames = [f for p in pieces for f in items.delta(
        Delta(p.content, 1, p.finish, 0, p.reasoning, p.tool_calls, tool_text=p.tool_text))]
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)
    assert final["status"] == "incomplete"
    call = final["output"][1]
    assert (call["type"], call["status"], call["arguments"]) == (
        "function_call", "incomplete", '{"city": "Par')
    done = next(e for e in events if e.type == "response.output_item.done"
                and e.item.type == "function_call")
    assert done.item.status == "incomplete"


def test_a_forced_call_is_the_whole_output(agentic_server):
    """tool_choice required: the Response lists the call alone, no empty message before
    it, streamed (no text events) or not."""
    tools = [{"type": "function", "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}]
    ask = {"model": "agentic", "input": "What is the weather?", "tools": tools,
           "tool_choice": "required", "max_output_tokens": 60, "temperature": 0}
    with sdk(agentic_server) as client:
        whole = client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            events = list(stream)
    final = events[-1].response
    for response in (whole, final):
        assert response.status == "completed", response
        assert [o.type for o in response.output] == ["function_call"]
        assert json.loads(response.output[0].arguments)["city"] in ("Paris", "Rome")
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0]
    assert not [e for e in events if "output_text" in e.type or "content_part" in e.type]


def _late_reasoning_deltas() -> list[Delta]:
    """Text, then reasoning (a model that thinks after it began to answer), then text,
    cut off by the length limit; markers and split characters write nothing."""
    return [Delta("Sure", 1), Delta("", 1),  # an opening marker
            Delta("", 1, reasoning="wait, "), Delta("", 1),  # part of a character
            Delta("", 1, reasoning="é"), Delta("", 1),  # a closing marker
            Delta(" then", 1, FinishReason.LENGTH)]


def test_reasoning_after_the_first_text_comes_after_the_message_in_stream_and_result():
    body = ResponsesRequest(model="m", input="x")
    builder = ResponseBuilder(body, "m", "resp_1")
    items = _OutputItems(builder, ReplyShape(chat=True, model="m", prompt_tokens=5))
    frames = [f for delta in _late_reasoning_deltas() for f in items.delta(delta)]
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)

    output = final["output"]
    assert [(o["type"], o["status"]) for o in output] == [
        ("message", "incomplete"), ("reasoning", "incomplete")]
    assert output[1]["content"][0]["text"] == "wait, é"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.id) for e in done] == [
        (i, o["id"]) for i, o in enumerate(output)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta"
                   ) == "wait, é"
    # A non-streamed Response lists the same items in the same order.
    choice = Choice(0)
    shape = ReplyShape(chat=True, model="m", prompt_tokens=5)
    for delta in _late_reasoning_deltas():
        shape.absorb(choice, delta)
    whole = ResponseBuilder(body, "m", "resp_2").response("incomplete", choice, 5)["output"]
    assert [(o["type"], o["status"]) for o in whole] == [
        ("message", "incomplete"), ("reasoning", "incomplete")]


def test_tokens_that_write_no_text_count_with_the_text_they_belong_to():
    shape = ReplyShape(chat=True, model="m", prompt_tokens=5)
    choice = Choice(0)
    # The opening marker and a split character's first byte count as reasoning (the next
    # text is), the closing marker as the answer's.
    for delta in [Delta("", 1), Delta("", 1, reasoning="a"), Delta("", 1),
                  Delta("", 1, reasoning="é"), Delta("", 1), Delta("Yes", 1)]:
        shape.absorb(choice, delta)
    assert (choice.tokens, choice.reasoning_tokens) == (6, 4)
    # A reply cut off inside its reasoning: every token was reasoning, the last one too.
    choice = Choice(0)
    for delta in [Delta("", 1), Delta("", 1, reasoning="a"), Delta("", 1),
                  Delta("", 1, finish_reason=FinishReason.LENGTH)]:
        shape.absorb(choice, delta)
    assert (choice.tokens, choice.reasoning_tokens) == (4, 4)
    item = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_3").response(
        "incomplete", choice, 5)["output"]
    assert [(o["type"], o["status"]) for o in item] == [("reasoning", "incomplete")]


def test_an_empty_reply_ends_with_the_text_part_its_stream_opened(agentic_tokenizer):
    # The reply's first token ends it. Before, the stream opened a text part and closed it,
    # while the final Response's message had no content, and a follow-up lost that turn.
    from mlx_serve.responses_store import output_as_items

    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_1")
    items = _OutputItems(builder, shape_for(agentic_tokenizer))
    frames = items.delta(Delta("", 1, FinishReason.STOP))
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)
    part_done = next(e for e in events if e.type == "response.content_part.done")
    item_done = next(e for e in events if e.type == "response.output_item.done")
    assert part_done.part.type == "output_text" and part_done.part.text == ""
    assert [p.text for p in item_done.item.content] == [""]
    (message,) = final["output"]
    assert message["id"] == item_done.item.id
    assert [p["text"] for p in message["content"]] == [""]
    assert [i["type"] for i in output_as_items(final)] == ["message"]


def test_a_reply_failing_before_any_text_lists_no_message_it_never_announced(
        agentic_tokenizer):
    from mlx_serve.errors import GenerationError

    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_1")
    items = _OutputItems(builder, shape_for(agentic_tokenizer))
    closing, final = items.closing(GenerationError("generation failed: boom"))
    (failed,) = sdk_events(closing)
    assert failed.type == "response.failed"
    assert final["output"] == []  # before: an empty message no event had announced


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("script, kinds", [
    ("first</think>" + CALL + "<think>second</think>",
     ["reasoning", "function_call", "reasoning"]),
    ("first</think>" + CALL + "<think>second</think>Done.",
     ["reasoning", "function_call", "message", "reasoning"]),
])
def test_reasoning_after_a_call_is_an_item_of_its_own_in_stream_and_result(
        agentic_tokenizer, script, kinds):
    """Before, reasoning written after a call went on in the first reasoning item after
    that item's done event, and the final Response listed its items in another order."""
    from tests.test_agentic import run_script

    deltas = [Delta(p.content, 1, p.finish, 0, p.reasoning, p.tool_calls,
                    tool_text=p.tool_text) for p in run_script(agentic_tokenizer, script)]
    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "resp_1")
    items = _OutputItems(builder, shape_for(agentic_tokenizer))
    frames = [f for delta in deltas for f in items.delta(delta)]
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)

    output = final["output"]
    assert [o["type"] for o in output] == kinds
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    added = {e.output_index: e.item.id for e in events
             if e.type == "response.output_item.added"}
    assert added == {i: o["id"] for i, o in enumerate(output)}
    assert {i: item.id for i, item in done.items()} == added
    closed: set[int] = set()
    for e in events:  # no item hears of more after its done event
        if e.type == "response.output_item.done":
            closed.add(e.output_index)
        elif e.type.endswith(".delta"):
            assert e.output_index not in closed, e
    reasoning = [o["content"][0]["text"] for o in output if o["type"] == "reasoning"]
    assert reasoning == ["first", "second"]
    assert done[0].content[0].text == "first"
