"""Spans holding several calls, followed while written: MiniMax-M2's ``<invoke>``s,
Kimi-K2's ``<|tool_call_begin|>`` sections, Kimi K3's XTML ``<|open|>call``s, Mistral's
``NAME[ARGS]{...}``s, Gemma 4's ``call:NAME{...}``s and a pythonic list of calls. Each
call is announced once, in order, and its streamed arguments are what mlx-lm's parser
makes of the whole span."""

from __future__ import annotations

import json
import random

import pytest
from mlx_lm.tool_parsers import (
    function_gemma,
    gemma4,
    kimi_k2,
    kimi_k3,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
)

from mlx_serve.tool_calls import ToolCallStream
from tests.test_tool_calls_xml import fed_in_pieces

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "count": {"type": "integer"},
        "ratio": {"type": "number"}, "force": {"type": "boolean"},
        "spec": {"type": "object"}, "items": {"type": "array"},
        "maybe": {"type": ["string", "null"]}, "mode": {"enum": ["a", "b"]}}}}},
    {"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
PIECES = ["a", "b", " ", "\n", "<", ">", "/", "</param", '"', "\\", "é", "{", "null",
          "NULL", "parameter>", "x\n", "\t", "none", "</invoke"]


ARGUMENTS = [{}, {"q": "x</y>"}, {"path": "a b", "n": [1, {"c": None}]},
             {"s": "<|tool_call_end"}, {"t": "é\\n\"}"}, {"u": "b[ARGS]{"}]


def minimax_value(rng: random.Random, name: str) -> str:
    if name == "count":
        return rng.choice([str(rng.randrange(-50, 1000)), "7.0", "many"])
    if name == "ratio":
        return rng.choice(["0.5", "3", "-2.25", "1e3", "x"])
    if name == "force":
        return rng.choice(["true", "False", "yes", "off", "maybe"])
    if name == "maybe":  # typed string or null: the parser reads these three as null
        return rng.choice(["none", "nil", "None", "null", "nils", "text"])
    if name in ("spec", "items"):
        return json.dumps(rng.choice([{"a": [1, "</x>"]}, [1, 2, {"b": None}], "text", 7]))
    text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 12)))
    if "</parameter>" in text or "</invoke>" in text or rng.random() < 0.1:
        return rng.choice(["null", "Null", "nul", "nullable", "", "  "])
    return text


def minimax_span(rng: random.Random) -> str:
    parts = [rng.choice(["", "\n"])]
    for _ in range(rng.randrange(1, 4)):
        function = rng.choice(["edit", "look", "other"])
        quote = rng.choice(['"', "'", ""])
        parts.append(f"<invoke name={quote}{function}{quote}>{rng.choice(['', chr(10)])}")
        names = rng.sample(["path", "count", "ratio", "force", "spec", "items", "maybe",
                            "mode", "q", "extra"], rng.randrange(0, 5))
        for name in names:
            parts.append(f'<parameter name="{name}">{rng.choice(["", chr(10), "  "])}'
                         f"{minimax_value(rng, name)}{rng.choice(['', chr(10)])}"
                         f"</parameter>{rng.choice(['', chr(10)])}")
        parts.append("</invoke>" + rng.choice(["", "\n"]))
    return "".join(parts)


def kimi_span(rng: random.Random) -> str:
    parts = [rng.choice(["", "\n"])]
    for i in range(rng.randrange(1, 4)):
        name = rng.choice(["edit", "look", "a.b"])
        prefix = rng.choice(["functions.", ""])
        arguments = rng.choice(ARGUMENTS)
        text = json.dumps(arguments, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]))
        parts.append(f"<|tool_call_begin|>{rng.choice(['', ' '])}{prefix}{name}:{i}"
                     f"{rng.choice(['', chr(10)])}<|tool_call_argument_begin|>"
                     f"{rng.choice(['', ' ', chr(10)])}{text}{rng.choice(['', ' ', chr(10)])}"
                     f"<|tool_call_end|>{rng.choice(['', chr(10)])}")
    return "".join(parts)


def mistral_span(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randrange(1, 4)):
        text = json.dumps(rng.choice(ARGUMENTS), ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]))
        parts.append(f"{rng.choice(['edit', 'look', 'get-x'])}{rng.choice(['', ' '])}[ARGS]"
                     f"{rng.choice(['', ' '])}{text}{rng.choice(['', ' ', chr(10)])}")
    return "".join(parts)


