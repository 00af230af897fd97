"""Whatever a model writes inside its tool-call markers, following it never raises: random
strings of every format's tags, quotes, escapes and brackets, fed in random pieces to
every mlx-lm parser's follower. What streams stays consistent: each call is announced
once and done once, and its pieces join into its arguments."""

from __future__ import annotations

import logging
import random

import pytest
from mlx_lm.tool_parsers import (
    function_gemma,
    gemma4,
    glm47,
    json_tools,
    kimi_k2,
    kimi_k3,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
    qwen3_coder,
)

from mlx_serve.tool_calls import ToolCallStream, parse_tool_calls
from tests.test_tool_call_spans import TOOLS
from tests.test_tool_calls_xml import fed_in_pieces

PARSERS = [function_gemma, gemma4, glm47, json_tools, kimi_k2, kimi_k3, longcat, minicpm5,
           minimax_m2, mistral, muse_spark, pythonic, qwen3_coder]
ATOMS = [
    "[", "]", "(", ")", "{", "}", ",", ":", "=", '"', "'", "\\", "x", "q", "look", " ", "\n",
    "1", "-", "true", "null", "é", "😀", "\\x4", "\\N{", "\\u12", "\\0", 'b"', "r\"",
    "call:", "<escape>", '<|"|>', "[ARGS]", '{"name": "look", "arguments": {',
    '<atem:invoke name="look">', "</atem:invoke>", '<atem:parameter name="q">',
    "</atem:parameter>", "<function=edit>", "<parameter=path>", "</parameter>", "</function>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<longcat_arg_key>",
    "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>",
    '<invoke name="edit">', "</invoke>", '<parameter name="count">', "<|tool_call_begin|>",
    "functions.look:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    '<|open|>call tool="look"<|sep|>', '<|open|>argument key="q" type="number"<|sep|>',
    "<|close|>argument<|sep|>", "<|close|>call<|sep|>", "<|open|>json<|sep|>",
    "<|close|>json<|sep|>", '"look">', '<param name="path">', "</param>", "<![CDATA[", "]]>",
]


@pytest.mark.parametrize("parser", PARSERS, ids=[p.__name__.rsplit(".", 1)[1] for p in PARSERS])
def test_random_text_never_breaks_a_reply(parser, caplog):
    rng = random.Random(parser.__name__)
    with caplog.at_level(logging.ERROR, logger="mlx_serve.tool_calls"):  # warnings expected
        for _ in range(1000):
            text = "".join(rng.choice(ATOMS) for _ in range(rng.randrange(1, 40)))
            _, calls, updates = fed_in_pieces(parser.parse_tool_call, TOOLS, text, rng, most=12)
            for position, call in enumerate(calls):
                mine = [u for u in updates if u.position == position]
                assert [u.opened for u in mine].count(True) == 1 and mine[0].opened, text
                assert [u.done for u in mine].count(True) == 1 and mine[-1].done, text
                assert "".join(u.arguments for u in mine) == call["function"]["arguments"]


@pytest.mark.parametrize("text", ["1", "true", '"look"', "[1, 2]", '{"arguments": {}}'])
def test_json_that_is_no_call_is_left_out(text, caplog):
    """json_tools returns whatever JSON it reads; a reply once failed on a number."""
    with caplog.at_level(logging.WARNING, logger="mlx_serve.tool_calls"):
        assert parse_tool_calls(json_tools.parse_tool_call, None, text) == []
        stream, calls = ToolCallStream(json_tools.parse_tool_call, None), []
        assert stream.update(calls, (text,), "") == [] and calls == []
    assert "without a name" in caplog.text
