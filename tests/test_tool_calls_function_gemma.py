"""FunctionGemma's calls (``call:NAME{key:<escape>text<escape>,n:5}``), followed while
written: the streamed arguments are exactly the JSON text of what mlx-lm's parser makes
of the whole span."""

from __future__ import annotations

import json
import random

from mlx_lm.tool_parsers import function_gemma

from tests.test_tool_call_spans import fuzzed, per_piece

STRING_PIECES = ["a", " ", "\n", "<", "<esc", "escape>", ",", ":", '"', "\\", "é", "{",
                 "]", "x:"]


def function_gemma_value(rng: random.Random) -> str:
    if rng.random() < 0.5:
        text = "".join(rng.choice(STRING_PIECES) for _ in range(rng.randrange(8)))
        return f"<escape>{text.replace('<escape>', '')}<escape>"
    return rng.choice(["5", "-2.5", "true", "null", " 7", "word", "two words", " spaced ",
                       '"q"', "", "[1", "<b"])


def function_gemma_span(rng: random.Random) -> str:
    keys = rng.sample(["q", "path", "n", "é", "x_y"], rng.randrange(0, 4))
    arguments = ",".join(f"{k}:{function_gemma_value(rng)}" for k in keys)
    return f"{rng.choice(['', chr(10)])}call:{rng.choice(['look', 'edit'])}{{{arguments}}}"


def test_function_gemma_calls_stream_as_the_parsers_json_whatever_the_cuts():
    for text, expected, calls in fuzzed(function_gemma, function_gemma_span, seed=15):
        assert calls[0]["function"]["arguments"] == json.dumps(
            expected[0]["arguments"], ensure_ascii=False), text


def test_a_function_gemma_string_streams_as_it_is_written():
    pieces = ["call:look{q:<esc", "ape>wea", "ther<esc", "ape>,n:4", "2}"]
    assert per_piece(function_gemma, pieces) == [
        [(True, '{"q": ', False)], [(False, '"wea', False)], [(False, "ther", False)],
        [(False, '", "n": ', False)], [(False, "42}", False)]]
