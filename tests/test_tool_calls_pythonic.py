"""Pythonic tool calls (``[look(q="x"), edit(path='y')]``), followed while written: the
streamed arguments are the JSON of what mlx-lm's parser makes of the whole span."""

from __future__ import annotations

import json
import random
import unicodedata

from mlx_lm.tool_parsers import pythonic

from mlx_serve.tool_calls import ToolCallStream, parse_tool_calls
from tests.test_tool_call_spans import check_updates, fuzzed, per_piece, streamed

STRING_PIECES = ["a", " ", "é", "\n", "\t", '"', "'", "\\", ",", ")", "(", "]", "[", "=",
                 "x=", "😀", "\x00", "}", "{"]


def python_string(rng: random.Random, text: str) -> str:
    """``text`` as a Python string literal: repr, JSON, hand-made escapes, or two
    literals side by side (which Python joins)."""
    kind = rng.randrange(5)
    if kind == 0:
        return repr(text)
    if kind == 1:
        return json.dumps(text, ensure_ascii=rng.random() < 0.5)
    if kind == 2:  # every character escaped some way Python reads
        escapes = [f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in text]
        return '"' + "".join(rng.choice([e, f"\\{ord(c):03o}" if ord(c) < 256 else e,
                                         f"\\N{{{unicodedata.name(c, '')}}}" if
                                         unicodedata.name(c, "") else e])
                             for c, e in zip(text, escapes, strict=True)) + '"'
    if kind == 3 and len(text) > 1:
        cut = rng.randrange(1, len(text))
        return repr(text[:cut]) + rng.choice(["", " ", "\n"]) + json.dumps(text[cut:])
    raw = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\x00": "\\0"}  # else as written
    return '"' + "".join(raw.get(c, c) for c in text) + '"'


def python_value(rng: random.Random, depth: int = 0) -> str:
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        text = "".join(rng.choice(STRING_PIECES) for _ in range(rng.randrange(8)))
        return python_string(rng, text)
    if kind == 1:
        return rng.choice(["5", "-2.5", "1e3", "0", "1_000", "0x1f", " 7 "])
    if kind == 2:
        return rng.choice(["True", "False", "None", "true", "false", "null"])
    if kind == 3:
        return rng.choice(["[]", "{}", "()"])
    if kind == 4:
        return "[" + ", ".join(python_value(rng, depth + 1)
                               for _ in range(rng.randrange(1, 4))) + "]"
    if kind == 5:
        return "(" + ", ".join(python_value(rng, depth + 1) for _ in range(2)) + ")"
    keys = rng.sample(["a", "b c", "é", "x,y"], rng.randrange(1, 3))
    return "{" + ", ".join(f"{python_string(rng, k)}: {python_value(rng, depth + 1)}"
                           for k in keys) + "}"


def pythonic_span(rng: random.Random) -> str:
    space = ["", " ", "\n"]
    calls = []
    for _ in range(rng.randrange(1, 4)):
        keys = rng.sample(["q", "path", "n", "é", "spec"], rng.randrange(0, 4))
        arguments = f",{rng.choice(space)}".join(
            f"{k}{rng.choice(['', ' '])}={rng.choice(['', ' '])}{python_value(rng)}"
            for k in keys)
        name = rng.choice(["look", "edit", "tools.find"])
        calls.append(f"{name}{rng.choice(['', ' '])}({rng.choice(space)}{arguments}"
                     f"{rng.choice(space)})")
    return f"[{f',{rng.choice(space)}'.join(calls)}]"


def test_pythonic_calls_stream_as_the_parsers_json_whatever_the_cuts():
    for text, expected, calls in fuzzed(pythonic, pythonic_span, seed=12):
        assert [c["function"]["arguments"] for c in calls] == [
            json.dumps(e["arguments"], ensure_ascii=False) for e in expected], text


def test_a_pythonic_string_streams_as_it_is_written():
    pieces = ['[look(q="wea', 'ther\\x4', '1", n=4', "2, tags=['a', ", "'b']), now(", ")]"]
    assert per_piece(pythonic, pieces) == [
        [(True, '{"q": "wea', False)], [(False, "ther", False)],
        [(False, 'A", "n": ', False)], [(False, '42, "tags": ', False)],
        [(False, '["a", "b"]}', True), (True, "{", False)], [(False, "}", True)]]


def test_two_literals_side_by_side_stream_as_one_string():
    pieces = ['[look(q="a" ', "'b'", ' "c")]']
    assert per_piece(pythonic, pieces) == [
        [(True, '{"q": "a', False)], [(False, "b", False)], [(False, 'c"}', True)]]


def test_a_positional_argument_is_left_out_of_the_stream():
    """The parser takes none of such a call's arguments whole (it falls back to reading
    keywords by pattern); the stream keeps the keyword ones, as valid JSON."""
    calls, updates = streamed(pythonic.parse_tool_call, '[look("x", q=1)]', random.Random(1))
    assert [c["function"]["arguments"] for c in calls] == ['{"q": 1}']
    check_updates(calls, updates)


def test_a_span_without_its_list_is_not_a_call():
    stream, calls = ToolCallStream(pythonic.parse_tool_call, None), []
    assert stream.update(calls, (), 'look(q="a")') == []
    assert stream.update(calls, ('look(q="a")',), "") == [] and calls == []


def test_values_json_cannot_hold_are_sent_as_json_can():
    """A set or bytes (valid Python literals) would make ``json.dumps`` raise."""
    text = "[look(s={2}, b=b'hi')]"
    (call,) = parse_tool_calls(pythonic.parse_tool_call, None, text)
    assert json.loads(call["function"]["arguments"]) == {"s": [2], "b": "hi"}
    calls, _ = streamed(pythonic.parse_tool_call, text, random.Random(2))
    assert calls[0]["function"]["arguments"] == call["function"]["arguments"]
