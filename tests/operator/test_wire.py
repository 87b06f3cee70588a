"""The operator's HTTP/1.1 client (`kvtopo_operator.wire`) against real sockets on
loopback: a real aiohttp server (what workers run), and a raw server that answers each
request with the bytes a test scripts (what a hostile or broken worker may send). Every
answer is bounded, a malformed one fails its call alone with what was wrong, a hung one
fails at the deadline, and a connection is reused only when its answer ended cleanly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from kvtopo_operator.wire import ERROR_BODY_BYTES, MAX_HEAD_BYTES, TooLarge, WireError, WirePool
from kvtopo_worker.endpoints import Endpoint, parse_endpoint

Script = Callable[[int, bytes], bytes | None]  # (request number, request) -> bytes to send


class RawServer:
    """Answers the n-th request (counted over all connections) with `script(n, request)`;
    None closes the connection without answering; `hang` answers nothing, ever."""

    def __init__(self, script: Script, *, close_after: bool = False) -> None:
        self.script = script
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.endpoint: Endpoint | None = None

    async def start(self) -> Endpoint:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.endpoint = parse_endpoint(f"127.0.0.1:{port}")
        return self.endpoint

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                out = self.script(len(self.requests), request)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close_idle(self) -> None:
        """Closes every connection the server holds (as a restarted worker would)."""
        for w in self.writers:
            w.close()
        await asyncio.sleep(0)
        self.writers.clear()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.close_idle()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return (
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nETag: "t1"\r\n'
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


async def with_raw(
    script: Script, test: Callable[[WirePool, RawServer], Awaitable[None]], **kw: bool
) -> None:
    server = RawServer(script, **kw)
    await server.start()
    pool = WirePool()
    try:
        await test(pool, server)
    finally:
        pool.close()
        await server.stop()


def get(pool: WirePool, server: RawServer, timeout_s: float = 5.0, limit: int = 1 << 20):  # type: ignore[no-untyped-def]
    assert server.endpoint is not None
    return pool.request(server.endpoint, "GET", "/v1/state", {}, None, timeout_s, limit)


def test_answers_of_a_real_aiohttp_server_and_one_connection_for_many_calls() -> None:
    """A worker's real server (aiohttp): the body, status and fields come back as sent,
    the request's body and fields arrive as given, and the calls share one connection."""

    async def body() -> None:
        seen: list[tuple[str, str, bytes, str]] = []

        async def patch(request: web.Request) -> web.Response:
            seen.append(
                (request.method, request.host, await request.read(), request.headers["X-Sig"])
            )
            return web.json_response({"n": len(seen)}, headers={"ETag": f'"e{len(seen)}"'})

        async def missing(_: web.Request) -> web.Response:
            return web.Response(status=404, body=b"x" * 5000)

        app = web.Application()
        app.router.add_patch("/v1/peers", patch)
        app.router.add_get("/v1/missing", missing)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        target = parse_endpoint(f"127.0.0.1:{port}")
        pool = WirePool()
        try:
            for i in range(1, 4):
                answer = await pool.request(
                    target, "PATCH", "/v1/peers", {"X-Sig": f"s{i}"}, b'{"add":[]}', 5, 1 << 20
                )
                assert answer.status == 200
                assert answer.body == f'{{"n": {i}}}'.encode()
                assert answer.fields["etag"] == f'"e{i}"'
            assert seen == [
                ("PATCH", f"127.0.0.1:{port}", b'{"add":[]}', f"s{i}") for i in range(1, 4)
            ]
            assert pool.connects == 1
            missing_answer = await pool.request(target, "GET", "/v1/missing", {}, None, 5, 1 << 20)
            assert missing_answer.status == 404
            assert missing_answer.body == b"x" * (ERROR_BODY_BYTES + 1)  # the rest never read
            await pool.request(target, "PATCH", "/v1/peers", {"X-Sig": "s4"}, b"{}", 5, 1 << 20)
            assert pool.connects == 2  # the cut-short answer's connection was not reused
        finally:
            pool.close()
            await runner.cleanup()

    run(body)


def test_a_chunked_body_is_read_and_bounded() -> None:
    async def body() -> None:
        chunked = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        )

        async def test(pool: WirePool, server: RawServer) -> None:
            assert (await get(pool, server)).body == b"hello world"
            assert (await get(pool, server)).body == b"hello world"
            assert server.connections == 1
            assert (await get(pool, server, limit=7)).body == b"hello wo"  # limit + 1
            await get(pool, server)
            assert server.connections == 2

        await with_raw(lambda n, r: chunked, test)

    run(body)