def gemma_value(rng: random.Random, depth: int = 0) -> str:
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        text = "".join(rng.choice(["a", " ", "{", "}", ",", "x:", '"', "\\", "é", "\n", "<",
                                   "<|", "[", "]"]) for _ in range(rng.randrange(6)))
        return f'<|"|>{text}<|"|>'
    if kind == 1:
        return rng.choice(["5", "-2.5", "1e3", "0"])
    if kind == 2:
        return rng.choice(["true", "false", "null"])
    if kind == 3:
        return "[]"
    if kind == 4:
        return "[" + ",".join(gemma_value(rng, depth + 1) for _ in range(rng.randrange(1, 4))) + "]"
    return gemma_object(rng, depth + 1)


def gemma_object(rng: random.Random, depth: int = 0) -> str:
    keys = rng.sample(["a", "b2", "path", "é", "x_y"], rng.randrange(0, 4))
    return "{" + ",".join(f"{k}:{gemma_value(rng, depth)}" for k in keys) + "}"


def gemma_span(rng: random.Random) -> str:
    return "".join(f"{rng.choice(['', chr(10)])}call:{rng.choice(['look', 'edit', 'a-b'])}"
                   f"{gemma_object(rng)}" for _ in range(rng.randrange(1, 4)))


XTML_PIECES = ["a", " ", "\n", "<|", "<|close|>arg", "<|close|>", '"', "\\", "é", "{", "}",
               "sep|>", "1"]


def xtml_argument(rng: random.Random, key: str) -> str:
    kind = rng.choice(["string", "number", "object", "boolean", None])
    if kind in ("string", None):
        value = "".join(rng.choice(XTML_PIECES) for _ in range(rng.randrange(8)))
    elif kind == "number":
        value = rng.choice(["5", "-2.5", " 7 ", "x", ""])
    elif kind == "boolean":
        value = rng.choice(["true", "false", "yes"])
    else:
        value = rng.choice([json.dumps(rng.choice(ARGUMENTS)), "{a", "[1, 2]"])
    typed = f' type="{kind}"' if kind else ""
    return f'<|open|>argument key="{key}"{typed}<|sep|>{value}<|close|>argument<|sep|>'


def xtml_span(rng: random.Random) -> str:
    space = ["", "\n", "  "]
    parts = [rng.choice(space)]
    for i in range(rng.randrange(1, 4)):
        name = rng.choice(["look", "edit", "say&quot;hi"])
        parts.append(f'<|open|>call tool="{name}" index="{i}"<|sep|>{rng.choice(space)}')
        if rng.random() < 0.3:
            block = json.dumps(rng.choice(ARGUMENTS), indent=rng.choice([None, 2]))
            parts.append(f'<|open|>json type="object"<|sep|>{rng.choice(space)}{block}'
                         f"{rng.choice(space)}<|close|>json<|sep|>{rng.choice(space)}")
        else:
            for key in rng.sample(["q", "path", "n", "é", "x y"], rng.randrange(4)):
                parts.append(xtml_argument(rng, key) + rng.choice(space))
        parts.append("<|close|>call<|sep|>" + rng.choice(space))
    return "".join(parts)


def streamed(parser, text: str, rng: random.Random):
    """Feed a span in random pieces, then complete it: the calls and every update."""
    stream, calls, updates = fed_in_pieces(parser, TOOLS, text, rng, most=16)
    assert stream.cut_off == set()
    return calls, updates


def per_piece(parser, pieces: list[str]) -> list[list[tuple[bool, str, bool]]]:
    """Each piece's updates of an open span: (opened, argument text, done)."""
    stream, calls = ToolCallStream(parser.parse_tool_call, TOOLS), []
    return [[(u.opened, u.arguments, u.done) for u in stream.update(calls, (), p)]
            for p in pieces]


def check_updates(calls: list[dict], updates) -> None:
    """Each call opened once and done once, in order; its pieces join into its arguments."""
    assert [u.position for u in updates if u.opened] == list(range(len(calls)))
    assert [u.position for u in updates if u.done] == list(range(len(calls)))
    for position, call in enumerate(calls):
        mine = [u for u in updates if u.position == position]
        assert mine[0].opened and mine[-1].done
        assert "".join(u.arguments for u in mine) == call["function"]["arguments"]


def as_list(parsed) -> list[dict]:
    return parsed if isinstance(parsed, list) else [parsed]


