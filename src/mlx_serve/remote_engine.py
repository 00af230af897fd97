"""The engine as seen from the HTTP process when it runs in a process of its own.

    routes ── submit() ──► ("submit", hid, requests) ──► engine process (engine_host)
    reply channel (one per handle) ◄── put ── ("events", ...) one message per actor turn

``RemoteEngine`` has the surface of ``Engine`` that the routes, the lifespan and the
draining server use, so they run unchanged. What it knows of the engine is what the
engine process last reported, at least every ``HEARTBEAT_S``:

- a report older than the step deadline means the engine process is stuck, whatever
  it said: the state reads ``wedged`` (``/health`` and ``/live`` 503);
- the socket's end means the process has gone: every open request gets a terminal
  ``EngineDeadError`` and the state reads ``failed``, unless the engine had stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import subprocess
import sys
import time
from typing import Any

import anyio

from mlx_serve.config import Settings
from mlx_serve.engine_state import (
    EngineState,
    EngineStatistics,
    check_admission,
    ended_error,
    unavailable_error,
)
from mlx_serve.engine_wire import HEARTBEAT_S, EngineInfo, frame, read_message, unpack_event
from mlx_serve.errors import MLXServeError, StepTimeoutError
from mlx_serve.generation import Delta, Failure, GenerationRequest, ReplyEvent
from mlx_serve.reply_channel import ReplyChannel
from mlx_serve.request_handle import RequestHandle

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # for the engine process to exit once its socket is closed


class RemoteReply(ReplyChannel[ReplyEvent]):
    """A handle's events here; closing it tells the engine process the client has gone."""

    __slots__ = ("_hid", "_engine", "size")

    def __init__(self, hid: int, engine: RemoteEngine, wake_every: int | None,
                 size: int) -> None:
        super().__init__(producers=1, wake_every=wake_every)
        self._hid = hid
        self._engine = engine
        self.size = size  # the requests (choices) it answers

    def close(self) -> None:
        super().close()
        self._engine._client_gone(self._hid)


