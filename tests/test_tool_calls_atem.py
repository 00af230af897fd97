"""Muse Spark's calls (``<atem:invoke name=...>`` with ``<atem:parameter name=...>``s),
followed while written: the streamed arguments are exactly the JSON text of what
mlx-lm's parser makes of the whole span."""

from __future__ import annotations

import json
import random

from mlx_lm.tool_parsers import muse_spark

from tests.test_tool_call_spans import ARGUMENTS, check_updates, fuzzed, per_piece, streamed

TEXT_PIECES = ["a", "b ", " ", "\n", "<", ">", "</atem:invoke>", "</atem:param", '"', "\\",
               "é", "{", "true", "tru", "null", "NaN", "Infinity", "1", "-", "x"]


def atem_value(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:  # JSON, maybe with space around it
        value = rng.choice([json.dumps(rng.choice(ARGUMENTS)), "7", "-2.5", "true", "null",
                            '"quoted"', "[1, 2]", "NaN"])
    elif kind == 1:  # a word that starts like a JSON literal
        value = rng.choice(["tru", "true x", "nullable", "f", "Inf", "Infinity!"])
    else:
        value = "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randrange(8)))
    return rng.choice(["", " ", "\n"]) + value + rng.choice(["", " ", "\n"])


def atem_span(rng: random.Random) -> str:
    parts = [rng.choice(["", "\n"])]
    for _ in range(rng.randrange(1, 4)):
        attributes = rng.choice(["", 'id="1" '])
        parts.append(f'<atem:invoke {attributes}name="{rng.choice(["look", "edit"])}">')
        for key in rng.sample(["q", "path", "n", "é"], rng.randrange(4)):
            parts.append(f'{rng.choice(["", chr(10)])}<atem:parameter name="{key}">'
                         f"{atem_value(rng)}</atem:parameter>")
        parts.append(rng.choice(["", "\n"]) + "</atem:invoke>" + rng.choice(["", "\n"]))
    return "".join(parts)


def test_muse_spark_calls_stream_as_the_parsers_json_whatever_the_cuts():
    for text, expected, calls in fuzzed(muse_spark, atem_span, seed=14):
        assert [c["function"]["arguments"] for c in calls] == [
            json.dumps(e["arguments"], ensure_ascii=False) for e in expected], text


def test_text_streams_once_it_cannot_be_json():
    pieces = ['<atem:invoke name="look"><atem:parameter name="q"> tr', "uly, it ",
              "is</atem:parameter>", '<atem:parameter name="n">4', "2</atem:parameter>",
              "</atem:invoke>"]
    assert per_piece(muse_spark, pieces) == [
        [(True, '{"q": ', False)], [(False, '"truly, it', False)], [(False, ' is"', False)],
        [(False, ', "n": ', False)], [(False, "42", False)], [(False, "}", True)]]


def test_a_call_ends_at_its_end_tag_outside_a_value():
    text = ('<atem:invoke name="look"><atem:parameter name="q">a</atem:invoke>b'
            '</atem:parameter></atem:invoke><atem:invoke name="edit"></atem:invoke>')
    calls, updates = streamed(muse_spark.parse_tool_call, text, random.Random(3))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("look", '{"q": "a</atem:invoke>b"}'), ("edit", "{}")]
    check_updates(calls, updates)


def test_a_span_that_ends_without_the_calls_end_tag_closes_the_call():
    """The parser reads a call up to its end tag or the span's end."""
    text = '<atem:invoke name="look"><atem:parameter name="q">a</atem:parameter>'
    calls, updates = streamed(muse_spark.parse_tool_call, text, random.Random(4))
    assert [c["function"]["arguments"] for c in calls] == [
        json.dumps(muse_spark.parse_tool_call(text)["arguments"])] == ['{"q": "a"}']
    check_updates(calls, updates)
