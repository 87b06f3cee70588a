"""Push-mode KV transfer between one prefill and one decode engine rank.

Owns the request life cycle on both sides and the engine-thread API:

- decode side: `request_receive` queues a `PUSH_REG` registration; the writer thread takes a
  registry snapshot under the lock and sends it to the prefill engine's rank of the same TP
  rank outside the lock. No agent, or a send that fails, puts the request on
  `failed_requests`; the writer never fails a request itself. A registration says until
  when a WRITE may start (`expires_at`) and how long one may take. When no completion has
  come within `registration_timeout_s` the decode gives the request up: it sends
  `PUSH_CANCEL` and ends the request only when no WRITE can land any more: the prefill
  answered (PUSH_FAIL: failed; PUSH_DONE: the bytes landed, done), or the registration's
  validity plus the WRITE timeout and `cancel_margin_s` have passed.
- prefill side: `request_send` marks a request's blocks finished; the progress thread
  matches them with the registration of the decode engine the request is paired with
  (registrations are keyed by (decode engine, request id), and accepted only from that
  engine's agent of that rank) and WRITEs them into the decode engine's blocks with a
  `PUSH_DONE` completion notification; requests matched in the same pass for the same
  decode rank share one WRITE and one completion (bounded by `max_requests_per_write` and
  `max_bytes_per_write`). The decode engine is pinned in the registry for the transfer, so
  it cannot be evicted under it. A registration that arrives before the decode engine is in
  the registry (the reverse handshake still running) waits within its lease. A WRITE that
  times out is aborted; one that cannot be aborted is watched to its end before the decode
  is told anything, so a `PUSH_FAIL` always means no WRITE of the request can still land.
- peer health: every transfer through a peer's agent says something of that peer (the
  registry keeps it, `EngineRegistry.peer_failed`): a WRITE, registration or notification
  that NIXL fails with a remote disconnect drops the peer; other NIXL failures (a WRITE
  that errs or times out, a registration given up that the prefill never answered) count
  towards `failing`, and a WRITE done (prefill) or a completion received (decode) resets
  the count. Once a second, each rank also asks NIXL whether it still holds every peer
  agent of its rank (`check_peers`).
- `get_finished()` (engine thread) drains done sending, done receiving and failed requests.
  Every request ends exactly once: each producer claims the request by removing it from its
  pending table under `_state_lock` before reporting, whatever raises on the way, and the
  engine thread drops (and counts) any second outcome. `abandon()` gives one request up
  (it ends as soon as no WRITE of it can land); `stop()` fails everything still pending
  with reason `shutdown` and tells the peers.

Called by the emulated engine (`emulated`) and the benchmarks; uses `registry`, a
`KVTransport` and `WorkerMetrics`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    MAX_REQUESTS_PER_WRITE,
    FailureType,
    MalformedMessage,
    Notification,
    PushCancel,
    PushDone,
    PushFail,
    PushRegistration,
    Role,
    decode_notification,
    encode_notification,
)
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.transport import KVTransport, TransportError, XferHandle, XferState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushConfig:
    """Timing of the push path. Defaults suit a real engine; tests shorten them."""

    registration_timeout_s: float = 30.0  # decode: registration sent, no completion yet
    kv_lease_s: float = 30.0  # prefill: finished blocks (or a registration) waiting for a match
    transfer_timeout_s: float = 30.0  # a WRITE posted, not DONE yet (the smaller side's wins)
    # Decode: after giving a request up, how long past the last moment a WRITE could still
    # land it waits for the prefill's answer before ending the request anyway (covers clock
    # skew between nodes and notifications queued while an engine was frozen).
    cancel_margin_s: float = 2.0
    # Progress-thread pacing. With WRITEs in flight it polls back to back (NIXL progress is
    # driven by these polls when its own thread is off); with requests waiting on a peer it
    # polls every `waiting_poll_s`; with nothing pending it backs off up to `idle_poll_s`
    # (an idle worker must cost well under 2% of a core) and is woken by new requests.
    waiting_poll_s: float = 0.0002
    idle_poll_s: float = 0.05
    # With the progress thread off, a WRITE advances only while it is polled: poll in-flight
    # transfers back to back for up to this long before looking at anything else.
    transfer_poll_burst_s: float = 0.0005
    deadline_check_s: float = 0.005  # how often timeouts and leases are checked
    # Requests matched in one pass for the same decode rank share one WRITE (one post, one
    # completion naming them all) up to these bounds, which also bound the latency a
    # request can gain by waiting for its batch-mates' bytes. 1 turns batching off.
    max_requests_per_write: int = 8
    max_bytes_per_write: int = 16 << 20

    def __post_init__(self) -> None:
        """Refuses a configuration the protocol cannot carry or that never ends a request."""
        if not 1 <= self.max_requests_per_write <= MAX_REQUESTS_PER_WRITE:
            raise ValueError(
                f"max_requests_per_write must be 1..{MAX_REQUESTS_PER_WRITE} (one completion "
                f"names at most that many requests), not {self.max_requests_per_write}"
            )
        if self.max_bytes_per_write < 1:
            raise ValueError(f"max_bytes_per_write must be >= 1, not {self.max_bytes_per_write}")
        for name in ("registration_timeout_s", "kv_lease_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], not {value}")
        if not 0 <= self.cancel_margin_s <= 3600:
            raise ValueError(f"cancel_margin_s must be 0..3600 s, not {self.cancel_margin_s}")


@dataclass(frozen=True)
class FailedRequest:
    """One request that ended in failure, and why."""

    request_id: str
    reason: FailureType
    message: str


@dataclass
class Finished:
    """What `get_finished()` hands the engine thread."""

    done_sending: list[str] = field(default_factory=list)
    done_receiving: list[str] = field(default_factory=list)
    failed: list[FailedRequest] = field(default_factory=list)


@dataclass
class _PendingRecv:
    prefill_engine_id: str
    block_ids: list[int]
    deadline: float  # registration timeout: give up (cancel) from then on
    give_up_at: float  # no WRITE can land after this: end the request even unanswered
    expires_at: float  # wall clock: the last moment a WRITE may start
    sent: bool = False  # the writer has sent (or is sending) the registration
    cancelling: bool = False
    overdue_since: float | None = None  # give_up_at seen passed (decided at a later look)
    cancel_reason: FailureType = FailureType.REGISTRATION_TIMEOUT  # why it was given up
    cancel_message: str = ""
    agent: str = ""  # the prefill's agent the registration went to (once sent)


@dataclass
class _PendingSend:
    block_ids: list[int]
    deadline: float
    decode_engine_id: str | None  # the decode engine the request is paired with, if known


@dataclass
class _PendingReg:
    reg: PushRegistration
    sender: str  # the agent it came from
    deadline: float


@dataclass
class _InFlight:
    handle: XferHandle
    decode_engine_id: str
    agent_name: str
    deadline: float
    started: float
    nbytes: int
    request_ids: tuple[str, ...]  # the requests this WRITE carries (keyed by the first)
    abort_failed_at: float | None = None  # past its deadline, could not be aborted


@dataclass(frozen=True)
class _SendOutcome:
    """How a prefill-side request ended, kept to answer a late cancel for it."""

    done: bool
    decode_engine_id: str | None
    reason: FailureType | None = None
    message: str = ""


def _signal(event: threading.Event) -> None:
    """Sets `event` unless it is set already (a set takes a lock and notifies). Safe for
    the connector's events because their waiters clear them before reading the state that
    the signal announces, and that state is written before the signal."""
    if not event.is_set():
        event.set()


class PushConnector:
    """The worker side of push-mode KV transfer for one engine rank."""

    def __init__(
        self,
        *,
        engine_id: str,
        role: Role,
        transport: KVTransport,
        registry: EngineRegistry,
        metrics: WorkerMetrics | None = None,
        config: PushConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tp_rank: int = 0,
        block_len: int = 0,
        outcome_ready: threading.Event | None = None,
        unknown_decode: Callable[[str, str], None] | None = None,
        decode_endpoint: str = "",
    ) -> None:
        """`outcome_ready` is set whenever an outcome is queued; ranks of one engine may
        share one, so that one engine thread waits on all of them.

        `unknown_decode(engine_id, endpoint)` (prefill) is called, on the progress thread,
        for a registration from a decode engine the registry does not hold that offers its
        control endpoint: the engine may then handshake lazily (it must not block; the
        registration waits within its lease). `decode_endpoint` (decode) is the endpoint
        this engine offers in its registrations ("" offers none)."""
        self.engine_id = engine_id
        self.role = role
        self.tp_rank = tp_rank
        self.block_len = block_len
        self.transport = transport
        self.registry = registry
        self.metrics = metrics or WorkerMetrics()
        self.config = config or PushConfig()
        self._clock = clock
        self._wall = wall_clock
        # Background threads put failures here; only the engine thread drains it.
        self.failed_requests: queue.SimpleQueue[FailedRequest] = queue.SimpleQueue()
        self._finished_q: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._reg_q: queue.SimpleQueue[PushRegistration | None] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._pending_recv: dict[str, _PendingRecv] = {}
        self._pending_send: dict[str, _PendingSend] = {}
        self._pending_reg: dict[tuple[str, str], _PendingReg] = {}  # (decode id, request id)
        self._in_flight: dict[str, _InFlight] = {}  # by the first request id of the WRITE
        self._writing: dict[str, str] = {}  # request id -> decode engine, of WRITEs in flight
        self._send_outcomes: OrderedDict[str, _SendOutcome] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_cap = 200_000
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._outcome_ready = outcome_ready or threading.Event()
        self._unknown_decode = unknown_decode
        self.decode_endpoint = decode_endpoint
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.requests_done = 0
        self.requests_failed = 0
        self._next_deadline_check = 0.0
        self._missing_agents: set[tuple[str, str]] = set()  # unknown to NIXL at the last check
        # Label lookups cost a lock and a dict probe per call: bind the children once.
        self._requests_total = {
            o: self.metrics.requests_total.labels(o) for o in ("done", "failed")
        }

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the registration writer and the progress thread."""
        if self._threads:
            return
        for name, target in (("writer", self._writer_loop), ("progress", self._progress_loop)):
            t = threading.Thread(target=target, name=f"kvtopo-{name}-{self.engine_id[:8]}")
            t.daemon = True
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the threads, then ends every request still pending as failed with reason
        `shutdown`: registrations are cancelled, the decode engines of prefill requests are
        told, WRITEs in flight are released and their decode engines unpinned. The outcomes
        wait in the queues for a last `get_finished()`."""
        self._stop.set()
        self._wake.set()
        self._reg_q.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
            recv = list(self._pending_recv.items())
            self._pending_recv.clear()
            sends = list(self._pending_send.items())
            self._pending_send.clear()
            regs = list(self._pending_reg.values())
            self._pending_reg.clear()
            xfers = list(self._in_flight.values())
            self._in_flight.clear()
            self._writing.clear()
        why = "the engine stopped"
        for rid, pending in recv:
            if pending.sent:
                self._send_cancel(rid, pending.prefill_engine_id)
            self._report_recv_failure(rid, pending, FailureType.SHUTDOWN, why)
        for rid, _ in sends:  # their decode engines are told below if they registered
            self._fail_send(rid, FailureType.SHUTDOWN, why, None)
        for pr in regs:
            self._answer(pr.sender, pr.reg.request_id, FailureType.SHUTDOWN, why)
        for xfer in xfers:
            self._finish_transfer(xfer, "ERR", self._clock(), FailureType.SHUTDOWN, why)

    # --- engine-thread API ---------------------------------------------------------------

    def register_kv_caches(self, kv: Any) -> None:
        """Registers the engine's KV cache with the transport (NIXL memory registration)."""
        register = getattr(self.transport, "register_kv_cache", None)
        if register is None:
            raise TypeError("this transport cannot register KV caches")
        register(kv)
        self.block_len = int(getattr(self.transport, "block_len", self.block_len))

    def request_receive(
        self,
        request_id: str,
        prefill_engine_id: str,
        block_ids: Sequence[int],
        first_block: int = 0,
    ) -> None:
        """Decode side: ask the prefill engine to push `request_id` into `block_ids` (its
        blocks from `first_block` on)."""
        if self.role != "decode":
            raise RuntimeError("request_receive is the decode side's call")
        cfg = self.config
        now = self._clock()
        expires_at = self._wall() + cfg.registration_timeout_s
        reg = PushRegistration(
            request_id=request_id,
            decode_engine_id=self.engine_id,
            prefill_engine_id=prefill_engine_id,
            block_ids=list(block_ids),
            decode_tp_rank=self.tp_rank,
            expires_at=expires_at,
            write_timeout_s=cfg.transfer_timeout_s,
            first_block=first_block,
            decode_endpoint=self.decode_endpoint,
        )
        give_up_at = now + cfg.registration_timeout_s + cfg.transfer_timeout_s + cfg.cancel_margin_s
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("the connector is stopped")
            if request_id in self._pending_recv or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            self._pending_recv[request_id] = _PendingRecv(
                prefill_engine_id,
                reg.block_ids,
                now + cfg.registration_timeout_s,
                give_up_at,
                expires_at,
            )
        self._reg_q.put(reg)
        _signal(self._wake)

    def request_send(
        self, request_id: str, block_ids: Sequence[int], decode_engine_id: str | None = None
    ) -> None:
        """Prefill side: the request's KV is in `block_ids`; push it when its decode engine
        (`decode_engine_id` when known; else the first that registers it) registers."""
        if self.role != "prefill":
            raise RuntimeError("request_send is the prefill side's call")
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("the connector is stopped")
            if request_id in self._pending_send or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            self._pending_send[request_id] = _PendingSend(
                list(block_ids), self._clock() + self.config.kv_lease_s, decode_engine_id
            )
        _signal(self._wake)

    def abandon(self, request_id: str, reason: FailureType, message: str) -> None:
        """The engine gives a request up (e.g. at its drain deadline): it ends with `reason`
        as soon as safety allows, through `get_finished()` like any other outcome.

        Decode side: a registration not yet sent ends at once; one sent is cancelled and
        ends when the prefill answers (or past the last moment a WRITE could land). Prefill
        side: a request not being written ends at once, and a decode engine that registered
        it is told; one being written ends with its WRITE.
        """
        now = self._clock()
        cancel: str | None = None
        with self._state_lock:
            pending = self._pending_recv.get(request_id)
            if pending is not None and not pending.sent:
                del self._pending_recv[request_id]
            elif pending is not None:
                pending.cancel_reason, pending.cancel_message = reason, message
                pending.deadline = min(pending.deadline, now)
                if not pending.cancelling:
                    pending.cancelling = True
                    cancel = pending.prefill_engine_id
                pending = None
            send = None
            if request_id not in self._writing:
                send = self._pending_send.pop(request_id, None)
            regs = [k for k in self._pending_reg if k[1] == request_id] if send else []
            answers = [self._pending_reg.pop(k) for k in regs]
        if pending is not None:
            self._report_recv_failure(request_id, pending, reason, message)
        if cancel is not None:
            self._send_cancel(request_id, cancel)
        if send is not None:
            self._fail_send(request_id, reason, message, None)
            for pr in answers:
                self._answer(pr.sender, request_id, reason, message)
        _signal(self._wake)

    def _why_given_up(self, pending: _PendingRecv) -> str:
        if pending.cancel_message:
            return pending.cancel_message
        return f"no completion within {self.config.registration_timeout_s:g} s"

    def wait_finished(self, timeout: float) -> bool:
        """Blocks the engine thread until an outcome may be ready (or `timeout` passes)."""
        ready = self._outcome_ready.wait(timeout)
        self._outcome_ready.clear()
        return ready

    def _report(self, kind: str, request_id: str) -> None:
        self._finished_q.put((kind, request_id))
        _signal(self._outcome_ready)

    def _report_failure(self, failed: FailedRequest) -> None:
        self.failed_requests.put(failed)
        _signal(self._outcome_ready)

    def get_finished(self) -> Finished:
        """Drains every outcome since the last call; each request appears exactly once."""
        out = Finished()
        while True:
            try:
                kind, rid = self._finished_q.get_nowait()
            except queue.Empty:
                break
            if self._end(rid, "done"):
                (out.done_sending if kind == "sent" else out.done_receiving).append(rid)
        while True:
            try:
                failed = self.failed_requests.get_nowait()
            except queue.Empty:
                break
            if self._end(failed.request_id, "failed"):
                out.failed.append(failed)
        return out

    def in_flight(self) -> int:
        with self._state_lock:
            return (
                len(self._pending_recv)
                + len(self._pending_send)
                + sum(len(x.request_ids) for x in self._in_flight.values())
            )

    def _end(self, request_id: str, outcome: str) -> bool:
        with self._state_lock:
            if request_id in self._ended:
                duplicate = True
            else:
                duplicate = False
                self._ended[request_id] = None
                if len(self._ended) > self._ended_cap:
                    self._ended.popitem(last=False)
        if duplicate:
            self.metrics.duplicate_outcomes_total.inc()
            log.error("request %s reported twice; second outcome (%s) dropped", request_id, outcome)
            return False
        if outcome == "done":
            self.requests_done += 1
        else:
            self.requests_failed += 1
        self._requests_total[outcome].inc()
        return True

    # --- sending notifications -----------------------------------------------------------

    def _notify(self, agent: str, msg: Notification, request_id: str, engine_id: str) -> bool:
        """Sends one notification; a failure is counted (it is a courtesy or an answer the
        peer's own deadline covers), never raised."""
        try:
            self.transport.send_notif(agent, encode_notification(msg))
            return True
        except Exception as exc:
            self.metrics.record_failure(
                FailureType.NOTIFICATION_FAILED,
                {"request_id": request_id, "engine_id": engine_id, "msg": str(exc)},
                level=logging.INFO,
            )
            self._transport_failed(engine_id, agent, exc)
            return False

    # --- peer health ---------------------------------------------------------------------

    def _transport_failed(self, engine_id: str, agent: str, exc: Exception) -> None:
        """A NIXL call through `agent` of `engine_id` failed: a remote disconnect drops the
        peer, any other NIXL error is one more failed transfer. An agent not (or no longer)
        added, or a call refused before NIXL was reached, says nothing of the peer."""
        kind = exc.kind if isinstance(exc, TransportError) else "error"
        if kind in ("not_found", "invalid", "identity"):
            return
        self._peer_failed(engine_id, agent, str(exc), dropped=kind == "disconnected")

    def _peer_failed(self, engine_id: str, agent: str, reason: str, *, dropped: bool) -> None:
        health = self.registry.peer_failed(engine_id, agent, reason, dropped=dropped)
        if health is not None:
            self.metrics.peer_health_total.labels(health).inc()

    def check_peers(self) -> int:
        """Asks NIXL whether it still holds the metadata of every peer agent of our rank
        (`check_remote_metadata`); a peer whose agent it has dropped is `dropped` once two
        checks in a row found it so (an agent being renewed is missing from NIXL for a
        moment). Returns how many agents were found dropped (the progress thread calls this
        once a second; a transport that cannot tell is not asked)."""
        known = getattr(self.transport, "remote_known", None)
        if known is None:
            return 0
        missing = {
            (engine_id, agent)
            for engine_id, agent in self.registry.agents_of_rank(self.tp_rank)
            if not known(agent)
        }
        confirmed = missing & self._missing_agents
        self._missing_agents = missing
        for engine_id, agent in sorted(confirmed):
            why = f"NIXL no longer holds the metadata of agent {agent}"
            self._peer_failed(engine_id, agent, why, dropped=True)
        return len(confirmed)

    def _rank_agent(self, engine_id: str) -> str | None:
        """The agent of `engine_id`'s rank that pairs with ours (same TP rank)."""
        return self.registry.snapshot(engine_id).get(self.tp_rank)

    # --- decode side: the registration writer --------------------------------------------

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            reg = self._reg_q.get()
            if reg is None:
                return
            self._write_registration(reg)

    def flush_registrations(self) -> int:
        """Sends the registrations queued so far on the calling thread (what the writer
        thread does; for callers that run without it); returns how many were taken."""
        n = 0
        while True:
            try:
                reg = self._reg_q.get_nowait()
            except queue.Empty:
                return n
            if reg is None:
                self._reg_q.put(None)  # the writer's stop sentinel: leave it
                return n
            self._write_registration(reg)
            n += 1

    def _write_registration(self, reg: PushRegistration) -> None:
        with self._state_lock:
            pending = self._pending_recv.get(reg.request_id)
            if pending is None:
                return  # ended before its turn (timed out, stopped)
            pending.sent = True
        try:
            self.send_registration(reg)
        except Exception as exc:  # never let one request kill the writer
            log.exception("registration writer")
            self._fail_recv(reg.request_id, FailureType.PUSH_REG_NOTIF_FAILED, repr(exc))

    def send_registration(self, reg: PushRegistration) -> None:
        """Sends `reg` to the prefill engine's rank of our TP rank (writer thread).

        Snapshot under the registry lock, send outside it: eviction may pop the engine the
        moment after, and then the send fails cleanly (counted, the request failed once).
        """
        agents = self.registry.snapshot(reg.prefill_engine_id)
        if not agents:
            self._fail_recv(
                reg.request_id,
                FailureType.PUSH_REG_NOTIF_FAILED,
                f"No remote agents for engine {reg.prefill_engine_id}",
            )
            return
        agent = agents.get(self.tp_rank)
        if agent is None:
            self._fail_recv(
                reg.request_id,
                FailureType.PUSH_REG_NOTIF_FAILED,
                f"engine {reg.prefill_engine_id} has no rank {self.tp_rank}",
            )
            return
        try:
            self.transport.send_notif(agent, encode_notification(reg))
        except TransportError as exc:
            self._transport_failed(reg.prefill_engine_id, agent, exc)
            self._fail_recv(
                reg.request_id,
                FailureType.PUSH_REG_NOTIF_FAILED,
                f"sending registration to rank {self.tp_rank} ({agent}): {exc}",
            )
            return
        with self._state_lock:
            pending = self._pending_recv.get(reg.request_id)
            if pending is not None:
                pending.agent = agent
        self.registry.touch(reg.prefill_engine_id)

    def _fail_recv(self, request_id: str, reason: FailureType, message: str) -> None:
        """Ends a decode-side request as failed, once (whoever claims it first)."""
        with self._state_lock:
            pending = self._pending_recv.pop(request_id, None)
        if pending is not None:
            self._report_recv_failure(request_id, pending, reason, message)

    def _report_recv_failure(
        self, request_id: str, pending: _PendingRecv, reason: FailureType, message: str
    ) -> None:
        self.metrics.record_failure(
            reason,
            {"request_id": request_id, "engine_id": pending.prefill_engine_id, "msg": message},
        )
        self._report_failure(FailedRequest(request_id, reason, message))

    def _send_cancel(self, request_id: str, prefill_engine_id: str) -> None:
        agent = self._rank_agent(prefill_engine_id)
        if agent is None:
            return  # evicted: its answer cannot come, the give-up deadline ends the request
        cancel = PushCancel(
            request_id=request_id,
            decode_engine_id=self.engine_id,
            prefill_engine_id=prefill_engine_id,
            decode_tp_rank=self.tp_rank,
        )
        self._notify(agent, cancel, request_id, prefill_engine_id)

    # --- the progress thread (both sides) ------------------------------------------------

    def _progress_loop(self) -> None:
        next_ttl_check = 0.0
        idle_sleep = self.config.waiting_poll_s
        while not self._stop.is_set():
            try:
                load = self.progress_once()
                now = self._clock()
                if now >= next_ttl_check:
                    for eid in self.registry.evict_idle():
                        log.info("idle TTL evicted engine %s", eid)
                    self.check_peers()
                    next_ttl_check = now + 1.0
            except Exception:
                log.exception("progress loop iteration failed")
                load = "idle"
            if load == "transferring":
                time.sleep(0)  # yield the GIL, poll again at once
                idle_sleep = self.config.waiting_poll_s
            elif load == "waiting":
                self._wake.wait(self.config.waiting_poll_s)
                self._wake.clear()
                idle_sleep = self.config.waiting_poll_s
            else:
                if self._wake.wait(idle_sleep):
                    idle_sleep = self.config.waiting_poll_s
                else:
                    idle_sleep = min(idle_sleep * 2, self.config.idle_poll_s)
                self._wake.clear()

    def progress_once(self) -> str:
        """One pass: notifications, matches, transfer polls, deadlines.

        Returns the load that paces the next pass: "transferring", "waiting" or "idle".
        """
        notifs = self.transport.get_notifs()
        if notifs:
            self._on_notifications(notifs)
        if self.role == "prefill":
            self._start_matched_transfers()
            burst_end = time.monotonic() + self.config.transfer_poll_burst_s
            while self._poll_transfers() == 0 and time.monotonic() < burst_end:
                pass
        now = self._clock()
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + self.config.deadline_check_s
            self._expire(now)
        with self._state_lock:
            if self._in_flight:
                return "transferring"
            if self._pending_recv or self._pending_send or self._pending_reg:
                return "waiting"
            return "idle"

    def _on_notifications(self, notifs: list[tuple[str, bytes]]) -> None:
        """Handles a pass's notifications; the registrations go in under one lock."""
        regs: list[tuple[str, PushRegistration]] = []
        for agent_name, data in notifs:
            try:
                msg = self._on_notification(agent_name, data)
            except Exception:  # nothing a peer sends may stop the pass
                self.metrics.reject("notification")
                log.exception("handling a notification from %s", agent_name)
                continue
            if msg is not None:
                regs.append((agent_name, msg))
        if regs:
            self._record_registrations(regs)

    def _sender_is(self, agent_name: str, engine_id: str) -> bool | None:
        """Whether `agent_name` is `engine_id`'s agent of our TP rank: True, False, or None
        when the agent is not known (yet)."""
        owner = self.registry.owner_of(agent_name)
        if owner is None:
            return None
        return owner == (engine_id, self.tp_rank)

    def _on_notification(self, agent_name: str, data: bytes) -> PushRegistration | None:
        """Handles one notification; a registration for this engine is returned to be
        recorded with the pass's others."""
        try:
            msg = decode_notification(data)
        except MalformedMessage as exc:
            self.metrics.reject("notification")
            log.warning("dropped malformed notification from %s: %s", agent_name, exc.message)
            return None
        if isinstance(msg, PushRegistration):
            if self.role != "prefill" or msg.prefill_engine_id != self.engine_id:
                self.metrics.reject("notification")
                log.warning("registration for %s reached %s", msg.prefill_engine_id, self.engine_id)
                return None
            if msg.decode_tp_rank != self.tp_rank:
                self.metrics.reject("notification")
                log.warning(
                    "registration of rank %d reached rank %d", msg.decode_tp_rank, self.tp_rank
                )
                return None
            return msg
        if isinstance(msg, PushCancel):
            if self.role != "prefill" or msg.prefill_engine_id != self.engine_id:
                self.metrics.reject("notification")
                return None
            if self._sender_is(agent_name, msg.decode_engine_id) is not True:
                self.metrics.reject("notification")
                log.warning(
                    "cancel of %s from %s, not %s's agent",
                    msg.request_id,
                    agent_name,
                    msg.decode_engine_id,
                )
                return None
            self._on_cancel(agent_name, msg)
            return None
        if self.role != "decode":
            self.metrics.reject("notification")
            return None
        if isinstance(msg, PushDone):
            self._on_done(agent_name, msg)
        else:
            self._on_fail(agent_name, msg)
        return None

    def _claim_recv(
        self, agent_name: str, prefill_engine_id: str, rids: list[str]
    ) -> list[tuple[str, _PendingRecv]]:
        """Takes the pending requests `rids` that are paired with `prefill_engine_id`, when
        `agent_name` is that engine's agent of our rank; counts the rest as rejected."""
        claimed: list[tuple[str, _PendingRecv]] = []
        if self._sender_is(agent_name, prefill_engine_id):
            with self._state_lock:
                for rid in rids:
                    pending = self._pending_recv.get(rid)
                    if pending is not None and pending.prefill_engine_id == prefill_engine_id:
                        claimed.append((rid, self._pending_recv.pop(rid)))
        if len(claimed) < len(rids):
            self.metrics.reject("notification")  # late (ended), unknown or not from its pair
        return claimed

    def _on_done(self, agent_name: str, msg: PushDone) -> None:
        claimed = self._claim_recv(agent_name, msg.prefill_engine_id, msg.request_ids)
        if claimed:  # a WRITE from the prefill landed: the peer works
            self.registry.peer_succeeded(msg.prefill_engine_id, agent_name)
        for rid, _ in claimed:
            self._report("recv", rid)

    def _on_fail(self, agent_name: str, msg: PushFail) -> None:
        # A PUSH_FAIL promises that no WRITE of the request can land any more.
        for rid, pending in self._claim_recv(agent_name, msg.prefill_engine_id, [msg.request_id]):
            if pending.cancelling:
                reason = pending.cancel_reason
                message = f"{self._why_given_up(pending)}; the prefill answered the cancel"
            else:
                reason, message = msg.reason, f"prefill refused: {msg.message}"
            self._report_recv_failure(rid, pending, reason, message)

    # --- prefill side --------------------------------------------------------------------

    def _record_registrations(self, regs: list[tuple[str, PushRegistration]]) -> None:
        # A decode engine whose registrations arrive is in use (the idle-TTL backstop).
        for engine_id in {msg.decode_engine_id for _, msg in regs}:
            self.registry.touch(engine_id)
        if self._unknown_decode is not None:
            offered = {m.decode_engine_id: m.decode_endpoint for _, m in regs if m.decode_endpoint}
            for engine_id, endpoint in offered.items():
                if not self.registry.snapshot(engine_id):
                    self._unknown_decode(engine_id, endpoint)
        now, wall = self._clock(), self._wall()
        answers: list[tuple[str, str, FailureType, str]] = []
        duplicates = 0
        with self._state_lock:
            for sender, msg in regs:
                rid, decode_id = msg.request_id, msg.decode_engine_id
                paired = self._paired_decode(rid)
                if paired is not None and paired != decode_id:
                    answers.append(
                        (
                            sender,
                            rid,
                            FailureType.REMOTE_REJECTED,
                            "the request is paired with another decode engine",
                        )
                    )
                elif rid in self._writing:
                    duplicates += 1
                elif (outcome := self._send_outcomes.get(rid)) is not None:
                    if outcome.done:
                        duplicates += 1
                    else:  # ended failed before its registration came: say so at once
                        reason = outcome.reason or FailureType.TRANSFER_FAILED
                        answers.append((sender, rid, reason, outcome.message))
                elif wall >= msg.expires_at:
                    answers.append(
                        (
                            sender,
                            rid,
                            FailureType.REGISTRATION_TIMEOUT,
                            "the registration expired before it could be used",
                        )
                    )
                else:
                    lease = min(self.config.kv_lease_s, msg.expires_at - wall)
                    self._pending_reg[(decode_id, rid)] = _PendingReg(msg, sender, now + lease)
        for _ in range(duplicates):
            self.metrics.reject("notification")
        for sender, rid, reason, message in answers:
            self.metrics.reject("notification")
            self._answer(sender, rid, reason, message, verify_as=None)

    def _paired_decode(self, rid: str) -> str | None:
        """The decode engine a prefill request is bound to, if any (call under the lock)."""
        send = self._pending_send.get(rid)
        if send is not None:
            return send.decode_engine_id
        if rid in self._writing:
            return self._writing[rid]
        outcome = self._send_outcomes.get(rid)
        return outcome.decode_engine_id if outcome is not None else None

    def _answer(
        self,
        agent: str,
        rid: str,
        reason: FailureType,
        message: str,
        verify_as: str | None = None,
    ) -> None:
        """Sends PUSH_FAIL for `rid` to `agent` (a decode rank); with `verify_as`, only when
        `agent` is that engine's agent (answers go to registered peers only)."""
        owner = self.registry.owner_of(agent)
        if owner is None or (verify_as is not None and owner[0] != verify_as):
            return
        fail = PushFail(
            request_id=rid, prefill_engine_id=self.engine_id, reason=reason, message=message[:200]
        )
        self._notify(agent, fail, rid, owner[0])

    def _on_cancel(self, sender: str, msg: PushCancel) -> None:
        """The decode engine gave `msg.request_id` up: drop its registration (and fail our
        side of the request) unless its WRITE is in flight, whose end answers instead."""
        rid, decode_id = msg.request_id, msg.decode_engine_id
        why = "the decode engine gave the request up (registration timeout)"
        with self._state_lock:
            pr = self._pending_reg.pop((decode_id, rid), None)
            writing = self._writing.get(rid) == decode_id
            outcome = self._send_outcomes.get(rid)
            send = self._pending_send.get(rid)
            own = send is not None and send.decode_engine_id in (None, decode_id)
            if own and not writing:
                del self._pending_send[rid]
        if writing:
            return
        if own:
            self._fail_send(rid, FailureType.REGISTRATION_TIMEOUT, why, None)
        if outcome is not None and outcome.decode_engine_id == decode_id:
            if outcome.done:  # it landed: say so again (the decode then ends it done)
                done = PushDone(request_id=rid, prefill_engine_id=self.engine_id, num_blocks=0)
                self._notify(sender, done, rid, decode_id)
                return
            reason = outcome.reason or FailureType.TRANSFER_FAILED
            self._answer(sender, rid, reason, outcome.message)
            return
        if pr is None and not own and outcome is None:
            self.metrics.reject("notification")  # nothing known of it: no WRITE can come
        self._answer(sender, rid, FailureType.REGISTRATION_TIMEOUT, "cancelled")

    def _start_matched_transfers(self) -> None:
        with self._state_lock:
            candidates = [
                (key, pr.sender)
                for key, pr in self._pending_reg.items()
                if key[1] in self._pending_send
            ]
        if not candidates:
            return
        # One registry lookup per (sender, engine) of the pass, not per request.
        seen: dict[tuple[str, str], bool | None] = {}
        verdicts: dict[tuple[str, str], bool | None] = {}
        for key, sender in candidates:
            who = (sender, key[0])
            if who not in seen:
                seen[who] = self._sender_is(sender, key[0])
            verdicts[key] = seen[who]
        work: list[tuple[PushRegistration, _PendingSend]] = []
        refused: list[tuple[_PendingReg, str]] = []
        with self._state_lock:
            for key, verdict in verdicts.items():
                pr = self._pending_reg.get(key)
                send = self._pending_send.get(key[1])
                if pr is None or send is None:
                    continue
                if verdict is None:
                    continue  # the decode engine is not in our registry yet: wait (lease)
                if verdict is False:
                    del self._pending_reg[key]
                    refused.append((pr, ""))
                    continue
                if send.decode_engine_id not in (None, key[0]):
                    del self._pending_reg[key]
                    refused.append((pr, "the request is paired with another decode engine"))
                    continue
                del self._pending_reg[key]
                del self._pending_send[key[1]]
                work.append((pr.reg, send))
        for pr, why in refused:
            self.metrics.reject("notification")
            if why:  # a registration from its own engine's agent, for another's request
                self._answer(pr.sender, pr.reg.request_id, FailureType.REMOTE_REJECTED, why)
        if work:
            self._write_batches(work)

    def _write_batches(self, work: list[tuple[PushRegistration, _PendingSend]]) -> None:
        wall = self._wall()
        batch: list[tuple[PushRegistration, _PendingSend]] = []
        nbytes = 0
        for reg, offered in work:
            send = offered
            if wall >= reg.expires_at:
                self._fail_send(
                    reg.request_id,
                    FailureType.REGISTRATION_TIMEOUT,
                    "the registration expired before its KV was ready",
                    reg.decode_engine_id,
                )
                continue
            if reg.first_block:  # the decode holds the first blocks from its prefix cache
                send = _PendingSend(
                    send.block_ids[reg.first_block :], send.deadline, send.decode_engine_id
                )
            if len(reg.block_ids) != len(send.block_ids):
                msg = (
                    f"decode offered {len(reg.block_ids)} blocks, request has "
                    f"{len(send.block_ids)} (from block {reg.first_block} on)"
                )
                self._fail_send(
                    reg.request_id, FailureType.TRANSFER_SETUP_FAILED, msg, reg.decode_engine_id
                )
                continue
            size = len(send.block_ids) * self.block_len
            if batch and (
                reg.decode_engine_id != batch[0][0].decode_engine_id
                or len(batch) >= self.config.max_requests_per_write
                or nbytes + size > self.config.max_bytes_per_write
            ):
                self._start_batch(batch)
                batch, nbytes = [], 0
            batch.append((reg, send))
            nbytes += size
        if batch:
            self._start_batch(batch)

    def _start_batch(self, batch: list[tuple[PushRegistration, _PendingSend]]) -> None:
        """Starts one WRITE; whatever raises, every request of the batch ends once."""
        try:
            self._start_transfer(batch)
        except Exception as exc:
            log.exception("starting a WRITE")
            with self._state_lock:
                started = batch[0][0].request_id in self._in_flight
            if not started:
                for reg, _ in batch:
                    self._fail_send(
                        reg.request_id,
                        FailureType.TRANSFER_SETUP_FAILED,
                        f"{type(exc).__name__}: {exc}",
                        reg.decode_engine_id,
                    )

    def _start_transfer(self, batch: list[tuple[PushRegistration, _PendingSend]]) -> None:
        """One WRITE for requests bound for the same decode engine rank (a batch of one
        when batching is off or nothing else matched)."""
        first = batch[0][0]
        rids = tuple(reg.request_id for reg, _ in batch)
        decode_id = first.decode_engine_id

        def fail(reason: FailureType, message: str, tell: str | None) -> None:
            for rid in rids:
                self._fail_send(rid, reason, message, tell)

        agents = self.registry.begin_transfer(decode_id)
        if agents is None:
            fail(
                FailureType.TRANSFER_SETUP_FAILED, f"No remote agents for engine {decode_id}", None
            )
            return
        agent: str | None = None
        try:
            agent = agents.get(self.tp_rank)
            if agent is None:
                raise TransportError(f"engine {decode_id} has no rank {self.tp_rank}")
            local: list[int] = []
            remote: list[int] = []
            for reg, send in batch:
                local += send.block_ids
                remote += reg.block_ids
            done = encode_notification(
                PushDone(
                    request_id=rids[0],
                    more_request_ids=list(rids[1:]),
                    prefill_engine_id=self.engine_id,
                    num_blocks=len(remote),
                )
            )
            timeout = min([self.config.transfer_timeout_s] + [r.write_timeout_s for r, _ in batch])
            now = self._clock()
            handle, state = self.transport.write_blocks(agent, local, remote, done)
        except Exception as exc:
            if agent is not None:
                self._transport_failed(decode_id, agent, exc)
            self.registry.end_transfer(decode_id)
            reason = (
                FailureType.TRANSFER_FAILED
                if isinstance(exc, TransportError)
                else FailureType.TRANSFER_SETUP_FAILED
            )
            fail(reason, str(exc), decode_id)
            return
        xfer = _InFlight(
            handle, decode_id, agent, now + timeout, now, len(local) * self.block_len, rids
        )
        if state == "DONE":  # shared-memory WRITEs often finish inside the post
            self._finish_transfer(xfer, "DONE", self._clock())
            return
        with self._state_lock:
            self._in_flight[rids[0]] = xfer
            for rid in rids:
                self._writing[rid] = decode_id

    def _poll_transfers(self, only: list[str] | None = None) -> int:
        """Polls WRITEs in flight (all, or `only`) once; returns how many ended, -1 if none."""
        with self._state_lock:
            if only is None:
                items = list(self._in_flight.items())
            else:
                items = [(r, self._in_flight[r]) for r in only if r in self._in_flight]
        if not items:
            return -1
        now = self._clock()
        ended = 0
        for rid, xfer in items:
            why, dropped = "WRITE failed", False
            try:
                state = self.transport.poll(xfer.handle)
            except TransportError as exc:  # NIXL says the decode's agent disconnected
                state, why, dropped = "ERR", str(exc), exc.kind == "disconnected"
            except Exception:
                log.exception("polling a WRITE")
                state = "ERR"
            if state == "PROC":
                if now < xfer.deadline or not self._abort(xfer, now):
                    continue
                state = "ERR"
            with self._state_lock:
                if self._in_flight.pop(rid, None) is None:
                    continue  # ended by stop()
                for r in xfer.request_ids:
                    self._writing.pop(r, None)
            ended += 1
            timed_out = now >= xfer.deadline and state != "DONE"
            self._finish_transfer(
                xfer,
                state,
                now,
                FailureType.TRANSFER_FAILED,
                "WRITE timed out" if timed_out else why,
                released=timed_out,
                dropped=dropped,
            )
        return ended

    def _abort(self, xfer: _InFlight, now: float) -> bool:
        """A WRITE past its deadline: True once it is released (aborted: nothing of it can
        land any more). One that cannot be released is watched on; after a further
        `transfer_timeout_s` it is given up all the same (counted, and logged)."""
        if self._release(xfer.handle):
            return True
        if xfer.abort_failed_at is None:
            xfer.abort_failed_at = now
            return False
        if now - xfer.abort_failed_at < self.config.transfer_timeout_s:
            return False
        log.error("WRITE %s to %s could not be aborted; giving it up", xfer.handle, xfer.agent_name)
        return True

    def _release(self, handle: XferHandle) -> bool:
        try:
            return self.transport.release(handle) is not False
        except Exception:
            log.exception("releasing a WRITE")
            return False

    def _finish_transfer(
        self,
        xfer: _InFlight,
        state: XferState,
        now: float,
        reason: FailureType = FailureType.TRANSFER_FAILED,
        message: str = "WRITE failed",
        *,
        released: bool = False,
        dropped: bool = False,
    ) -> None:
        """Releases a WRITE that ended (DONE, or ERR) and ends each of its requests: sent,
        or failed with `reason` (the decode engine told); the decode engine is unpinned
        whatever raises. Unless the engine stopped, the outcome counts for the decode
        engine's health (`dropped`: NIXL said its agent disconnected)."""
        try:
            if state == "DONE":
                self.registry.peer_succeeded(xfer.decode_engine_id, xfer.agent_name)
            elif reason != FailureType.SHUTDOWN:
                why = f"{message} (WRITE to {xfer.agent_name})"
                self._peer_failed(xfer.decode_engine_id, xfer.agent_name, why, dropped=dropped)
            if not released:
                self._release(xfer.handle)
        finally:
            self.registry.end_transfer(xfer.decode_engine_id)
        if state == "DONE":
            self.metrics.transfer_seconds.observe(now - xfer.started)
            self.metrics.transfer_bytes_total.inc(xfer.nbytes)
            with self._state_lock:
                for rid in xfer.request_ids:
                    self._keep_outcome(rid, _SendOutcome(True, xfer.decode_engine_id))
            for rid in xfer.request_ids:
                self._report("sent", rid)
        else:
            for rid in xfer.request_ids:
                self._fail_send(rid, reason, message, xfer.decode_engine_id)

    def _keep_outcome(self, rid: str, outcome: _SendOutcome) -> None:
        """Remembers how a prefill request ended (call under the lock), to answer a cancel."""
        self._send_outcomes[rid] = outcome
        if len(self._send_outcomes) > self._ended_cap:
            self._send_outcomes.popitem(last=False)

    def _fail_send(
        self, request_id: str, reason: FailureType, message: str, tell_engine: str | None = None
    ) -> None:
        """Fails a prefill-side request once and, best effort, tells the decode engine."""
        with self._state_lock:
            self._keep_outcome(request_id, _SendOutcome(False, tell_engine, reason, message))
        self.metrics.record_failure(
            reason, {"request_id": request_id, "engine_id": tell_engine or "", "msg": message}
        )
        self._report_failure(FailedRequest(request_id, reason, message))
        if tell_engine is not None:
            self._notify_fail(request_id, tell_engine, reason, message)

    def _notify_fail(
        self, request_id: str, decode_engine_id: str, reason: FailureType, message: str
    ) -> None:
        agent = self._rank_agent(decode_engine_id)
        if agent is None:
            return
        fail = PushFail(
            request_id=request_id,
            prefill_engine_id=self.engine_id,
            reason=reason,
            message=message[:200],
        )
        self._notify(agent, fail, request_id, decode_engine_id)

    def _expire(self, now: float) -> None:
        cancels: list[tuple[str, str]] = []
        unsent: list[str] = []
        given_up: list[tuple[str, _PendingRecv]] = []
        with self._state_lock:
            for rid, p in self._pending_recv.items():
                if p.deadline > now:
                    continue
                if not p.sent:
                    unsent.append(rid)
                elif not p.cancelling:
                    p.cancelling = True
                    cancels.append((rid, p.prefill_engine_id))
                elif p.give_up_at <= now:
                    # Decide at a later look, after one more pass of notifications: an
                    # answer may be queued behind a freeze of this process.
                    if p.overdue_since is None:
                        p.overdue_since = now
                    elif now - p.overdue_since >= 0.05:
                        given_up.append((rid, p))
            for rid, _ in given_up:
                del self._pending_recv[rid]
            sends = [r for r, p in self._pending_send.items() if p.deadline <= now]
            for r in sends:
                del self._pending_send[r]
            regs = [(k, pr) for k, pr in self._pending_reg.items() if pr.deadline <= now]
            for k, _ in regs:
                del self._pending_reg[k]
        timeout = f"no completion within {self.config.registration_timeout_s:g} s"
        for rid in unsent:  # the registration never left: nothing can land
            self._fail_recv(rid, FailureType.REGISTRATION_TIMEOUT, f"{timeout} (never sent)")
        for rid, prefill_id in cancels:
            self._send_cancel(rid, prefill_id)
        for rid, p in given_up:
            if p.agent:  # the prefill never answered: one more failed transfer of it
                why = f"request {rid} given up: the prefill did not answer its cancel"
                self._peer_failed(p.prefill_engine_id, p.agent, why, dropped=False)
            self._report_recv_failure(
                rid,
                p,
                p.cancel_reason,
                f"{self._why_given_up(p)}; the prefill engine did not answer the cancel",
            )
        for rid in sends:
            msg = f"no registration within the {self.config.kv_lease_s:g} s KV lease"
            self._fail_send(rid, FailureType.KV_EXPIRED, msg)
        for (decode_id, rid), pr in regs:
            # A registration for a request this prefill never had (within the lease).
            self.metrics.reject("orphan_registration")
            self._answer(
                pr.sender, rid, FailureType.REMOTE_REJECTED, "unknown request", verify_as=decode_id
            )
