"""Unit-test doubles for the worker: a transport and a clock, injected through the real
constructors of EngineRegistry and PushConnector (never by mirroring private fields).

`FakeTransport` behaves like NIXL where it matters: sending to an agent that was removed
raises TransportError('not_found'); each failure mode has its own switch.
"""

from __future__ import annotations

import http.server
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtopo_worker.protocol import EngineMetadata
from kvtopo_worker.transport import TransportError, XferState


class FakeClock:
    """A monotonic clock that only moves when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@dataclass
class FakeTransport:
    agent_name: str = "fake-local"
    # failure switches
    fail_sends: bool = False
    fail_writes: bool = False
    write_state: XferState = "DONE"  # what poll() says of a WRITE in flight
    post_state: XferState = "PROC"  # what the post says ("DONE": finished inside the post)
    on_send: Callable[[str, bytes], None] | None = None
    on_remove: Callable[[str], None] | None = None
    on_release: Callable[[object], None] | None = None
    on_poll: Callable[[object], None] | None = None
    release_ok: bool = True  # False: NIXL refuses to release (a WRITE that cannot be aborted)
    # observations
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    writes: list[tuple[str, list[int], list[int], bytes]] = field(default_factory=list)
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    remotes: set[str] = field(default_factory=set)
    forgotten: set[str] = field(default_factory=set)  # agents NIXL "no longer holds"
    released: list[object] = field(default_factory=list)
    block_len: int = 64

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._handles = itertools.count(1)

    def add_remote_peer(self, meta: EngineMetadata) -> str:
        name = meta.agent_metadata.decode()  # a fake blob: the agent's name
        if name != meta.agent_name:
            raise TransportError(f"blob of {name}, engine says {meta.agent_name}", "identity")
        with self._lock:
            self.remotes.add(name)
        return name

    def add_agent(self, name: str) -> None:
        with self._lock:
            self.remotes.add(name)

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        if self.on_send is not None:
            self.on_send(agent_name, payload)
        with self._lock:
            if self.fail_sends:
                raise TransportError("injected send failure", "disconnected")
            if agent_name not in self.remotes:
                raise TransportError(f"agent {agent_name} removed", "not_found")
            self.sent.append((agent_name, payload))

    def get_notifs(self, room: Callable[[str, int], int] | None = None) -> list[tuple[str, bytes]]:
        with self._lock:
            out, self.inbox = self.inbox, []
        if room is None:
            return out
        by_agent: dict[str, list[bytes]] = {}
        for agent, payload in out:
            by_agent.setdefault(agent, []).append(payload)
        taken = {a: max(0, room(a, len(msgs))) for a, msgs in by_agent.items()}
        kept: list[tuple[str, bytes]] = []
        for agent, payload in out:
            if taken[agent] > 0:
                taken[agent] -= 1
                kept.append((agent, payload))
        return kept

    def deliver(self, agent_name: str, payload: bytes) -> None:
        with self._lock:
            self.inbox.append((agent_name, payload))

    def write_blocks(
        self,
        agent_name: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> object:
        with self._lock:
            if self.fail_writes or agent_name not in self.remotes:
                raise TransportError("injected write failure")
            self.writes.append((agent_name, list(local_block_ids), list(remote_block_ids), notif))
            return next(self._handles), self.post_state

    def poll(self, handle: object) -> XferState:
        if self.on_poll is not None:
            self.on_poll(handle)
        return self.write_state

    def release(self, handle: object) -> bool:
        if self.on_release is not None:
            self.on_release(handle)
        self.released.append(handle)
        return self.release_ok

    def remote_known(self, agent_name: str) -> bool:
        with self._lock:
            return agent_name in self.remotes and agent_name not in self.forgotten

    def remove_remote(self, agent_name: str) -> None:
        if self.on_remove is not None:
            self.on_remove(agent_name)
        with self._lock:
            self.remotes.discard(agent_name)
            self.removed.append(agent_name)


class MetadataPeer:
    """A peer's control API on loopback that answers every GET with the bytes the test
    sets (`payload`): garbage, or metadata crafted to lie; `delay_s` after the request
    arrived (a slow or hanging peer)."""

    def __init__(self) -> None:
        self.payload = b""
        self.delay_s = 0.0
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(peer.delay_s)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(peer.payload)))
                    self.end_headers()
                    self.wfile.write(peer.payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller gave up waiting

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
