"""A function's ``strict: true`` honoured when the model chooses to call it.

With ``tool_choice`` "auto" the model may answer in text or call a tool. OpenAI's
``strict`` promises that a call follows its function's schema. Here that is a grammar
that wakes at the model's tool-call marker, as llama.cpp's lazy tool-call grammars do
(``runner/call_grammar.py``): text is free, and from the marker on the call must be
``{"name": ..., "arguments": ...}`` naming an offered function, with a strict function's
arguments following its schema (any object for the others), up to the end marker; then
text is free again.

Beside a JSON ``response_format`` the reply is the answer in its schema or such calls,
so tools stay callable, as with OpenAI's models.

This holds for models whose tool-call markers are one token each. Where the model's own
calls are that JSON (mlx-lm's ``json_tools`` family: Qwen, Hermes and the like) nothing
changes but the grammar. Where they are not (Qwen3-Coder's XML, say), a call held to a
grammar is written as that JSON between the model's markers and read as JSON, as a
forced call is (``prompts.forced_call_schema``); without a strict function or a JSON
answer the model keeps its own format.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlx_serve.protocol import FunctionDefinition
from mlx_serve.tool_calls import is_json_tool_parser

log = logging.getLogger(__name__)


def call_schema(functions: Sequence[FunctionDefinition], enforce_all: bool) -> dict:
    """The JSON schema of one call to one of ``functions``: its name, and its arguments
    following its parameters when the function is strict or ``enforce_all`` (a forced
    call), else any object."""
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name},
                             "arguments": (f.parameters if enforce_all or f.strict else None)
                             or {"type": "object"}}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def json_calls(functions: Sequence[FunctionDefinition] | None, tokenizer: Any,
               json_answer: bool = False) -> dict | None:
    """How this model's calls to ``functions`` are held to a grammar: the markers' token
    ids, one call's schema, and whether the calls are JSON in a format that is not the
    model's own (``as_json``). None when nothing asks for a grammar (no strict function,
    no ``json_answer``: a JSON ``response_format`` beside the tools), so that the model
    writes its calls its own way, or when the markers are not one token each."""
    strict = any(f.strict for f in functions or ())
    if not functions or not (strict or json_answer):
        return None
    markers = _marker_ids(tokenizer)
    if markers is None:
        if strict:  # accepted, as vLLM does, but said: the call may leave its schema
            log.warning("'strict' is not enforced: this model's tool-call markers are not "
                        "one token each")
        return None
    return {"start": markers[0], "end": markers[1],
            "schema": call_schema(functions, enforce_all=False),
            "as_json": not is_json_tool_parser(getattr(tokenizer, "tool_parser", None))}


def calls_format(calls: dict | None, answer: dict | None) -> dict | None:
    """The format for the runner's ``compile_response_format`` that a reply with these
    calls (``json_calls``) needs: with a JSON ``answer`` (response_format), the answer or
    calls, each held to its schema; without one, the calls (a strict function's asked for
    them). Without calls: the answer alone."""
    if calls is None:
        return answer
    markers = {"start": calls["start"], "end": calls["end"], "schema": calls["schema"]}
    if answer is None:
        return {"type": "tool_calls", **markers, "param": "tools"}
    return {"type": "answer_or_calls", "answer": answer, **markers,
            "param": answer.get("param", "response_format")}


def _marker_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The tool-call start and end markers' token ids, when each is one token."""
    ids = []
    for marker in (getattr(tokenizer, "tool_call_start", None),
                   getattr(tokenizer, "tool_call_end", None)):
        if not marker:
            return None
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]
