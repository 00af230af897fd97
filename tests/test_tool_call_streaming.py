"""Tool calls streamed as they are written: the call's id and name first, then its
arguments piece by piece, and the same call in a whole reply."""

from __future__ import annotations

import json
import logging
import random

import httpx
import pytest
from mlx_lm.tool_parsers import json_tools

from mlx_serve.generation import FinishReason
from mlx_serve.tool_calls import CallUpdate, ToolCallStream
from tests.server_process import ServerProcess
from tests.test_agentic import BOUNDED_TOOLS, chat, sdk


def stream_call(text: str, cuts: list[int], parser=json_tools.parse_tool_call
                ) -> tuple[list[dict], list[CallUpdate]]:
    """Feed one call's text as the runner reports it: open pieces ending at ``cuts``,
    then the whole span when the call completes."""
    stream, calls, updates = ToolCallStream(parser, None), [], []
    at = 0
    for cut in cuts:
        updates += stream.update(calls, (), text[at:cut])
        at = cut
    updates += stream.update(calls, (text,), "")
    return calls, updates


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return "".join(rng.choice('ab }{][",:\\\n\u00e9') for _ in range(rng.randrange(8)))
    if kind == 1:
        return rng.choice([0, -1.5, 12, True, False, None])
    if kind == 2:
        return rng.randrange(1000)
    if kind == 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_arguments_stream_exactly_as_written_whatever_their_content_and_cuts():
    rng = random.Random(7)
    for _ in range(300):
        arguments = {f"p{i}": random_value(rng) for i in range(rng.randrange(4))}
        raw = json.dumps(arguments, indent=rng.choice([None, 2]),
                         ensure_ascii=rng.random() < 0.5)
        text = (rng.choice(["", "\n", " "]) + '{"name": "tool_1", "arguments": ' + raw
                + rng.choice(["}", " }\n", ', "id": "x"}']))
        cuts = sorted(rng.sample(range(len(text)), min(len(text), rng.randrange(1, 12))))
        calls, updates = stream_call(text, cuts)
        (call,) = calls
        assert call["function"] == {"name": "tool_1", "arguments": raw}
        assert "".join(u.arguments for u in updates) == raw
        assert [u.opened for u in updates].count(True) == 1 and updates[0].opened
        assert updates[-1].done and not any(u.done for u in updates[:-1])
        assert json.loads(call["function"]["arguments"]) == arguments


def test_a_call_is_announced_once_its_name_is_written():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    stream, calls = ToolCallStream(json_tools.parse_tool_call, None), []
    assert stream.update(calls, (), '{"name": "get_wea') == [] and calls == []
    assert stream.update(calls, (), 'ther", "arguments": ') == []  # no value yet
    (opened,) = stream.update(calls, (), '{"ci')
    assert (opened.position, opened.opened, opened.arguments, opened.done) == (
        0, True, '{"ci', False)
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    (rest,) = stream.update(calls, (text,), "")
    assert (rest.opened, rest.arguments, rest.done) == (False, 'ty": "Paris"}', True)


def test_calls_in_a_row_each_get_their_own_position_and_id():
    stream, calls = ToolCallStream(json_tools.parse_tool_call, None), []
    one = '{"name": "a", "arguments": {"x": 1}}'
    two = '{"name": "b", "arguments": {"y": [2]}}'
    updates = stream.update(calls, (), one[:20])
    updates += stream.update(calls, (one,), two[:31])  # one ends, two begins in a step
    updates += stream.update(calls, (two,), "")
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]
    assert [(u.position, u.opened, u.done) for u in updates] == [
        (0, True, True), (1, True, False), (1, False, True)]
    assert [c["function"]["arguments"] for c in calls] == ['{"x": 1}', '{"y": [2]}']


@pytest.mark.parametrize("text", [
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # arguments first
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # a list of calls
])
def test_calls_in_another_shape_go_out_whole_once_complete(text):
    calls, updates = stream_call(text, list(range(1, len(text))))
    (update,) = updates
    assert (update.opened, update.done) == (True, True)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert update.arguments == calls[0]["function"]["arguments"]


def test_arguments_written_as_a_string_are_that_string():
    text = '{"name": "f", "arguments": "{\\"a\\": 1}"}'
    calls, updates = stream_call(text, [10, 30])
    assert calls[0]["function"]["arguments"] == '{"a": 1}' and len(updates) == 1


