"""Calls in the qwen3_coder XML format followed while written: the streamed arguments are
exactly the JSON text of what mlx-lm's parser makes of the whole call."""

from __future__ import annotations

import json
import random
import re

import pytest
from mlx_lm.tool_parsers import glm47, longcat, qwen3_coder

from mlx_serve.tool_calls import ToolCallStream
from mlx_serve.tool_calls_xml import XmlCallScanner

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "count": {"type": "integer"},
        "ratio": {"type": "number"}, "force": {"type": "boolean"},
        "spec": {"type": "object"}, "items": {"type": "array"}, "any": {}}}}}]
PIECES = ["a", "b", " ", "\n", "<", ">", "/", "</param", '"', "\\", "é", "{", "null",
          "NULL", "</parameter", "parameter>", "x\n", "\t"]


def value_for(rng: random.Random, name: str) -> str:
    if name == "count":
        return str(rng.randrange(-50, 1000))
    if name == "ratio":
        return rng.choice(["0.5", "3", "-2.25", "1e3"])
    if name == "force":
        return rng.choice(["true", "false", "True"])
    if name in ("spec", "items", "any"):
        return json.dumps(rng.choice([{"a": [1, "</x>"]}, [1, 2, {"b": None}], "text", 7]))
    text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 12)))
    if "</parameter>" in text or rng.random() < 0.1:
        return rng.choice(["null", "Null", "nul", "nullable", ""])
    return text


def random_call(rng: random.Random) -> str:
    names = rng.sample(["path", "count", "ratio", "force", "spec", "items", "any", "extra"],
                       rng.randrange(0, 5))
    parts = [rng.choice(["", "\n"]), "<function=edit>\n"]
    for name in names:
        parts.append(f"<parameter={name}>{rng.choice(['', chr(10)])}{value_for(rng, name)}"
                     f"{rng.choice(['', chr(10)])}</parameter>\n")
    parts.append("</function>\n")
    return "".join(parts)


def fed_in_pieces(parser, tools, text: str, rng: random.Random, most: int):
    """Feed a span cut at fewer than ``most`` random places, then complete it: the
    stream, its calls and every update."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(most))))
    stream, calls, updates, at = ToolCallStream(parser, tools), [], [], 0
    for cut in cuts:
        updates += stream.update(calls, (), text[at:cut])
        at = cut
    updates += stream.update(calls, (text,), "")
    return stream, calls, updates


def check_against_the_parser(parser, tools, make_call, seed: int) -> None:
    """Random calls fed in random pieces: the streamed arguments must be exactly the JSON
    of the parser's arguments for the whole call, announced once, done at the end."""
    rng = random.Random(seed)
    for _ in range(400):
        text = make_call(rng)
        expected = json.dumps(parser(text, tools)["arguments"], ensure_ascii=False)
        stream, calls, updates = fed_in_pieces(parser, tools, text, rng, most=12)
        (call,) = calls
        assert call["function"] == {"name": "edit", "arguments": expected}, text
        assert "".join(u.arguments for u in updates) == expected
        assert [u.opened for u in updates].count(True) == 1 and updates[-1].done
        assert stream.cut_off == set()


def test_streamed_arguments_are_the_parsers_json_whatever_the_cuts():
    check_against_the_parser(qwen3_coder.parse_tool_call, TOOLS, random_call, seed=11)


def test_a_string_goes_out_as_it_is_written():
    scanner = XmlCallScanner(qwen3_coder.parse_tool_call, TOOLS)
    assert scanner.feed("<function=edi") == "" and scanner.name is None
    assert scanner.feed("t>\n<parameter=path>\n") == '{"path": '
    assert scanner.feed("src/ma") == '"src/ma'  # no longer a prefix of "null"
    assert scanner.feed("in.py\n</param") == "in.py"  # the end may be the closing tag
    assert scanner.feed("eter>\n") == '"'
    assert scanner.feed("<parameter=count>\n4") == ', "count": '  # a number: whole
    assert scanner.feed("2\n</parameter>\n</function>") == "42}"
    assert scanner.ended