def fuzzed(parser, make_span, seed: int):
    """400 random spans, each streamed in random pieces and checked for its calls' names
    and updates: yields the span, the parser's calls and the streamed ones."""
    rng = random.Random(seed)
    for _ in range(400):
        text = make_span(rng)
        expected = as_list(parser.parse_tool_call(text, TOOLS))
        calls, updates = streamed(parser.parse_tool_call, text, rng)
        assert [c["function"]["name"] for c in calls] == [e["name"] for e in expected], text
        check_updates(calls, updates)
        yield text, expected, calls


def test_minimax_calls_stream_as_the_parsers_json_whatever_the_cuts():
    for text, expected, calls in fuzzed(minimax_m2, minimax_span, seed=5):
        assert [c["function"]["arguments"] for c in calls] == [
            json.dumps(e["arguments"], ensure_ascii=False) for e in expected], text


@pytest.mark.parametrize("parser, make_span, seed", [
    (kimi_k2, kimi_span, 6), (mistral, mistral_span, 7), (gemma4, gemma_span, 8)],
    ids=["kimi_k2", "mistral", "gemma4"])
def test_json_arguments_stream_whatever_the_cuts(parser, make_span, seed):
    """Kimi-K2's and Mistral's arguments go out as written, Gemma's as the JSON its
    parser makes of them: either way they read as the parser's arguments."""
    for text, expected, calls in fuzzed(parser, make_span, seed):
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            e["arguments"] for e in expected], text
        # The model's own id where it writes one (Kimi's functions.NAME:N).
        assert all(e.get("id", c["id"]) == c["id"] for c, e in zip(calls, expected, strict=True))
        assert all(c["function"]["arguments"] == c["function"]["arguments"].strip()
                   for c in calls)  # no space around them


def test_kimi_k3_calls_stream_as_the_parsers_arguments_whatever_the_cuts():
    for text, expected, calls in fuzzed(kimi_k3, xtml_span, seed=9):
        for call, e in zip(calls, expected, strict=True):
            arguments = call["function"]["arguments"]
            assert json.loads(arguments) == e["arguments"], text
            if "<|open|>json" not in text:  # argument by argument: the parser's JSON
                assert arguments == json.dumps(e["arguments"], ensure_ascii=False), text


def test_a_kimi_k3_string_streams_as_it_is_written():
    pieces = ['<|open|>call tool="look"<|sep|><|open|>argument key="q" type="string"<|sep|>we',
              "ather<|close|>arg", 'ument<|sep|><|open|>argument key="n" type="number"<|sep|>4',
              "2<|close|>argument<|sep|><|close|>call<|sep|>"]
    assert per_piece(kimi_k3, pieces) == [
        [(True, '{"q": "we', False)], [(False, "ather", False)],
        [(False, '", "n": ', False)], [(False, "42}", True)]]


def test_a_gemma_string_streams_as_it_is_written():
    pieces = ['call:look{q:<|"|>wea', 'ther, {x:<|', '"|>,n:{', 'deep:1}}']
    assert per_piece(gemma4, pieces) == [
        [(True, '{"q":"wea', False)], [(False, "ther, {x:", False)],
        [(False, '","n":{', False)], [(False, '"deep":1}}', True)]]


def test_a_mistral_call_is_done_where_its_json_ends():
    stream, calls = ToolCallStream(mistral.parse_tool_call, TOOLS), []
    first = stream.update(calls, (), 'look[ARGS]{"q": {"a": "}"}}look[AR')
    assert [(u.position, u.opened, u.arguments, u.done) for u in first] == [
        (0, True, '{"q": {"a": "}"}}', True)]
    second = stream.update(calls, (), 'GS]{"q"')
    assert [(u.position, u.opened, u.arguments) for u in second] == [(1, True, '{"q"')]


def test_a_call_is_done_at_its_own_end_before_the_next_is_written():
    stream, calls = ToolCallStream(minimax_m2.parse_tool_call, TOOLS), []
    first = stream.update(calls, (), '\n<invoke name="look">\n<parameter name="q">wea')
    assert [(u.position, u.opened, u.arguments, u.done) for u in first] == [
        (0, True, '{"q": "wea', False)]
    ended = stream.update(calls, (), 'ther</parameter>\n</invoke>\n<invoke name="ed')
    assert [(u.position, u.arguments, u.done) for u in ended] == [(0, 'ther"}', True)]
    second = stream.update(calls, (), 'it">')
    assert [(u.position, u.opened, u.arguments) for u in second] == [(1, True, "{")]
    assert [c["function"]["name"] for c in calls] == ["look", "edit"]


