"""The operator's HTTP/1.1 client for its calls to workers.

Owns `WirePool`: keep-alive connections to the workers' control endpoints (an IP literal and
a port, as `kvtopo_worker.endpoints` parsed them; no name is resolved, no redirect is
followed), one request at a time on each connection, and `Answer`, what came back. Every
answer is pod input and read with bounds: its head (status line and header fields) at most
`MAX_HEAD_BYTES` and `MAX_FIELDS` fields, its body at most the caller's limit plus one byte
(so the caller can tell it was too long; the rest is never read and the connection is
closed), each request within the caller's deadline, connecting included. An answer that is
not HTTP/1.x as the control API speaks it raises `WireError` with what was wrong, and its
connection is closed.

Why not aiohttp's client, which the operator used before: a rollout of 2,000 workers is tens
of thousands of small calls, and aiohttp's per-request machinery (URL objects, multidicts,
timers, tracing hooks, cookie handling, a response object and stream per call) cost about
twice the client CPU of this module per call, and its requests cost the workers more to
parse (`kvtopo bench wire`, BENCHMARKS.md). The operator's calls need none of it. A
connection the worker closed while it sat idle (the worker restarted, or a proxy dropped it)
fails on its next use before any answer arrives: that request is sent once more on a new
connection (the worker's calls are idempotent: a peer added twice is `present`, an eviction
of a peer not held is `absent`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvtopo_worker.endpoints import Endpoint

MAX_HEAD_BYTES = 16 * 1024  # an answer's status line and header fields
MAX_FIELDS = 64  # header fields in one answer
MAX_CHUNK_LINE = 1024  # a chunk's size line (chunked bodies)
ERROR_BODY_BYTES = 300  # what is kept of a non-2xx answer's body

_NO_BODY = frozenset({204, 304})


class WireError(Exception):
    """A call that got no usable HTTP answer; the message says what was wrong."""


class TooLarge(WireError):
    """The answer says its body is larger than the call reads: refused before a byte of
    the body is read (a worker answering 16 MiB states that changed on every read once
    held that much of the operator's memory per read)."""


class _Closed(WireError):
    """The connection ended before any byte of the answer arrived."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's answer: its status, its header fields (names lower-cased; the last of a
    repeated field), and its body (at most the call's limit + 1 bytes)."""

    status: int
    fields: dict[str, str]
    body: bytes


class _Connection(asyncio.Protocol):
    """One connection's bytes as they arrive; `wait` returns when more came or it ended."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until more bytes arrive or the connection ends (at once if it has ended)."""
        if self.ended:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.ended = True
        if self.transport is not None:
            self.transport.abort()


def _request_bytes(
    method: str, target: Endpoint, path: str, fields: Mapping[str, str], body: bytes | None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target}"]
    for name, value in fields.items():
        if any(c in value for c in "\r\n\0") or any(c in name for c in "\r\n\0: "):
            raise WireError(f"refusing to send header field {name!r}: it holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("\r\n")
    try:
        head = "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise WireError(f"a header field is not latin-1: {exc}") from None
    return head + body if body else head


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """Status, fields, and whether the connection may carry another request."""
    lines = head.split(b"\r\n")
    if len(lines) > MAX_FIELDS + 1:
        raise WireError(f"the answer has more than {MAX_FIELDS} header fields")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise WireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(code)
    if not 200 <= status <= 599:
        raise WireError(f"status {status}: the control API answers 2xx to 5xx only")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or b"\r" in line or b"\n" in line:
            raise WireError(f"a malformed header field: {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        if key == "content-length" and fields.get(key, text) != text:
            raise WireError("the answer has two different Content-Length fields")
        fields[key] = text
    keep = version == b"HTTP/1.1" and "close" not in fields.get("connection", "").lower()
    return status, fields, keep


async def _take(conn: _Connection, n: int) -> bytes:
    """The next `n` bytes of the connection."""
    buf = conn.buffer
    while len(buf) < n:
        if conn.ended:
            raise WireError("the connection closed in the middle of the answer's body")
        await conn.wait()
    out = bytes(buf[:n])
    del buf[:n]
    return out


async def _line(conn: _Connection, bound: int, what: str) -> bytes:
    """The next CRLF-ended line (without its CRLF), at most `bound` bytes."""
    buf = conn.buffer
    while True:
        end = buf.find(b"\r\n", 0, bound + 2)
        if end >= 0:
            line = bytes(buf[:end])
            del buf[: end + 2]
            return line
        if len(buf) > bound:
            raise WireError(f"{what} exceeds {bound} bytes")
        if conn.ended:
            raise WireError(f"the connection closed in the middle of {what}")
        await conn.wait()


async def _chunked(conn: _Connection, limit: int) -> tuple[bytes, bool]:
    """A chunked body, at most `limit` + 1 bytes of it; whether it was read to its end."""
    parts: list[bytes] = []
    size = 0
    while True:
        line = (await _line(conn, MAX_CHUNK_LINE, "a chunk's size line")).split(b";", 1)[0]
        text = line.strip()
        if not text or len(text) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in text):
            raise WireError(f"a malformed chunk size: {line[:40]!r}")
        n = int(text, 16)
        if n == 0:
            while await _line(conn, MAX_HEAD_BYTES, "the answer's trailer"):
                pass
            return b"".join(parts), True
        if size + n > limit:
            parts.append(await _take(conn, limit + 1 - size))
            return b"".join(parts), False
        parts.append(await _take(conn, n))
        size += n
        if await _take(conn, 2) != b"\r\n":
            raise WireError("a chunk does not end with CRLF")


async def _answer(conn: _Connection, method: str, limit: int) -> tuple[Answer, bool]:
    """The answer on `conn` and whether the connection may carry another request; the
    body at most `limit` + 1 bytes (ERROR_BODY_BYTES + 1 for a non-2xx answer)."""
    buf = conn.buffer
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > MAX_HEAD_BYTES:
            raise WireError(f"the answer's head exceeds {MAX_HEAD_BYTES} bytes")
        if conn.ended:
            if not buf:
                raise _Closed("the worker closed the connection without answering")
            raise WireError("the connection closed in the middle of the answer's head")
        await conn.wait()
    if end > MAX_HEAD_BYTES:
        raise WireError(f"the answer's head exceeds {MAX_HEAD_BYTES} bytes")
    head = bytes(buf[:end])
    del buf[: end + 4]
    status, fields, keep = _parse_head(head)
    if status >= 300:
        limit = min(limit, ERROR_BODY_BYTES)
    complete = True
    if status in _NO_BODY or method == "HEAD":
        body = b""
    elif "transfer-encoding" in fields:
        if fields["transfer-encoding"].lower() != "chunked":
            raise WireError(f"transfer coding {fields['transfer-encoding'][:40]!r} not spoken")
        body, complete = await _chunked(conn, limit)
    elif "content-length" in fields:
        text = fields["content-length"]
        if not text.isdigit() or not text.isascii() or len(text) > 18:
            raise WireError(f"a malformed Content-Length: {text[:40]!r}")
        length = int(text)
        if length > limit and status < 300:
            raise TooLarge(f"the answer's body is {length} bytes (at most {limit} are read)")
        body = await _take(conn, min(length, limit + 1))
        complete = length <= limit
    else:  # the body runs to the end of the connection
        while not conn.ended and len(buf) <= limit:
            await conn.wait()
        body = bytes(buf[: limit + 1])
        buf.clear()
        complete = keep = False
    # Bytes beyond the answer (nothing was asked for them): the connection is not reused.
    keep = keep and complete and not buf
    return Answer(status, fields, body), keep


class WirePool:
    """Keep-alive connections to workers, at most `limit` requests out at once; an idle
    connection is kept `keepalive_s` (at most `max_idle` of them, `per_endpoint` to one
    endpoint)."""

    def __init__(
        self,
        *,
        limit: int = 256,
        keepalive_s: float = 60.0,
        max_idle: int = 4096,
        per_endpoint: int = 8,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.per_endpoint = per_endpoint
        self.limit = limit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._out = asyncio.Semaphore(limit)
        self._idle: dict[Endpoint, list[_Connection]] = {}
        self._n_idle = 0
        self._next_sweep = 0.0
        self.connects = 0  # new connections made (tests and metrics read it)

    @property
    def idle(self) -> int:
        """Idle connections held."""
        return self._n_idle

    async def request(
        self,
        target: Endpoint,
        method: str,
        path: str,
        fields: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
        limit: int,
    ) -> Answer:
        """One request and its answer within `timeout_s` (TimeoutError after it); the body
        at most `limit` + 1 bytes. Raises WireError for an answer that is not HTTP as the
        control API speaks it, OSError when the worker cannot be reached."""
        data = _request_bytes(method, target, path, fields, body)
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections and the semaphore are one loop's
            self.close(abandon=True)
            self._loop, self._out = loop, asyncio.Semaphore(self.limit)
        async with self._out, asyncio.timeout(timeout_s):
            for attempt in range(2):
                conn = self._checkout(target)
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(target)
                try:
                    assert conn.transport is not None
                    conn.transport.write(data)
                    answer, keep = await _answer(conn, method, limit)
                except _Closed:
                    conn.close()
                    if reused and attempt == 0:
                        continue  # closed while it sat idle: once more, on a new one
                    raise
                except BaseException:
                    conn.close()
                    raise
                if keep:
                    self._checkin(target, conn)
                else:
                    conn.close()
                return answer
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(self, target: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, target.host, target.port)
        self.connects += 1
        return conn

    def _checkout(self, target: Endpoint) -> _Connection | None:
        held = self._idle.get(target)
        now = time.monotonic()
        while held:
            conn = held.pop()
            self._n_idle -= 1
            if not held:
                del self._idle[target]
            if conn.ended or conn.buffer or now - conn.idle_since > self.keepalive_s:
                conn.close()  # ended, sent something unasked, or idle too long
                continue
            return conn
        return None

    def _checkin(self, target: Endpoint, conn: _Connection) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        held = self._idle.setdefault(target, [])
        if len(held) >= self.per_endpoint or self._n_idle >= self.max_idle:
            conn.close()
            if not held:
                del self._idle[target]
            return
        conn.idle_since = now
        held.append(conn)
        self._n_idle += 1

    def _sweep(self, now: float) -> None:
        """Closes the connections idle longer than `keepalive_s` (a gone pod's)."""
        self._next_sweep = now + self.keepalive_s / 2
        for target in list(self._idle):
            kept = []
            for conn in self._idle[target]:
                if conn.ended or now - conn.idle_since > self.keepalive_s:
                    conn.close()
                else:
                    kept.append(conn)
            self._n_idle -= len(self._idle[target]) - len(kept)
            if kept:
                self._idle[target] = kept
            else:
                del self._idle[target]

    def close(self, *, abandon: bool = False) -> None:
        """Closes every idle connection (those out close when their request ends);
        `abandon`: they may be of an event loop that is closed (dropped then)."""
        for held in self._idle.values():
            for conn in held:
                try:
                    conn.close()
                except RuntimeError:  # its event loop is closed: the socket goes with it
                    if not abandon:
                        raise
        self._idle.clear()
        self._n_idle = 0
