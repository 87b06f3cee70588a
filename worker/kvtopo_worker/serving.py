"""The control API's bounds as a server: how many connections it holds and for how long.

Owns `ServerLimits` (the numbers) and `ConnectionCap`, which wraps the aiohttp server's
protocol factory: a connection past the total or per-source cap is closed at once (counted),
and one that has not sent a complete request head within `head_s` is closed (a slow or
silent client: each held a descriptor for an hour under aiohttp's defaults, and 2,154 idle
connections used up a prefill's descriptors while the operator's calls timed out). Idle
keep-alive connections close after `keepalive_s` (aiohttp's `keepalive_timeout`, 3,630 s by
default, 60 s here); a body
must arrive within `body_s` and fit the server's `client_max_size`, checked on the
`Content-Length` before anything is awaited (`kvtopo_worker.agent`'s middleware).

In vLLM the control API runs inside the engine's own process: what a client can hold there
is the engine's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """The control API's bounds (defaults: a few hundred engines' peers, the operator and a
    router or two at once, never an unbounded client)."""

    max_connections: int = 512  # in all
    max_per_source: int = 128  # from one source address
    head_s: float = 10.0  # a connection's first request head must be complete within this
    body_s: float = 30.0  # a request's body must arrive within this
    # An idle keep-alive connection is closed after this: longer than the operator keeps
    # one (45 s, so it lets go first) and than it leaves between two re-reads of one worker
    # of a 2,000-engine topology (20 s; shorter made nearly every re-read connect afresh).
    # Idle connections are bounded by the caps, and silent ones by `head_s`.
    keepalive_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.max_per_source <= self.max_connections:
            raise ValueError("0 < max_per_source <= max_connections is needed")
        if min(self.head_s, self.body_s, self.keepalive_s) <= 0:
            raise ValueError("head_s, body_s and keepalive_s must be positive")


class ConnectionCap:
    """Counts a server's connections by source address and closes the ones over the caps,
    and those that send no request head in time (`seen` marks a connection that did; the
    middleware calls it on every request)."""

    def __init__(
        self, limits: ServerLimits, on_refused: Callable[[str], None] | None = None
    ) -> None:
        self.limits = limits
        self.total = 0
        self.by_source: dict[str, int] = {}
        self.refused = 0
        self._on_refused = on_refused or (lambda _why: None)
        self._served: set[int] = set()  # ids of transports that sent a complete head

    def seen(self, transport: asyncio.Transport | None) -> None:
        """A request head arrived on `transport`: the head deadline no longer applies."""
        if transport is not None:
            self._served.add(id(transport))

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory that makes `factory`'s protocols, capped."""
        return lambda: _Capped(self, factory())

    def admit(self, source: str) -> str:
        """ "" and the connection counted, or why it is refused (over a cap)."""
        held = self.by_source.get(source, 0)
        if held >= self.limits.max_per_source:
            return "per_source"
        if self.total >= self.limits.max_connections:
            return "total"
        self.total += 1
        self.by_source[source] = held + 1
        return ""

    def release(self, source: str) -> None:
        self.total -= 1
        left = self.by_source.get(source, 1) - 1
        if left > 0:
            self.by_source[source] = left
        else:
            self.by_source.pop(source, None)

    def refuse(self, why: str, transport: asyncio.Transport) -> None:
        self.refused += 1
        self._on_refused(why)
        transport.abort()

    def _head_due(self, transport: asyncio.Transport) -> None:
        if id(transport) in self._served or transport.is_closing():
            return
        self.refuse("head_timeout", transport)


class _Capped(asyncio.Protocol):
    """One connection's protocol (aiohttp's request handler) behind the cap: counted from
    `connection_made` to `connection_lost`, closed at once over a cap, and closed when no
    request head came within the deadline; everything else is passed through."""

    def __init__(self, cap: ConnectionCap, inner: asyncio.Protocol) -> None:
        self.cap = cap
        self.inner = inner
        self.source: str | None = None
        self.transport: asyncio.Transport | None = None
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        why = self.cap.admit(source)
        if why:
            self.cap.refuse(why, transport)
            return
        self.source, self.transport = source, transport
        self.deadline = asyncio.get_running_loop().call_later(
            self.cap.limits.head_s, self.cap._head_due, transport
        )
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.source is None:
            return  # refused: the inner protocol never saw it
        if self.deadline is not None:
            self.deadline.cancel()
        self.cap.release(self.source)
        self.cap._served.discard(id(self.transport))
        self.source = None
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
