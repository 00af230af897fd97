"""The request-head and send deadlines on uvicorn's two HTTP protocols (httptools and h11),
served in-process by a real uvicorn on a loopback port, with a small ASGI app.

Clients are plain sockets on worker threads; every read is bounded by the socket's
timeout. That a deadline has passed is learned from a connection it closed, never from
a sleep."""

from __future__ import annotations

import asyncio
import select
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mlx_serve.http_deadlines import MAX_HEAD_BYTES, uvicorn_protocol, with_deadlines

HEAD_TIMEOUT = 0.5  # seconds
SEND_TIMEOUT = 0.5
WAIT = 20.0  # the bound on any one read
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class App:
    """Answers ``ok``; a request to ``/held`` waits for ``release`` first; ``/endless``
    streams until its client is gone, then sets ``gone``; ``/wait`` sets ``gone`` once its
    client has gone, writing nothing."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.gone = anyio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/endless":
            await self.endless(receive, send)
            return
        if scope["path"] == "/length":  # of the body it read
            body = b""
            while (message := await receive())["type"] == "http.request":
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            answer = str(len(body)).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(answer)).encode())]})
            await send({"type": "http.response.body", "body": answer})
            return
        if scope["path"] == "/wait":  # for its client to go
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.set()
            return
        if scope["path"] == "/held":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def endless(self, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 65536

        async def write_on() -> None:
            while True:  # once writes wait on the client, this waits with them
                await send({"type": "http.response.body", "body": chunk,
                            "more_body": True})
                await anyio.lowlevel.checkpoint()  # a send that does not wait yields here

        async with anyio.create_task_group() as tg:
            tg.start_soon(write_on)
            while (await receive())["type"] != "http.disconnect":
                pass
            self.gone.set()
            tg.cancel_scope.cancel()


@asynccontextmanager
async def serving(base: type, app: App) -> AsyncIterator[int]:
    protocol = with_deadlines(base, HEAD_TIMEOUT, SEND_TIMEOUT)
    assert protocol is not None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol,
                                           ws="none", lifespan="off", log_level="warning"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(WAIT):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            yield port
        finally:
            server.should_exit = True


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by WAIT)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_responses(sock: socket.socket, count: int = 1) -> bytes:
    """``count`` ``ok`` responses (each read bounded by WAIT)."""
    data = b""
    while data.count(b"\r\n\r\nok") < count:
        chunk = sock.recv(65536)
        assert chunk, f"closed inside a response: {data!r}"
        data += chunk
    return data


async def exchange(base: type, client: Callable[[socket.socket], bytes]) -> bytes:
    """``client`` on one connection to a server of ``base`` with the deadlines, in a
    worker thread; what it returns."""
    async with serving(base, App()) as port:
        def run() -> bytes:
            with connect(port) as sock:
                return client(sock)

        return await anyio.to_thread.run_sync(run)


@pytest.fixture(params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def base(request) -> type:
    return request.param


@pytest.mark.anyio
@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost:"], ids=["nothing", "half"])
async def test_a_connection_without_a_whole_head_is_closed(base, sent):
    def client(sock: socket.socket) -> bytes:
        sock.sendall(sent)
        return read_until_closed(sock)

    assert await exchange(base, client) == b""


@pytest.mark.anyio
async def test_a_kept_alive_connection_is_timed_again_from_its_next_head(base):
    def client(sock: socket.socket) -> bytes:
        sock.sendall(REQUEST)
        assert read_responses(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HT")  # a next head that never ends
        return read_until_closed(sock)

    assert await exchange(base, client) == b""


@pytest.mark.anyio
async def test_pipelined_requests_are_all_answered(base):
    def client(sock: socket.socket) -> bytes:
        sock.sendall(REQUEST * 3)  # three heads in one write
        return read_responses(sock, 3)

    assert (await exchange(base, client)).count(b"HTTP/1.1 200") == 3


@pytest.mark.anyio
async def test_a_request_under_way_is_never_cut(base):
    app = App()
    sent = threading.Event()
    async with serving(base, app) as port:
        def held_request() -> bytes:
            with connect(port) as sock:
                sock.sendall(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
                sent.set()
                first = read_responses(sock)
                sock.sendall(REQUEST)  # and the connection still serves another
                return first + read_responses(sock)

        def deadline_passed() -> None:
            # Opened after the held request's connection: once this one is closed for
            # its missing head, the held connection's deadline has passed too.
            assert sent.wait(WAIT)
            with connect(port) as sock:
                assert read_until_closed(sock) == b""

        async with anyio.create_task_group() as tg:
            replies: list[bytes] = []

            async def run_held() -> None:
                replies.append(await anyio.to_thread.run_sync(held_request))

            tg.start_soon(run_held)
            await anyio.to_thread.run_sync(deadline_passed)
            app.release.set()
        assert replies[0].count(b"HTTP/1.1 200") == 2


@pytest.mark.anyio
async def test_a_client_that_takes_none_of_its_reply_is_cut_off(base):
    app = App()
    async with serving(base, app) as port:
        with connect(port) as sock:  # sends its request, then never reads
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await anyio.to_thread.run_sync(
                sock.sendall, b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
            with anyio.fail_after(WAIT):
                await app.gone.wait()  # the app saw its client leave


ENDLESS = 64 * 2**20  # what a client sends at most before it gives up on an answer


def send_until_answered(opening: bytes, piece: bytes) -> Callable[[socket.socket],
                                                                   tuple[int, bytes]]:
    """A client that sends ``opening``, then ``piece`` again and again until the server
    answers (or ``ENDLESS`` bytes); how much it sent, and the answer."""
    def client(sock: socket.socket) -> tuple[int, bytes]:
        sock.sendall(opening)
        sent = 0
        while sent < ENDLESS:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(piece)
            except OSError:  # reset: closed without an answer
                break
            sent += len(piece)
        try:
            return sent, read_until_closed(sock)
        except ConnectionResetError:  # h11 closes at once, its answer maybe overtaken
            return sent, b""

    return client


def assert_refused_in_time(base: type, sent: int, reply: bytes, says: bytes) -> None:
    # (socket buffers hold a megabyte or two of what the client sent before the answer)
    assert sent < ENDLESS, "the server took all the client sent"
    if base is HttpToolsProtocol:  # our bound: past 64 KiB, an answer that arrives
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert says in reply
    else:  # h11's own, at 16 KiB
        assert reply == b"" or reply.startswith(b"HTTP/1.1 4"), reply[:200]


@pytest.mark.anyio
async def test_a_request_head_past_the_size_bound_is_refused(base):
    client = send_until_answered(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 8192)
    sent, reply = await exchange(base, client)  # one header that never ends
    assert_refused_in_time(base, sent, reply, b"request_header_fields_too_large")


@pytest.mark.anyio
async def test_a_head_over_the_limit_sent_in_one_write_is_refused(base):
    if base is not HttpToolsProtocol:
        pytest.skip("h11 has its own bound")

    def client(sock: socket.socket) -> bytes:
        # The whole head in one write: before, the read that completed it went uncounted,
        # so up to about twice the limit got through.
        head = (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 30_000)
                + b"\r\n\r\n")
        sock.sendall(head)
        try:
            return read_until_closed(sock)
        except ConnectionResetError:
            return b""

    reply = await exchange(base, client)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


@pytest.mark.anyio
async def test_endless_trailer_fields_of_a_chunked_body_are_refused(base):
    client = send_until_answered(
        b"POST /length HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n5\r\nhello\r\n0\r\n", b"X-Trailer: " + b"t" * 1000 + b"\r\n")
    sent, reply = await exchange(base, client)
    # Before, httptools' trailer fields went into the request's headers without end.
    assert_refused_in_time(base, sent, reply, b"trailer fields are over")


@pytest.mark.anyio
async def test_a_chunked_body_with_a_few_trailer_fields_is_served_without_them(base):
    def client(sock: socket.socket) -> bytes:
        sock.sendall(b"POST /length HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n5\r\nhello\r\n3\r\nabc\r\n0\r\nX-Checksum: 1\r\n"
                     b"X-Other: 2\r\n\r\n" + REQUEST)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"ok"):
            chunk = sock.recv(65536)
            assert chunk, f"closed inside a response: {data!r}"
            data += chunk
        return data

    reply = await exchange(base, client)
    assert reply.split(b"\r\n\r\n")[1].startswith(b"8")  # the body's 8 bytes, read
    assert reply.endswith(b"ok")  # and the connection serves its next request


@pytest.mark.anyio
async def test_a_head_under_the_limit_with_its_body_in_one_write_is_served(base):
    def client(sock: socket.socket) -> bytes:
        body = b"b" * (2 * MAX_HEAD_BYTES)  # read with the head's end: not head bytes
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 60_000
                     + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        return read_responses(sock)

    assert (await exchange(base, client)).startswith(b"HTTP/1.1 200")


@pytest.mark.anyio
async def test_a_large_body_after_an_early_answer_is_not_taken_for_a_head(base):
    def client(sock: socket.socket) -> bytes:
        size = 4 * MAX_HEAD_BYTES
        sock.sendall(f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n"
                     .encode())
        first = read_responses(sock)  # answered before its body is read
        sock.sendall(b"b" * size)
        sock.sendall(REQUEST)
        return first + read_responses(sock)

    assert (await exchange(base, client)).count(b"HTTP/1.1 200") == 2


@pytest.mark.anyio
async def test_a_pipelined_request_under_way_sees_its_client_go(base):
    app = App()
    async with serving(base, app) as port:
        def send_then_leave() -> None:
            with connect(port) as sock:  # two heads in one write, then gone
                sock.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" + REQUEST)

        await anyio.to_thread.run_sync(send_then_leave)
        with anyio.fail_after(WAIT):
            await app.gone.wait()


@pytest.mark.anyio
async def test_a_client_that_reads_slowly_is_not_cut_off(base):
    app = App()
    async with serving(base, app) as port:
        def read_slowly() -> int:
            with connect(port) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
                taken = 0
                for _ in range(60):  # 2 KiB every 50 ms for 3 s: 6 deadlines' worth
                    chunk = sock.recv(2048)
                    assert chunk, f"cut off after {taken} bytes"
                    taken += len(chunk)
                    threading.Event().wait(0.05)
                return taken

        assert await anyio.to_thread.run_sync(read_slowly) > 0
        with anyio.fail_after(WAIT):
            await app.gone.wait()  # and it saw its client leave at the end


@pytest.mark.anyio
@pytest.mark.parametrize("split", [False, True], ids=["one-write", "head-then-body"])
async def test_an_offer_to_upgrade_to_h2c_is_declined_and_the_body_kept(base, split):
    head = (b"POST /length HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: 12\r\n\r\n")

    def client(sock: socket.socket) -> bytes:
        sock.sendall(head if split else head + b"upgrade: h2c")
        if split:
            sock.sendall(b"upgrade: h2c")  # the body: a line like the header, left alone
        data = b""
        while not data.endswith(b"\r\n\r\n12"):
            chunk = sock.recv(65536)
            assert chunk, f"closed: {data!r}"
            data += chunk
        return data

    reply = await exchange(base, client)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"\r\n\r\n12"), reply


def test_uvicorn_protocol_is_httptools_when_it_is_installed():
    assert uvicorn_protocol() is HttpToolsProtocol


def test_a_protocol_without_the_needed_methods_is_left_as_it_is():
    assert with_deadlines(object, HEAD_TIMEOUT, SEND_TIMEOUT) is None  # type: ignore[arg-type]


class _Transport:
    """What the send deadline reads of a transport: its buffer, its socket, abort."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.buffered = 100_000
        self.sock = sock
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else ("127.0.0.1", 1)

    def abort(self) -> None:
        self.aborted = True


class _Base:
    def pause_writing(self) -> None:
        pass


@pytest.mark.anyio
@pytest.mark.skipif(sys.platform != "linux", reason="the send queue's size is Linux's")
async def test_the_send_deadline_is_set_again_while_the_client_takes_any_of_the_reply():
    """Progress in the socket's send queue counts, not only in the transport's buffer:
    the socket is reported writable again only once megabytes of it have drained."""
    from mlx_serve.http_deadlines import DeadlinesMixin

    class Protocol(DeadlinesMixin, _Base):
        head_deadline, send_deadline = HEAD_TIMEOUT, 3600.0

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            server.setblocking(False)
            try:
                while True:  # fill the send queue: the client reads nothing yet
                    server.send(b"x" * 65536)
            except BlockingIOError:
                pass
            protocol = Protocol()
            protocol.transport = _Transport(server)
            protocol.loop = asyncio.get_running_loop()
            protocol._send_timer = None
            protocol.pause_writing()
            assert protocol._send_timer is not None
            client.recv(65536)  # the client takes a little
            protocol._send_expired()
            assert not protocol.transport.aborted and protocol._send_timer is not None
            protocol._send_timer.cancel()
            protocol._send_expired()  # and nothing more since: cut off
            assert protocol.transport.aborted
