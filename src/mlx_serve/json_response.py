"""A JSON body that can always be written.

Starlette's ``JSONResponse`` writes non-ASCII text as UTF-8, which fails on a lone UTF-16
surrogate: a model's Python or JSON tool-call arguments may escape half of a pair
(``"\\ud83d"``), and reading them makes such a string. Then the body is written as ASCII
JSON, whose ``\\ud83d`` escape any JSON reader takes (and pairs with the next half).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse as StarletteJSONResponse


class JSONResponse(StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()