def test_a_span_cut_off_inside_its_second_call_keeps_both_and_marks_the_second():
    text = '<|tool_call_begin|>functions.look:0<|tool_call_argument_begin|>{"q": "a"}' \
           '<|tool_call_end|><|tool_call_begin|>functions.edit:1<|tool_call_argument_begin|>' \
           '{"path": "x'
    stream, calls = ToolCallStream(kimi_k2.parse_tool_call, TOOLS), []
    stream.update(calls, (), text[:40])
    stream.update(calls, (text,), "")
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [
        ("functions.look:0", '{"q": "a"}'), ("functions.edit:1", '{"path": "x')]
    assert stream.cut_off == {1}


def test_with_one_call_allowed_a_span_keeps_its_first():
    text = '<invoke name="look"><parameter name="q">a</parameter></invoke>' \
           '<invoke name="edit"><parameter name="path">b</parameter></invoke>'
    stream, calls = ToolCallStream(minimax_m2.parse_tool_call, TOOLS, one_call=True), []
    updates = stream.update(calls, (), text[:70]) + stream.update(calls, (text,), "")
    assert [c["function"] for c in calls] == [{"name": "look", "arguments": '{"q": "a"}'}]
    assert {u.position for u in updates} == {0}


def test_a_kimi_span_without_sections_is_parsed_whole():
    text = 'functions.look:0<|tool_call_argument_begin|>{"q": "a"}'
    stream, calls = ToolCallStream(kimi_k2.parse_tool_call, TOOLS), []
    assert stream.update(calls, (), text) == []
    (update,) = stream.update(calls, (text,), "")
    assert (update.opened, update.done) == (True, True)
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [
        ("functions.look:0", '{"q": "a"}')]


# -- through a reply: markers that are special tokens, a span with no end of its own ------

FORMATS = {  # the parser, its markers (added as special tokens), a span with two calls
    "mistral": (mistral, ["[TOOL_CALLS]", "[ARGS]"],
                '[TOOL_CALLS]look[ARGS]{"q": "a"}edit[ARGS]{"path": "b c"}'),
    "kimi_k2": (kimi_k2, ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                          "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                          "<|tool_call_end|>"],
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.look:0"
                '<|tool_call_argument_begin|>{"q": "a"}<|tool_call_end|><|tool_call_begin|>'
                'functions.edit:1<|tool_call_argument_begin|>{"path": "b c"}<|tool_call_end|>'
                "<|tool_calls_section_end|>"),
    "gemma4": (gemma4, ["<|tool_call>", "<tool_call|>", '<|"|>'],
               '<|tool_call>call:look{q:<|"|>a<|"|>}call:edit{path:<|"|>b c<|"|>}<tool_call|>'),
    "kimi_k3": (kimi_k3, ["<|open|>", "<|close|>", "<|sep|>"],
                '<|open|>tools<|sep|><|open|>call tool="look"<|sep|><|open|>argument key="q"'
                ' type="string"<|sep|>a<|close|>argument<|sep|><|close|>call<|sep|>'
                '<|open|>call tool="edit"<|sep|><|open|>json type="object"<|sep|>'
                '{"path": "b c"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'),
    "minimax_m2": (minimax_m2, ["<minimax:tool_call>", "</minimax:tool_call>"],
                   '<minimax:tool_call>\n<invoke name="look">\n<parameter name="q">a'
                   '</parameter>\n</invoke>\n<invoke name="edit">\n<parameter name="path">'
                   "b c</parameter>\n</invoke>\n</minimax:tool_call>"),
    "function_gemma": (function_gemma, ["<start_function_call>", "<end_function_call>",
                                        "<escape>"],  # a span a call
                       "<start_function_call>call:look{q:<escape>a<escape>}<end_function_call>"
                       "<start_function_call>call:edit{path:<escape>b c<escape>}"
                       "<end_function_call>"),
    "minicpm5": (minicpm5, ["<function name=", "</function>"],  # a span a call
                 '<function name="look"><param name="q">a</param></function>'
                 '<function name="edit"><param name="path"><![CDATA[b c]]></param></function>'),
    "muse_spark": (muse_spark, ["<atem:function_calls>", "</atem:function_calls>"],
                   '<atem:function_calls><atem:invoke name="look"><atem:parameter name="q">a'
                   '</atem:parameter></atem:invoke><atem:invoke name="edit"><atem:parameter '
                   'name="path">b c</atem:parameter></atem:invoke></atem:function_calls>'),
    "pythonic": (pythonic, ["<|tool_call_start|>", "<|tool_call_end|>"],
                 '<|tool_call_start|>[look(q="a"), edit(path=\'b c\')]<|tool_call_end|>'),
}