def test_a_call_cut_off_keeps_the_arguments_written_so_far(caplog):
    text = '{"name": "write_file", "arguments": {"path": "a.txt", "body": "hal'
    stream, calls = ToolCallStream(json_tools.parse_tool_call, None), []
    with caplog.at_level(logging.WARNING, logger="mlx_serve.tool_calls"):
        updates = stream.update(calls, (), text[:50]) + stream.update(calls, (text,), "")
    assert calls[0]["function"]["arguments"] == '{"path": "a.txt", "body": "hal'
    assert "".join(u.arguments for u in updates) == calls[0]["function"]["arguments"]
    assert "not valid JSON" in caplog.text
    assert stream.cut_off == {0}  # kept, but known to be incomplete
    whole = ToolCallStream(json_tools.parse_tool_call, None)
    whole.update([], (text + '"}}',), "")
    assert whole.cut_off == set()


def parse_city(text: str, tools=None) -> dict:
    """A parser from no mlx-lm module: a format that no scanner follows."""
    return {"name": "get_weather", "arguments": {"city": text.removeprefix("weather=")}}


def test_a_format_no_scanner_follows_is_parsed_whole_at_its_end():
    text = "weather=Paris"
    stream, calls = ToolCallStream(parse_city, None), []
    assert stream.update(calls, (), text[:10]) == []
    (update,) = stream.update(calls, (text,), "")
    assert (update.opened, update.done) == (True, True)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


# -- through the server --------------------------------------------------------------------

FORCED = {"type": "function", "function": {"name": "get_weather"}}


def streamed_forced_call(server, **body) -> tuple[list, str | None]:
    body = {"temperature": 1.0, "seed": 3, **body}
    with sdk(server) as client:
        chunks = list(client.chat.completions.create(
            model="agentic", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=BOUNDED_TOOLS, tool_choice=FORCED, stream=True, **body))
    deltas = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    return deltas, chunks[-1].choices[0].finish_reason


