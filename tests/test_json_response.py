"""Whole replies are written even when a model's tool call holds half a surrogate pair."""

from __future__ import annotations

import json

from mlx_lm.tool_parsers import pythonic

from mlx_serve.json_response import JSONResponse
from mlx_serve.tool_calls import parse_tool_calls


def test_text_goes_out_as_utf8():
    assert JSONResponse({"text": "é😀"}).body == '{"text":"é😀"}'.encode()


def test_a_lone_surrogate_goes_out_escaped():
    """Python's reading of "\\ud83d" is a str no UTF-8 can hold: the body is ASCII JSON."""
    (call,) = parse_tool_calls(pythonic.parse_tool_call, None, '[look(q="\\ud83d!")]')
    body = JSONResponse({"tool_calls": [call]}).body
    assert b"\\ud83d" in body
    assert json.loads(body)["tool_calls"][0]["function"]["arguments"] == call["function"][
        "arguments"]