class RemoteEngine:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._capacity = settings.decode_batch_size + settings.max_queue
        self.runner: Any = None  # the tokenizer side, once the engine has loaded
        self.pid: int | None = None
        self.ready = anyio.Event()
        self.finished = anyio.Event()
        self.stop_grace = STOP_GRACE_S  # shorter once asked to stop at once
        self._stats = EngineStatistics(EngineState.LOADING, 0, 0, 0, 0, 0, 0, 0.0, None)
        self._memory: dict[str, int] = {}
        self._heard: float | None = None  # when the engine process last said anything
        self._handles: dict[int, RemoteReply] = {}
        self._open_requests = 0  # the requests of the open handles
        self._next_hid = 0
        self._writer: asyncio.StreamWriter | None = None
        self._draining = False
        self._ended: EngineState | None = None  # set once the engine process has gone

    # -- the routes' side -------------------------------------------------------------

    def submit(self, *requests: GenerationRequest, wake_every: int | None = 1
               ) -> RequestHandle:
        state = self.state
        if state not in (EngineState.READY, EngineState.RECOVERING):
            raise unavailable_error(state)
        check_admission(self._open_requests, len(requests), self._capacity)
        hid, self._next_hid = self._next_hid, self._next_hid + 1
        reply = RemoteReply(hid, self, wake_every, len(requests))
        self._handles[hid] = reply
        self._open_requests += reply.size
        self._send(("submit", hid, requests))
        return RequestHandle(requests[0].request_id, reply)

    def statistics(self) -> EngineStatistics:
        stats, now = self._stats, time.monotonic()
        state = self._ended or stats.state
        silent = 0.0 if self._heard is None else now - self._heard  # starting: loading
        age = stats.step_age + silent if stats.step_age > 0 else 0.0
        if self._ended is None:
            if max(silent, age) > self._settings.step_timeout:
                # No word from the engine process for that long, or a step of its running
                # for that long (its actor says so itself once it wakes).
                state = EngineState.WEDGED
            elif state is EngineState.READY and self.runner is None:
                state = EngineState.LOADING  # the tokenizer is still loading here
            elif self._draining and state in (EngineState.READY, EngineState.RECOVERING):
                state = EngineState.DRAINING
        return dataclasses.replace(stats, state=state, step_age=age)

    @property
    def state(self) -> EngineState:
        return self.statistics().state

    def memory(self) -> dict[str, int]:
        return self._memory

    def unavailable_error(self) -> MLXServeError:
        return unavailable_error(self.state)

    def begin_drain(self) -> None:
        self._draining = True
        self._send(("drain",))

    def abort(self) -> None:
        self._draining = True
        self._send(("abort",))

    def set_failpoint(self, site: str, action: str | None) -> None:
        """Runtime fail points reach the engine process's sites too (None clears)."""
        self._send(("failpoint", site, action))

    def _client_gone(self, hid: int) -> None:
        if self._forget(hid):
            self._send(("close", hid))

    def _forget(self, hid: int) -> bool:
        reply = self._handles.pop(hid, None)
        if reply is None:
            return False
        self._open_requests -= reply.size
        return True

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(message))

    # -- the engine process -----------------------------------------------------------

    async def run(self) -> None:
        """Start the engine process and relay its messages until it ends."""
        ours, theirs = socket.socketpair()
        try:
            process = self._start(theirs)
        except OSError as exc:
            log.critical("could not start the engine process: %s", exc)
            self._end(None, f"could not start the engine process: {exc}")
            return
        finally:
            theirs.close()
        self.pid = process.pid
        reader, self._writer = await asyncio.open_connection(sock=ours)
        why = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_reports)
                while (message := await read_message(reader)) is not None:
                    self._heard = time.monotonic()
                    await self._on_message(message)
                tg.cancel_scope.cancel()
        except Exception as exc:  # this side of the link failed (a tokenizer that won't load)
            log.exception("lost the engine process")
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._writer.close()
            self._writer = None
            with anyio.CancelScope(shield=True):
                code = await _stopped(process, self.stop_grace)
            self._end(code, why)

    def _start(self, theirs: socket.socket) -> subprocess.Popen[bytes]:
        # On the child's command line: never the API key (the child serves no HTTP).
        settings = self._settings.model_dump_json(exclude={"api_key"})
        command = [sys.executable, "-m", "mlx_serve.engine_host",
                   "--fd", str(theirs.fileno()), "--settings", settings]
        log.info("starting the engine process")
        return subprocess.Popen(command, pass_fds=(theirs.fileno(),))

    async def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "events":
            self._deliver(message[1])
            self._note(message[2])
        elif kind == "stats":
            self._note(message[1])
        elif kind == "ready":
            await self._load_tokenizer(message[1])

    def _deliver(self, events: list[tuple[int, Any]]) -> None:
        handles = self._handles
        for hid, packed in events:
            reply = handles.get(hid)
            if reply is None:
                continue  # its client has gone
            if packed is None:
                self._forget(hid)
                reply.close_producer()
                continue
            event = unpack_event(packed)
            terminal = type(event) is not Delta or event.finish_reason is not None
            reply.put(event, urgent=terminal)

    def _note(self, report: tuple[EngineStatistics, dict[str, int]]) -> None:
        self._stats, self._memory = report

    async def _watch_reports(self) -> None:
        """An engine process silent past the step deadline is wedged, however it is stuck
        (its own actor cannot say so if its event loop is what stopped): its open
        requests get a timeout error here, as the actor would give them, and it is told
        to drop them should it come back."""
        while True:
            await anyio.sleep(HEARTBEAT_S)
            if self._handles and self.state is EngineState.WEDGED:
                log.error("no word from the engine process for over %.1f s: wedged",
                          self._settings.step_timeout)
                for hid in self._fail_open(StepTimeoutError(
                        "the engine process stopped responding; the engine is wedged")):
                    self._send(("close", hid))
                # Its last report still counts them: they are answered, none runs here.
                self._stats = dataclasses.replace(self._stats, running=0, waiting=0)

    async def _load_tokenizer(self, info: EngineInfo) -> None:
        from mlx_serve.runner.tokenizer_side import load_tokenizer_side

        self.runner = await anyio.to_thread.run_sync(load_tokenizer_side, info, self.memory)
        log.info("engine process %d ready; tokenizer loaded here", info.pid)
        self.ready.set()

    def _end(self, code: int | None, why: str | None = None) -> None:
        """The engine process has gone: answer every open request, keep its last word."""
        last = self._stats.state
        if last in (EngineState.STOPPED, EngineState.FAILED) and why is None:
            self._ended = last
        else:
            self._ended = EngineState.FAILED
            why = why or f"the engine process exited (status {code})"
            self._stats = dataclasses.replace(self._stats, error=why)
            log.critical("the engine has failed: %s", why)
        self._fail_open(ended_error(self._ended, self._draining))
        # Every request it had is answered now, and no step of it runs any more.
        self._stats = dataclasses.replace(self._stats, running=0, waiting=0, step_age=0.0)
        self.ready.set()
        self.finished.set()

    def _fail_open(self, error: MLXServeError) -> list[int]:
        """A terminal error to every open handle; the handles it answered."""
        answered = list(self._handles.items())
        for hid, reply in answered:
            self._forget(hid)
            reply.put(Failure(error), urgent=True)
            reply.close_producer()
        return [hid for hid, _ in answered]


async def _stopped(process: subprocess.Popen[bytes], grace: float) -> int | None:
    """The engine process's exit status, stopping it if it does not exit by itself
    within ``grace`` seconds (a frozen one, say)."""
    try:
        return await anyio.to_thread.run_sync(process.wait, grace)
    except subprocess.TimeoutExpired:
        log.error("the engine process did not exit; killing it")
        process.kill()
        return await anyio.to_thread.run_sync(process.wait)