def test_a_call_cut_off_mid_string_keeps_what_was_sent():
    text = "<function=edit>\n<parameter=path>\nsrc/main.py is long"
    stream, calls = ToolCallStream(qwen3_coder.parse_tool_call, TOOLS), []
    updates = stream.update(calls, (), text[:40]) + stream.update(calls, (text,), "")
    assert calls[0]["function"]["arguments"] == '{"path": "src/main.py is long'
    assert "".join(u.arguments for u in updates) == calls[0]["function"]["arguments"]
    assert stream.cut_off == {0}


# -- GLM-4.5-4.7's format (glm47): <arg_key>/<arg_value> pairs, no closing tag ------------

GLM_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "count": {"type": "integer"},
        "spec": {"type": "object"}, "flag": {"type": "boolean"}}}}}]
GLM_PIECES = ["a", " ", "\n", "<", ">", "/", "</arg_val", '"', "\\", "é", "{", "  x", "\t"]


def glm_value(rng: random.Random, name: str) -> str:
    if name == "count":
        return rng.choice(["3", " 42 ", "-7", "1.5", "x"])
    if name == "spec":
        return rng.choice(['{"a": [1, 2]}', "[1, 'two']", "not json", " {} "])
    if name == "flag":
        return rng.choice(["true", "True", "false", "null"])
    if rng.random() < 0.2:  # text that reads as a value unless the schema says string
        return rng.choice(["12", "true", "[1]", "'q'", " 7 "])
    return "".join(rng.choice(GLM_PIECES) for _ in range(rng.randrange(0, 12)))


def random_glm_call(rng: random.Random) -> str:
    names = rng.sample(["path", "count", "spec", "flag", "extra"], rng.randrange(1, 5))
    parts = ["edit", rng.choice(["\n", " ", ""])]
    for name in names:
        value = glm_value(rng, name).replace("</arg_value>", "")
        parts.append(f"<arg_key>{name}</arg_key>{rng.choice(['', chr(10), ' '])}"
                     f"<arg_value>{value}</arg_value>{rng.choice(['', chr(10)])}")
    return "".join(parts)


# The parsers' ast.literal_eval warns about the backslashes of random text.
@pytest.mark.filterwarnings("ignore:invalid escape sequence")
def test_glm_arguments_stream_as_the_parsers_json_whatever_the_cuts():
    check_against_the_parser(glm47.parse_tool_call, GLM_TOOLS, random_glm_call, seed=5)


def random_longcat_call(rng: random.Random) -> str:
    """A GLM call in LongCat-Flash's tags (mlx-lm's ``longcat``)."""
    call = re.sub(r"<(/?)arg_(key|value)>", r"<\1longcat_arg_\2>", random_glm_call(rng))
    return call.replace("</arg_val", "</longcat_arg_val")  # a value's pieces like its end


# The parsers' ast.literal_eval warns about the backslashes of random text.
@pytest.mark.filterwarnings("ignore:invalid escape sequence")
def test_longcat_arguments_stream_as_the_parsers_json_whatever_the_cuts():
    check_against_the_parser(longcat.parse_tool_call, GLM_TOOLS, random_longcat_call, seed=6)


def test_a_parser_that_fails_drops_the_call_not_the_reply(caplog):
    stream, calls = ToolCallStream(longcat.parse_tool_call, GLM_TOOLS), []
    with pytest.raises(AttributeError):  # longcat's parser on a call without arguments
        longcat.parse_tool_call("get_time", GLM_TOOLS)
    assert stream.update(calls, ("get_time",), "") == [] and calls == []
    assert "could not parse a tool call" in caplog.text


def test_a_glm_call_cut_off_inside_a_value_is_incomplete():
    text = "edit\n<arg_key>path</arg_key>\n<arg_value>src/main"
    stream, calls = ToolCallStream(glm47.parse_tool_call, GLM_TOOLS), []
    stream.update(calls, (text,), "")
    assert calls[0]["function"]["arguments"] == '{"path": "src/main'
    assert stream.cut_off == {0}


def test_a_longcat_call_for_a_tool_without_parameters_streams():
    # longcat's own type test indexes "parameters", which a tool may leave out.
    tools = [{"type": "function", "function": {"name": "edit"}}, *GLM_TOOLS]
    stream, calls = ToolCallStream(longcat.parse_tool_call, tools), []
    text = "edit\n<longcat_arg_key>path</longcat_arg_key><longcat_arg_value>a"
    (update,) = stream.update(calls, (), text)
    assert (update.opened, calls[0]["function"]["name"]) == (True, "edit")
