"""vLLM's structured-output fields, as a response format the runner enforces.

vLLM takes ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar`` or
``json_object``) and, before it, ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``; clients written for vLLM send them in ``extra_body``. Each changes
the output, so each is enforced here, by the same llguidance matcher as
``response_format``, or refused with a 400: never ignored. A grammar is Lark, in
llguidance's dialect (what vLLM's llguidance backend takes).
"""

from __future__ import annotations

import json
from typing import Any

from mlx_serve.errors import RequestError, UnsupportedParameterError
from mlx_serve.protocol import ChatCompletionRequest, CompletionRequest

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs settings that would change the output in ways not served here.
REFUSED = ("structural_tag", "whitespace_pattern")


def guided_format(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The one constraint a request asks for in vLLM's fields, as a format dict for
    ``compile_response_format`` (with ``param``, the field to name in a 400); None if
    none is asked for."""
    asked: dict[str, Any] = {}
    outputs = body.structured_outputs
    if outputs is not None:
        for name in REFUSED:
            if (outputs.model_extra or {}).get(name) is not None:
                raise UnsupportedParameterError(f"'structured_outputs.{name}' is not "
                                                "supported", param=f"structured_outputs.{name}")
        asked.update({f"structured_outputs.{kind}": value for kind in STRUCTURED_KINDS
                      if (value := getattr(outputs, "json_" if kind == "json" else kind))
                      not in (None, False)})
    asked.update({name: value for name in GUIDED_FIELDS
                  if (value := getattr(body, name)) is not None})
    if not asked:
        return None
    if len(asked) > 1:
        raise RequestError(f"one structured-output constraint at a time; got {sorted(asked)}",
                           param=sorted(asked)[1])
    ((param, value),) = asked.items()
    return {**_format(param.rsplit(".", 1)[-1].removeprefix("guided_"), value, param),
            "param": param}


def _format(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RequestError(f"'{param}' is not valid JSON", param=param) from None
        if not isinstance(value, dict):
            raise RequestError(f"'{param}' must be a JSON Schema object", param=param)
        return {"type": "json_schema", "json_schema": {"schema": value}}
    if kind == "regex":
        return {"type": "regex", "regex": value}
    if kind == "choice":
        if not value or not all(value):
            raise RequestError(f"'{param}' must list non-empty strings", param=param)
        # Lark string literals: JSON's escapes, which Lark's strings read alike.
        return {"type": "lark",
                "lark": "start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                               for c in value)}
    return {"type": "lark", "lark": value}
