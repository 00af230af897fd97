"""A function's ``strict: true`` honoured when the model chooses to call it.

With ``tool_choice`` "auto" the model may answer in text or call a tool. OpenAI's
``strict`` promises that a call follows its function's schema. Here that is a grammar
over the whole reply, as llama.cpp's lazy tool-call grammars do: text is free (special
tokens such as thinking markers included) until the model writes its tool-call marker;
from there the call must be ``{"name": ..., "arguments": ...}`` naming an offered
function, with a strict function's arguments following its schema (any object for the
others), up to the end marker; then text is free again.

This holds for models whose calls are that JSON between single-token markers (mlx-lm's
``json_tools`` family: Qwen, Hermes and the like). For other call formats ``strict`` is
accepted and not enforced, as in vLLM; the README says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mlx_serve.protocol import FunctionDefinition
from mlx_serve.tool_calls import is_json_tool_parser

# Compact JSON with the separators these models write (as for response_format): flexible
# whitespace would let a small model write newlines for ever inside a call.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Between a marker and the call's JSON: templates put one newline there.
_GAP = r"/[ \t\r\n]{0,4}/"


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


def strict_calls_format(functions: Sequence[FunctionDefinition] | None, tokenizer: Any
                        ) -> dict | None:
    """The format that enforces strict functions' calls in a free reply (a Lark grammar
    for ``compile_response_format``), or None when no function is strict or the model's
    calls are not JSON between single-token markers."""
    if not functions or not any(f.strict for f in functions):
        return None
    markers = _marker_ids(tokenizer)
    if markers is None:
        return None
    start, end = markers
    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    specials = sorted(set(_added_ids(tokenizer)) - {start, end} - eos)
    schema = {"x-guidance": _COMPACT, **call_schema(functions, enforce_all=False)}
    special = f"<[{','.join(map(str, specials))}]>" if specials else None
    lines = [
        "%llguidance {}",
        "start: free (call free)*",
        # Text, and the other special tokens (thinking markers...) anywhere in it.
        f"free: TEXT? ({special} TEXT?)*" if special else "free: TEXT?",
        "TEXT: /(?s:.+)/",
        f"call: <[{start}]> GAP body GAP <[{end}]>",
        f"GAP: {_GAP}",
        f"body: %json {json.dumps(schema)}",
    ]
    return {"type": "lark", "lark": "\n".join(lines), "param": "tools"}


def _marker_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The tool-call start and end markers' token ids, when the model writes JSON calls
    between markers that are one token each."""
    if not is_json_tool_parser(getattr(tokenizer, "tool_parser", None)):
        return None
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


def _added_ids(tokenizer: Any) -> list[int]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return list(hf.get_added_vocab().values())
    except AttributeError:
        return []
