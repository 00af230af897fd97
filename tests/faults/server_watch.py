"""Watching a real server from outside in the fault suite: its health and state over
time, its fail points over HTTP, its process exit and its log.

Every wait polls a condition until a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from tests.faults.harness import POLL_S
from tests.server_process import ServerProcess

# -- health -------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    status: int | None  # None: no answer within the probe's timeout
    body: dict[str, Any]


class Poller:
    """Polls one endpoint concurrently with a test and keeps every answer."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    async def run(self, client: httpx.AsyncClient, path: str, interval: float) -> None:
        while True:
            try:
                resp = await client.get(path)
                self.samples.append(Sample(time.monotonic(), resp.status_code, resp.json()))
            except httpx.HTTPError as exc:
                self.samples.append(Sample(time.monotonic(), None, {"error": repr(exc)}))
            await anyio.sleep(interval)

    def statuses(self) -> set[int | None]:
        return {s.status for s in self.samples}

    def states(self) -> list[str]:
        return [s.body.get("state", "?") for s in self.samples]


@asynccontextmanager
async def polling(server: ServerProcess, path: str = "/health", interval: float = 0.02
                  ) -> AsyncIterator[Poller]:
    """Poll ``path`` (own connection, 1 s per probe) for as long as the block runs."""
    poller = Poller()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=1.0) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run, client, path, interval)
            try:
                yield poller
            finally:
                tg.cancel_scope.cancel()


async def health(client: httpx.AsyncClient, path: str = "/health") -> tuple[int, dict]:
    resp = await client.get(path)
    return resp.status_code, resp.json()


async def process_exit(server: ServerProcess, timeout: float) -> int:
    """The server process's exit status, once it has exited (within ``timeout``)."""
    async def exited() -> bool:
        return server.proc.poll() is not None

    await wait_until(exited, timeout, "the server process to exit")
    return server.proc.returncode


async def wait_until(check: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    last: Any = None
    with anyio.move_on_after(timeout):
        while True:
            last = await check()
            if last:
                return last
            await anyio.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


async def wait_for_state(client: httpx.AsyncClient, *states: str, timeout: float = 10.0
                         ) -> dict[str, Any]:
    """Poll /health until its state is one of ``states``; return that body."""
    last: dict[str, Any] = {}

    async def check() -> dict[str, Any] | None:
        nonlocal last
        _, last = await health(client)
        return last if last.get("state") in states else None

    try:
        return await wait_until(check, timeout, f"state in {states}")
    except AssertionError:
        raise AssertionError(f"state never reached {states} in {timeout} s: {last}") from None


async def wait_for_requests(client: httpx.AsyncClient, count: int, timeout: float = 10.0
                            ) -> dict[str, Any]:
    """Poll /health until ``count`` requests are open in the engine (running + waiting)."""
    async def check() -> dict[str, Any] | None:
        _, body = await health(client)
        return body if body["running"] + body["waiting"] >= count else None

    return await wait_until(check, timeout, f"{count} requests in the engine")


# -- fail points over HTTP ------------------------------------------------------------------


async def set_failpoint(client: httpx.AsyncClient, site: str, action: str) -> None:
    resp = await client.put(f"/_debug/failpoints/{site}", content=action)
    assert resp.status_code == 200, resp.text


async def clear_failpoint(client: httpx.AsyncClient, site: str) -> None:
    resp = await client.delete(f"/_debug/failpoints/{site}")
    assert resp.status_code == 200, resp.text


# -- the server's log -----------------------------------------------------------------------

_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*(.*)$",
                        re.MULTILINE)
_NOISE = ("Exception in ASGI application", "Task exception was never retrieved",
          "was never awaited", "Unclosed", "Exception ignored")


def unexpected_log_errors(log_text: str, allowed: Iterable[str] = ()) -> list[str]:
    """Tracebacks whose final line names none of ``allowed``, and asyncio/ASGI noise."""
    allowed = tuple(allowed)
    found = [m.group(1) for m in _TRACEBACK.finditer(log_text)
             if not any(a in m.group(1) for a in allowed)]
    found += [line for line in log_text.splitlines() if any(n in line for n in _NOISE)]
    return found


def assert_log_clean(server: ServerProcess, allowed: Iterable[str] = ()) -> None:
    text = server.log_path.read_text(errors="replace")
    problems = unexpected_log_errors(text, allowed)
    assert not problems, f"unexpected errors in the server log: {problems}\n{text[-4000:]}"