def test_a_streamed_call_is_the_whole_replys_call_written_piece_by_piece(agentic_server):
    whole = chat(agentic_server, tools=BOUNDED_TOOLS, tool_choice=FORCED, max_tokens=80,
                 temperature=1.0, seed=3, messages=[
                     {"role": "user", "content": "Weather in Paris?"}]).json()["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    deltas, finish = streamed_forced_call(agentic_server, max_tokens=80)
    assert finish == whole["finish_reason"] == "tool_calls"
    first, *rest = deltas
    assert (first.function.name, first.type) == ("get_weather", "function")
    assert len(rest) > 2 and all(d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in deltas) == call["function"]["arguments"]
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_the_sdks_stream_helper_rebuilds_the_call(agentic_server):
    with sdk(agentic_server) as client, client.chat.completions.stream(
            model="agentic", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=BOUNDED_TOOLS, tool_choice=FORCED, temperature=1.0, seed=3,
            max_tokens=80) as stream:
        pieces = [e.arguments_delta for e in stream
                  if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert len(pieces) > 2 and "".join(pieces) == call.function.arguments
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    # A reply that opens with its call: content null in the first chunk, as OpenAI's, so
    # the helper ends with the whole reply's None (before: "").
    whole = chat(agentic_server, tools=BOUNDED_TOOLS, tool_choice=FORCED, max_tokens=80,
                 temperature=1.0, seed=3, messages=[
                     {"role": "user", "content": "Weather in Paris?"}]).json()["choices"][0]
    assert whole["message"]["content"] is None
    assert final.choices[0].message.content is None


def test_a_call_cut_off_by_max_tokens_comes_back_as_far_as_it_was_written(agentic_server):
    # The whole call takes 44 tokens here; 36 end it inside its arguments.
    whole = chat(agentic_server, tools=BOUNDED_TOOLS, tool_choice=FORCED, max_tokens=36,
                 temperature=1.0, seed=3, messages=[
                     {"role": "user", "content": "Weather in Paris?"}]).json()["choices"][0]
    deltas, finish = streamed_forced_call(agentic_server, max_tokens=36)
    assert finish == whole["finish_reason"] == "length"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call["function"]["arguments"]
    assert call["function"]["arguments"].startswith('{"city"')
    with pytest.raises(ValueError):
        json.loads(call["function"]["arguments"])


@pytest.fixture(scope="module")
def slow_agentic_server(agentic_dir, tmp_path_factory: pytest.TempPathFactory):
    """Steps of at least 110 ms for user "slow", pings after 100 ms of quiet; for user
    "faulty" the 33rd and 38th steps fail (a forced call's head takes about 30 tokens)."""
    log = tmp_path_factory.mktemp("slow-agentic") / "server.log"
    spec = ("engine.step[user=slow]=sleep(110);engine.step[user=faulty]=32*off"
            "->1*raise(RuntimeError:in the call)->4*off->1*raise(RuntimeError:again)->off")
    with ServerProcess(agentic_dir, log, env={"MLX_SERVE_FAILPOINTS": spec},
                       args=["--sse-ping-seconds", "0.1"]) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_stream_quiet_while_a_call_begins_is_kept_alive(slow_agentic_server, path):
    # A forced call's first tokens write its head, '{"name": ...', which sends nothing
    # until the name is complete: steps that add nothing to send.
    body = {"tools": BOUNDED_TOOLS, "tool_choice": FORCED, "max_tokens": 34,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    if path == "/v1/responses":
        body = {"input": "Weather in Paris?", "max_output_tokens": 34,
                "tools": [{"type": "function", **BOUNDED_TOOLS[0]["function"]}],
                "tool_choice": {"type": "function", "name": "get_weather"}}
    with httpx.stream("POST", slow_agentic_server.base_url + path, timeout=60, json={
            **body, "stream": True, "user": "slow", "temperature": 0}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200
    chat = path == "/v1/chat/completions"
    # From the first event of the output (chat's role chunk; Responses' in_progress comes
    # before it) to the call's first chunk: about 30 quiet steps of >= 110 ms each.
    start = next(i for i, line in enumerate(lines) if line.startswith(
        "data:" if chat else "event: response.in_progress"))
    call = next(i for i, line in enumerate(lines) if line.startswith(
        "data:") and '"tool_calls"' in line or line == "event: response.output_item.added")
    assert lines[start:call].count(": ping") >= 5, lines


def test_steps_failing_while_a_call_is_written_change_nothing_in_it(slow_agentic_server):
    server = slow_agentic_server
    before = httpx.get(server.base_url + "/health", timeout=5).json()["recoveries"]
    reference, _ = streamed_forced_call(server, max_tokens=80, temperature=0)
    replayed, finish = streamed_forced_call(server, max_tokens=80, temperature=0,
                                            user="faulty")
    assert httpx.get(server.base_url + "/health", timeout=5).json()["recoveries"] == before + 2
    assert finish == "tool_calls"
    assert [(d.index, d.function.name) for d in replayed if d.function.name] == [
        (0, "get_weather")]
    assert "".join(d.function.arguments for d in replayed) == "".join(
        d.function.arguments for d in reference)


# -- parallel_tool_calls false: one call at most -------------------------------------------

TWO_CALLS = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call> and more text')


def pipeline_pieces(tokenizer, text: str, one_tool_call: bool):
    from mlx_lm.generate import make_text_state_machine

    from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
    from mlx_serve.runner.text import TextPipeline

    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=200), output=OutputOptions(
        split_reasoning=True, one_tool_call=one_tool_call))
    pipe = TextPipeline(tokenizer.detokenizer, request, make_text_state_machine(tokenizer))
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        pieces.append(pipe.advance(token, None))
        if pieces[-1].finish is not None:
            break
    return pieces


def test_with_one_call_allowed_the_reply_ends_where_the_first_call_does(agentic_tokenizer):
    many = pipeline_pieces(agentic_tokenizer, TWO_CALLS, one_tool_call=False)
    one = pipeline_pieces(agentic_tokenizer, TWO_CALLS, one_tool_call=True)
    assert [c for p in many for c in p.tool_calls] == [
        '{"name": "a", "arguments": {"x": 1}}', '{"name": "b", "arguments": {"y": 2}}']
    assert many[-1].finish is None and "more text" in "".join(p.content for p in many)
    assert [c for p in one for c in p.tool_calls] == ['{"name": "a", "arguments": {"x": 1}}']
    assert one[-1].finish is FinishReason.STOP and len(one) < len(many) // 2
    assert "".join(p.content for p in one) == ""


def test_with_one_call_allowed_a_span_of_several_calls_keeps_its_first():
    text = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    for one_call, names in ((False, ["a", "b"]), (True, ["a"])):
        stream, calls = ToolCallStream(json_tools.parse_tool_call, None, one_call), []
        stream.update(calls, (text,), "")
        assert [c["function"]["name"] for c in calls] == names


def test_parallel_tool_calls_is_taken_and_echoed(agentic_server):
    reply = chat(agentic_server, tools=BOUNDED_TOOLS, parallel_tool_calls=False)
    assert reply.status_code == 200, reply.text
    with sdk(agentic_server) as client:
        for value in (False, True):
            response = client.responses.create(
                model="agentic", input="hi", max_output_tokens=2, parallel_tool_calls=value,
                tools=[{"type": "function", **BOUNDED_TOOLS[0]["function"]}])
            assert response.parallel_tool_calls is value


def test_a_call_cut_off_by_a_stop_string_ends_with_stop_not_tool_calls(agentic_server):
    body = {"tools": BOUNDED_TOOLS, "tool_choice": FORCED, "max_tokens": 80, "stop": ["city"],
            "temperature": 0, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    whole = chat(agentic_server, **body).json()["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    assert whole["finish_reason"] == "stop"  # its call was cut off: nothing to run
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"')
    deltas, finish = streamed_forced_call(agentic_server, max_tokens=80, stop=["city"],
                                          temperature=0)
    assert finish == "stop"
    assert "".join(d.function.arguments for d in deltas) == '{"'