def test_a_body_said_to_be_past_the_limit_is_refused_unread_and_its_connection_closed() -> None:
    """A Content-Length beyond what the call reads is refused before a byte of the body is
    read (`TooLarge`); the connection, holding the unread body, is not used again."""

    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            with pytest.raises(TooLarge, match="100000 bytes"):
                await get(pool, server, limit=10)
            answer = await get(pool, server, limit=200_000)
            assert answer.body == b"a" * 100_000
            assert server.connections == 2

        await with_raw(lambda n, r: ok(b"a" * 100_000), test)

    run(body)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"garbage\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/2 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 100 Continue\r\n\r\n", "2xx to 5xx only"),
        (b"HTTP/1.1 200 OK\r\nX-Y: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", "head exceeds"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 65 + b"\r\n", "more than 64 header fields"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nX-A : b\r\n\r\n", "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nX-A: b\nX-B: c\r\n\r\n", "malformed header field"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "malformed Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", "malformed Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            "two different Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "not spoken"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000,
            "size line exceeds",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX",
            "does not end with CRLF",
        ),
    ],
)
def test_a_malformed_answer_fails_its_call_with_what_was_wrong(answer: bytes, says: str) -> None:
    """Each malformed answer fails its call (WireError saying what), closes its
    connection, and the next call on a well-formed answer succeeds."""

    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            with pytest.raises(WireError, match=says):
                await get(pool, server)
            assert (await get(pool, server)).body == b'{"ok":true}'
            assert server.connections == 2
            assert pool.idle == 1

        await with_raw(lambda n, r: answer if n == 1 else ok(), test)

    run(body)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nonly this",
        b"HTTP/1.1 200 OK\r\nContent-Len",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    ],
)
def test_a_connection_closed_in_the_middle_of_an_answer_fails_the_call(answer: bytes) -> None:
    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            with pytest.raises(WireError, match="closed in the middle"):
                await get(pool, server)
            assert pool.idle == 0

        await with_raw(lambda n, r: answer, test, close_after=True)

    run(body)


def test_a_body_without_a_length_runs_to_the_end_of_the_connection() -> None:
    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            assert (await get(pool, server)).body == b"all of it"
            assert pool.idle == 0

        await with_raw(lambda n, r: b"HTTP/1.1 200 OK\r\n\r\nall of it", test, close_after=True)

    run(body)


def test_a_hung_worker_fails_at_the_deadline_and_is_not_reused() -> None:
    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                await get(pool, server, timeout_s=0.3)
            assert time.monotonic() - began < 3
            assert pool.idle == 0

        gate = asyncio.Event()

        def script(n: int, r: bytes) -> bytes | None:
            return ok()

        server = RawServer(script)
        await server.start()

        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await gate.wait()  # reads nothing, answers nothing
            writer.close()

        assert server.server is not None
        server.server.close()
        hung = await asyncio.start_server(hang, "127.0.0.1", 0)
        server.endpoint = parse_endpoint(f"127.0.0.1:{hung.sockets[0].getsockname()[1]}")
        pool = WirePool()
        try:
            await test(pool, server)
        finally:
            gate.set()
            pool.close()
            hung.close()

    run(body)


def test_a_connection_the_worker_closed_while_idle_is_replaced_and_the_call_made() -> None:
    """The worker closed the kept connection (it restarted): the call goes on a new one,
    once; a fresh connection closed without an answer fails the call (no loop)."""

    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            assert (await get(pool, server)).status == 200
            assert pool.idle == 1
            await server.close_idle()
            assert (await get(pool, server)).status == 200
            assert server.connections == 2
            server.script = lambda n, r: None  # closes every connection unanswered
            pool.close()
            with pytest.raises(WireError, match="without answering"):
                await get(pool, server)
            assert server.connections == 3

        await with_raw(lambda n, r: ok(), test)

    run(body)


def test_reuse_only_after_a_clean_answer_on_http_1_1_within_the_keepalive() -> None:
    async def body() -> None:
        answers = {
            1: ok(extra=b"Connection: close\r\n"),
            2: ok().replace(b"HTTP/1.1", b"HTTP/1.0"),
            3: ok() + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",  # more than asked
            4: ok(),
            5: ok(),
        }

        async def test(pool: WirePool, server: RawServer) -> None:
            for n in range(1, 5):
                assert (await get(pool, server)).status == 200
                assert server.connections == n
            pool.keepalive_s = 0.0  # the kept connection is now too old
            assert (await get(pool, server)).status == 200
            assert server.connections == 5

        await with_raw(lambda n, r: answers[n], test)

    run(body)


def test_a_field_value_with_a_line_break_is_never_sent() -> None:
    """An ETag a worker sent comes back as If-None-Match: one holding a line break would
    inject a field into the request; it is refused before anything is sent."""

    async def body() -> None:
        async def test(pool: WirePool, server: RawServer) -> None:
            assert server.endpoint is not None
            with pytest.raises(WireError, match="line break"):
                await pool.request(
                    server.endpoint,
                    "GET",
                    "/v1/state",
                    {"If-None-Match": '"a"\r\nX-Evil: 1'},
                    None,
                    5,
                    100,
                )
            assert server.requests == []

        await with_raw(lambda n, r: ok(), test)

    run(body)


def test_an_unreachable_worker_is_an_os_error() -> None:
    async def body() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = WirePool()
        with pytest.raises(OSError):
            await pool.request(parse_endpoint(f"127.0.0.1:{port}"), "GET", "/", {}, None, 5, 10)

    run(body)
