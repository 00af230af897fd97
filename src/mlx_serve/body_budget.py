"""Request-body bytes read at once, across requests.

Each body is bounded on its own (``--max-body-bytes``, ``--body-timeout``), but not the
sum: many clients sending large bodies together, slowly, could hold their buffers all at
once before any request reaches the engine's bounded queue. ``BodyBudget`` caps that
sum (``--max-body-bytes-in-flight``); a body that would pass it is refused as it arrives.
It lives on the event loop, which every body is read on, so it needs no lock.
"""

from __future__ import annotations

from mlx_serve.errors import BodiesOverloadedError


class BodyBudget:
    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # bytes held by bodies being read

    def take(self, size: int, held: int) -> None:
        """Hold ``size`` more bytes for a body that holds ``held`` already; refuse them if
        other bodies' bytes would pass the limit with them (a lone body always fits, so a
        limit below ``--max-body-bytes`` slows nothing down to a halt)."""
        if self.used > held and self.used + size > self.limit:
            raise BodiesOverloadedError(
                f"the server is reading {self.used} bytes of request bodies at once, its "
                f"limit; retry shortly")
        self.used += size

    def give(self, size: int) -> None:
        self.used -= size