def format_tokenizer(tiny_model_dir, folder, name: str):
    """The tiny model's tokenizer, with this format's parser and its markers as special
    tokens (as they are in the models that use them)."""
    import shutil

    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer

    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, folder / file)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(FORMATS[name][1])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tool_parser_type"] = name
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


def format_deltas(tiny_model_dir, folder, name: str):
    """A reply "Sure." then the format's span of two calls, as the runner's text pipeline
    turns its tokens into deltas (then an end-of-sequence token); and its tokenizer."""
    from mlx_lm.generate import make_text_state_machine

    from mlx_serve.generation import Delta, GenerationRequest, OutputOptions, SamplingParams
    from mlx_serve.runner.special_tokens import SpecialTokens
    from mlx_serve.runner.text import TextPipeline

    tokenizer = format_tokenizer(tiny_model_dir, folder, name)
    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=500),
                                output=OutputOptions(split_reasoning=True))
    special = SpecialTokens(tokenizer, frozenset(tokenizer.eos_token_ids))
    pipe = TextPipeline(tokenizer.detokenizer, request, make_text_state_machine(tokenizer),
                        special)
    tokens = tokenizer.encode("Sure." + FORMATS[name][2], add_special_tokens=False)
    deltas = []
    for token, finish in [(t, None) for t in tokens] + [(min(tokenizer.eos_token_ids), "stop")]:
        piece = pipe.advance(token, finish)
        deltas.append(Delta(piece.content, 1, piece.finish, 0, piece.reasoning,
                            piece.tool_calls, tool_text=piece.tool_text))
    return deltas, tokenizer


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_reply_streams_each_call_of_a_span_as_it_is_written(tiny_model_dir, tmp_path, name):
    from openai.types.chat import ChatCompletionChunk

    from mlx_serve.replies import Choice, ReplyShape

    deltas, tokenizer = format_deltas(tiny_model_dir, tmp_path, name)
    shape = ReplyShape(chat=True, model="m", prompt_tokens=1,
                       tool_parser=tokenizer.tool_parser, tools=TOOLS)
    choice, chunks = Choice(0), []
    for delta in deltas:
        chunk = shape.delta_chunk(choice, delta, shape.absorb(choice, delta))
        if chunk is not None:
            chunks.append(ChatCompletionChunk.model_validate_json(chunk))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in calls if d.function.name] == [
        (0, "look"), (1, "edit")]
    assert len(calls) > 2  # announced, then their arguments in pieces
    joined = ["".join(d.function.arguments for d in calls if d.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in joined] == [{"q": "a"}, {"path": "b c"}]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [c["function"]["arguments"] for c in choice.tool_calls] == joined  # a whole reply


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_response_streams_each_call_as_its_own_item(tiny_model_dir, tmp_path, name):
    from mlx_serve.protocol_responses import ResponsesRequest
    from mlx_serve.replies import ReplyShape
    from mlx_serve.responses_api import ResponseBuilder
    from mlx_serve.responses_stream import _OutputItems
    from tests.test_responses_stream import sdk_events

    deltas, tokenizer = format_deltas(tiny_model_dir, tmp_path, name)
    shape = ReplyShape(chat=True, model="m", prompt_tokens=1,
                       tool_parser=tokenizer.tool_parser, tools=TOOLS)
    items = _OutputItems(ResponseBuilder(ResponsesRequest(model="m", input="x"), "m", "r"),
                         shape)
    frames = [f for delta in deltas for f in items.delta(delta)]
    closing, final = items.closing(None)
    events = sdk_events(frames + closing)
    output = final["output"]
    assert [(o["type"], o.get("name"), o["status"]) for o in output] == [
        ("message", None, "completed"), ("function_call", "look", "completed"),
        ("function_call", "edit", "completed")]
    opened = [(e.type, e.output_index) for e in events if e.type.startswith(
        "response.output_item")]
    # The first call is done before the second opens; each at the final Response's index.
    assert opened.index(("response.output_item.done", 1)) < opened.index(
        ("response.output_item.added", 2))
    for index in (1, 2):
        pieces = "".join(e.delta for e in events if e.type.endswith("arguments.delta")
                         and e.output_index == index)
        assert pieces == output[index]["arguments"]
