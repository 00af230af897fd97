"""The engine process: the actor and the MLX thread, serving the HTTP process's requests.

``python -m mlx_serve.engine_host --fd N --settings JSON`` is started by the HTTP
process (``remote_engine``) with one end of a socket pair. It runs the same ``Engine``
as the one-process server; what differs is where a request's events go: into one
outbox that is sent as a single message per turn of this process's event loop, so a
step's fan-out to 128 streams is one pickle and one socket write here, and the HTTP
work (parsing, SSE, a socket write per stream) runs in the other process, under its own
interpreter lock.

The HTTP process drives the life cycle: it sends ``drain`` and ``abort``. This process
ignores SIGINT and SIGTERM (a Ctrl+C reaches the whole process group; draining is the
HTTP process's job) and ends when its actor ends or the HTTP process goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from mlx_serve.config import LOG_FORMAT, Settings
from mlx_serve.engine import Engine, EngineState
from mlx_serve.engine_setup import (
    engine_config,
    freeze_startup_heap,
    make_loader,
    mlx_thread,
    warm_structured_output,
)
from mlx_serve.engine_wire import (
    HEARTBEAT_S,
    EngineInfo,
    FormatSpec,
    frame,
    pack_event,
    read_message,
)
from mlx_serve.errors import MLXServeError
from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import Failure, GenerationRequest, ReplyEvent
from mlx_serve.reply_channel import ReplyChannel

log = logging.getLogger("mlx_serve.engine_host")


class Outbox:
    """Every handle's events of one event-loop turn, sent together as one message."""

    def __init__(self, writer: asyncio.StreamWriter, engine: Engine) -> None:
        self._writer = writer
        self._engine = engine
        self._events: list[tuple[int, Any]] = []
        self._loop = asyncio.get_running_loop()
        self._scheduled = False

    def add(self, hid: int, packed: Any) -> None:
        self._events.append((hid, packed))
        if not self._scheduled:  # the actor's whole fan-out runs before this callback
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        events, self._events = self._events, []
        self.send(("events", events, self.stats()))

    def stats(self) -> tuple[Any, ...]:
        runner = self._engine.runner
        memory = runner.memory() if runner is not None else {}
        return (self._engine.statistics(), memory)

    def send(self, message: tuple[Any, ...]) -> None:
        if not self._writer.is_closing():
            self._writer.write(frame(message))


class ForwardingReply(ReplyChannel[ReplyEvent]):
    """This process's end of a handle: its events and its end go to the outbox."""

    __slots__ = ("_hid", "_outbox", "_on_end")

    def __init__(self, hid: int, producers: int, outbox: Outbox,
                 on_end: Callable[[int], object]) -> None:
        super().__init__(producers=producers, wake_every=None)
        self._hid = hid
        self._outbox = outbox
        self._on_end = on_end

    def put(self, item: ReplyEvent, urgent: bool = False) -> None:
        if not self._consumer_gone:
            self._outbox.add(self._hid, pack_event(item))

    def close_producer(self) -> None:
        self._producers -= 1
        if self._producers == 0:
            self._outbox.add(self._hid, None)
            self._on_end(self._hid)


class EngineHost:
    def __init__(self, settings: Settings, sock: socket.socket) -> None:
        self._settings = settings
        self._sock = sock
        self.failpoints = FailPoints.from_spec(settings.failpoints)
        self._mlx = mlx_thread(settings)
        self.engine = Engine(make_loader(settings, self.failpoints), engine_config(settings),
                             self._mlx)
        self._replies: dict[int, ForwardingReply] = {}

    async def run(self) -> None:
        reader, writer = await asyncio.open_connection(sock=self._sock)
        outbox = Outbox(writer, self.engine)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._announce_when_loaded, outbox)
                tg.start_soon(self._heartbeat, outbox)
                tg.start_soon(self._serve_commands, reader, outbox)
                await self._run_engine()
                tg.cancel_scope.cancel()
        finally:
            outbox.flush()  # the last events and the final state
            self.failpoints.release()
            await _close(writer)
            self._mlx.stop(timeout=10)

    async def _run_engine(self) -> None:
        try:
            await self.engine.run()
        except Exception:
            pass  # logged by the actor; its state, failed, goes out with the last message

    async def _announce_when_loaded(self, outbox: Outbox) -> None:
        await self.engine.ready.wait()
        runner = self.engine.runner
        if runner is None:
            return
        outbox.send(("ready", EngineInfo(runner.model_path, runner.context_length,
                                         runner.vocab_size, os.getpid())))
        await warm_structured_output(runner)
        log.info("engine process: froze %d startup objects", freeze_startup_heap())

    async def _heartbeat(self, outbox: Outbox) -> None:
        while True:
            await anyio.sleep(HEARTBEAT_S)
            outbox.send(("stats", outbox.stats()))

    async def _serve_commands(self, reader: asyncio.StreamReader, outbox: Outbox) -> None:
        while (message := await read_message(reader)) is not None:
            kind = message[0]
            if kind == "submit":
                await self._submit(message[1], message[2], outbox)
            elif kind == "close":
                reply = self._replies.pop(message[1], None)
                if reply is not None:
                    reply.close()
            elif kind == "drain":
                self.engine.begin_drain()
            elif kind == "abort":
                self.engine.abort()
            elif kind == "failpoint":
                self._set_failpoint(message[1], message[2])
        log.warning("engine process: the HTTP process has gone; stopping")
        self.engine.abort()

    async def _submit(self, hid: int, requests: Sequence[GenerationRequest],
                      outbox: Outbox) -> None:
        try:
            compiled = [await self._compiled(r) for r in requests]
            reply = ForwardingReply(hid, len(compiled), outbox, self._forget)
            self.engine.submit_to(reply, *compiled)
        except MLXServeError as exc:
            outbox.add(hid, Failure(exc, requests[0].index))
            outbox.add(hid, None)
            return
        self._replies[hid] = reply

    def _forget(self, hid: int) -> None:
        self._replies.pop(hid, None)

    async def _compiled(self, request: GenerationRequest) -> GenerationRequest:
        spec = request.output.response_format
        if not isinstance(spec, FormatSpec):
            return request
        compiled = await anyio.to_thread.run_sync(self.engine.runner.compile_response_format,
                                                  spec.response_format)
        output = dataclasses.replace(request.output, response_format=compiled)
        return dataclasses.replace(request, output=output)

    def _set_failpoint(self, site: str, action: str | None) -> None:
        if action is None:
            self.failpoints.clear(site)
        else:
            self.failpoints.set(site, action)


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_serve.engine_host")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--settings", required=True, help="the server's Settings as JSON")
    args = parser.parse_args(argv)
    settings = Settings.model_validate_json(args.settings)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    host = EngineHost(settings, sock)
    try:
        import uvloop

        uvloop.run(host.run())
    except ImportError:
        asyncio.run(host.run())
    state = host.engine.state
    logging.shutdown()
    sys.stderr.flush()
    # As the CLI does: no interpreter teardown under a step that may still run.
    os._exit(1 if state is EngineState.FAILED else 0)


if __name__ == "__main__":
    main()
