"""Arriving requests take turns on the event loop to be prepared.

Preparing a request (reading its body, validating it, tokenizing its prompt: about a
millisecond) runs on the event loop without a pause. A burst of arrivals would all be
prepared in one pass of the loop, one after another: 128 of them held it for over 100
ms, during which ``/health`` and the next frame of every stream already running waited.
Here one pass of the loop begins at most ``per_pass`` preparations; later arrivals wait,
in arrival order, for the next passes, and the loop serves its sockets in between.

Off by default (``per_pass`` 0). Set, it should be at least the prefill batch size: the
engine prefills that many prompts a step anyway, so a burst let in that many a pass
reaches it in the groups it would have taken them in, while fewer a pass split a burst
into more prefill steps, each of which holds up the decoding streams. On two vCPUs it
brought the probe sent during a burst of 128 arrivals from 40-77 ms down to 1-28 ms,
the tokens/s at 16-128 streams unchanged within the runs' spread
(benchmarks/MEASUREMENTS.md, 12-07). On an H100 host it shortened the server's own
event-loop stalls during such a burst (16-25 ms against 28-66) but not the probe's wait
(28-164 ms against 56-140), with the tokens/s moving both ways, so it stays off by
default. The largest single item of a burst's time on the loop there was its prompts'
encoding (22 % of the lock-held samples), which ``PromptEncoder.encode_soon`` now takes
off the loop for the prompts of a pass together; what remains is each request's own
reading, validating and routing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class IntakeTurns:
    """``await turns.wait_turn()`` before preparing a request; ``per_pass`` 0: no limit."""

    def __init__(self, per_pass: int) -> None:
        self._per_pass = per_pass
        self._begun = 0  # preparations begun (or let go) in this pass
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._pass_due = False  # the callback that starts the next pass is scheduled

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def wait_turn(self) -> None:
        """Return when this request's preparation may begin."""
        if self._per_pass <= 0:
            return
        if not self._waiting and self._begun < self._per_pass:  # else behind the waiting
            self._begun += 1
            self._next_pass_later()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._next_pass_later()
        try:
            await waiter
        except asyncio.CancelledError:  # gone before its turn (or as it came)
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)
            raise

    def _next_pass_later(self) -> None:
        if not self._pass_due:
            self._pass_due = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """At the loop's next pass, after it polled its sockets: the count starts again,
        and up to ``per_pass`` waiting requests are let go (they run in the pass after)."""
        self._pass_due = False
        self._begun = 0
        while self._waiting and self._begun < self._per_pass:
            waiter = self._waiting.popleft()
            if not waiter.done():  # else cancelled meanwhile
                waiter.set_result(None)
                self._begun += 1
        if self._begun:
            self._next_pass_later()
