"""MiniCPM5's calls (``"NAME"><param name="KEY">VALUE</param>...``, values with ``<``,
``&`` or newlines in CDATA blocks), followed while written: the streamed arguments are
exactly the JSON text of what mlx-lm's parser makes of the whole call."""

from __future__ import annotations

import json
import random

from mlx_lm.tool_parsers import minicpm5

from tests.test_tool_call_spans import per_piece
from tests.test_tool_calls_xml import TOOLS, check_against_the_parser, value_for

CDATA_PIECES = ["a", " ", "\n", "<", "&", "]", "]]", "]]>", "]]> ", "</param", "</para",
                "é", '"', "\\", "<![CDATA[", "null"]


def cdata_value(rng: random.Random) -> str:
    text = "".join(rng.choice(CDATA_PIECES) for _ in range(rng.randrange(0, 10)))
    if "</param>" in text:
        text = "x"
    space = ["", " ", "\n", " \n "]
    return f"{rng.choice(space)}<![CDATA[{text}]]>{rng.choice(space)}"


def random_minicpm_call(rng: random.Random) -> str:
    names = rng.sample(["path", "count", "ratio", "force", "spec", "items", "any", "extra"],
                       rng.randrange(0, 5))
    quote = rng.choice(['"', "'", ""])
    parts = [f"{quote}edit{quote}>{rng.choice(['', chr(10)])}"]
    for name in names:
        if name in ("path", "extra", "spec") and rng.random() < 0.5:
            value = cdata_value(rng)
        else:
            value = value_for(rng, name).replace("</param", "</par")
        parts.append(f'<param name="{name}">{value}</param>{rng.choice(["", chr(10)])}')
    return "".join(parts)


def test_minicpm_arguments_stream_as_the_parsers_json_whatever_the_cuts():
    check_against_the_parser(minicpm5.parse_tool_call, TOOLS, random_minicpm_call, seed=13)


def test_a_cdata_string_streams_without_its_wrapper():
    pieces = ['"edit"><param name="path"> <![CDA', "TA[a <b>\n]", "]x]]", "> \n</par",
              "am>"]
    assert per_piece(minicpm5, pieces) == [
        [(True, '{"path": ', False)], [(False, '"a <b>\\n', False)],
        [(False, "]]x", False)], [], [(False, '"', False)]]


def test_the_whole_text_with_its_markers_reads_the_same():
    text = '<function name="edit"><param name="count">7</param></function>'
    calls = per_piece(minicpm5, [text[:30], text[30:]])
    assert calls == [[(True, "{", False)], [(False, '"count": 7}', False)]]
    assert json.dumps(minicpm5.parse_tool_call(text, TOOLS)["arguments"]) == '{"count": 7}'
