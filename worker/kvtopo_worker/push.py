"""Push-mode KV transfer between one prefill and one decode engine rank.

Owns the request life cycle on both sides and the engine-thread API:

- decode side: `request_receive` queues a `PUSH_REG` registration; the writer thread takes a
  registry snapshot under the lock and sends it to every rank of the prefill engine outside
  the lock. No agents, or a send that fails, puts the request on `failed_requests`; the
  writer never fails a request itself. A registration never answered fails after
  `registration_timeout_s`.
- prefill side: `request_send` marks a request's blocks finished; the progress thread
  matches them with the registration when it arrives and WRITEs them into the decode
  engine's blocks with a `PUSH_DONE` completion notification; requests matched in the same
  pass for the same decode rank share one WRITE and one completion (bounded by
  `max_requests_per_write` and `max_bytes_per_write`), which saves the per-WRITE work of
  small requests. The decode engine is pinned in the registry for the transfer, so it
  cannot be evicted under it.
- `get_finished()` (engine thread) drains done sending, done receiving and failed requests.
  Every request ends exactly once: each producer claims the request by removing it from its
  pending table under `_state_lock` before reporting, and the engine thread drops (and
  counts) any second outcome.

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
    transfer_timeout_s: float = 30.0  # prefill: WRITE posted, not DONE yet
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
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, not {value}")


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
    deadline: float


@dataclass
class _PendingSend:
    block_ids: list[int]
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
        tp_rank: int = 0,
        block_len: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.tp_rank = tp_rank
        self.block_len = block_len
        self.transport = transport
        self.registry = registry
        self.metrics = metrics or WorkerMetrics()
        self.config = config or PushConfig()
        self._clock = clock
        # Background threads put failures here; only the engine thread drains it.
        self.failed_requests: queue.SimpleQueue[FailedRequest] = queue.SimpleQueue()
        self._finished_q: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._reg_q: queue.SimpleQueue[PushRegistration | None] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._pending_recv: dict[str, _PendingRecv] = {}
        self._pending_send: dict[str, _PendingSend] = {}
        self._pending_reg: dict[str, tuple[PushRegistration, float]] = {}
        self._in_flight: dict[str, _InFlight] = {}  # by the first request id of the WRITE
        self._writing: set[str] = set()  # every request id of the WRITEs in flight
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_cap = 200_000
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._outcome_ready = threading.Event()
        self._threads: list[threading.Thread] = []
        self.requests_done = 0
        self.requests_failed = 0
        self._next_deadline_check = 0.0
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
        self._stop.set()
        self._wake.set()
        self._reg_q.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    # --- engine-thread API ---------------------------------------------------------------

    def register_kv_caches(self, kv: Any) -> None:
        """Registers the engine's KV cache with the transport (NIXL memory registration)."""
        register = getattr(self.transport, "register_kv_cache", None)
        if register is None:
            raise TypeError("this transport cannot register KV caches")
        register(kv)
        self.block_len = int(getattr(self.transport, "block_len", self.block_len))

    def request_receive(
        self, request_id: str, prefill_engine_id: str, block_ids: Sequence[int]
    ) -> None:
        """Decode side: ask the prefill engine to push `request_id` into `block_ids`."""
        if self.role != "decode":
            raise RuntimeError("request_receive is the decode side's call")
        reg = PushRegistration(
            request_id=request_id,
            decode_engine_id=self.engine_id,
            prefill_engine_id=prefill_engine_id,
            block_ids=list(block_ids),
            decode_tp_rank=self.tp_rank,
        )
        with self._state_lock:
            if request_id in self._pending_recv or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            self._pending_recv[request_id] = _PendingRecv(
                prefill_engine_id, reg.block_ids, self._clock() + self.config.registration_timeout_s
            )
        self._reg_q.put(reg)
        _signal(self._wake)

    def request_send(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Prefill side: the request's KV is in `block_ids`; push it when D registers."""
        if self.role != "prefill":
            raise RuntimeError("request_send is the prefill side's call")
        with self._state_lock:
            if request_id in self._pending_send or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            self._pending_send[request_id] = _PendingSend(
                list(block_ids), self._clock() + self.config.kv_lease_s
            )
        _signal(self._wake)

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

    # --- decode side: the registration writer --------------------------------------------

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            reg = self._reg_q.get()
            if reg is None:
                return
            try:
                self.send_registration(reg)
            except Exception as exc:  # never let one request kill the writer
                log.exception("registration writer")
                self._fail_recv(reg.request_id, FailureType.PUSH_REG_NOTIF_FAILED, repr(exc))

    def send_registration(self, reg: PushRegistration) -> None:
        """Sends `reg` to every rank of the prefill engine (writer thread).

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
        payload = encode_notification(reg)
        for rank, agent_name in sorted(agents.items()):
            try:
                self.transport.send_notif(agent_name, payload)
            except TransportError as exc:
                self._fail_recv(
                    reg.request_id,
                    FailureType.PUSH_REG_NOTIF_FAILED,
                    f"sending registration to rank {rank} ({agent_name}): {exc}",
                )
                return
        self.registry.touch(reg.prefill_engine_id)

    def _fail_recv(self, request_id: str, reason: FailureType, message: str) -> None:
        with self._state_lock:
            pending = self._pending_recv.pop(request_id, None)
        if pending is None:
            return  # already ended (completed or timed out): exactly once
        self.metrics.record_failure(
            reason,
            {"request_id": request_id, "engine_id": pending.prefill_engine_id, "msg": message},
        )
        self._report_failure(FailedRequest(request_id, reason, message))

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
        regs: list[PushRegistration] = []
        for agent_name, data in notifs:
            msg = self._on_notification(agent_name, data)
            if msg is not None:
                regs.append(msg)
        if not regs:
            return
        # A decode engine whose registrations arrive is in use (the idle-TTL backstop).
        for engine_id in {msg.decode_engine_id for msg in regs}:
            self.registry.touch(engine_id)
        deadline = self._clock() + self.config.kv_lease_s
        duplicates = 0
        with self._state_lock:
            for msg in regs:
                if msg.request_id in self._writing or msg.request_id in self._ended:
                    duplicates += 1
                else:
                    self._pending_reg[msg.request_id] = (msg, deadline)
        for _ in range(duplicates):
            self.metrics.reject("notification")

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
            return msg
        if isinstance(msg, PushDone):
            rids = msg.request_ids
            with self._state_lock:
                claimed = [r for r in rids if self._pending_recv.pop(r, None) is not None]
            if len(claimed) < len(rids):
                self.metrics.reject("notification")  # late (timed out) or unknown
            for rid in claimed:
                self._report("recv", rid)
            return None
        self._fail_recv(msg.request_id, msg.reason, f"prefill refused: {msg.message}")
        return None

    def _start_matched_transfers(self) -> None:
        with self._state_lock:
            matched = [rid for rid in self._pending_reg if rid in self._pending_send]
            work = [(self._pending_reg.pop(r)[0], self._pending_send.pop(r)) for r in matched]
        batch: list[tuple[PushRegistration, _PendingSend]] = []
        nbytes = 0
        for reg, send in work:
            if len(reg.block_ids) != len(send.block_ids):
                msg = (
                    f"decode offered {len(reg.block_ids)} blocks, request has {len(send.block_ids)}"
                )
                self._fail_send(
                    reg.request_id, FailureType.TRANSFER_SETUP_FAILED, msg, reg.decode_engine_id
                )
                continue
            size = len(send.block_ids) * self.block_len
            if batch and (
                (reg.decode_engine_id, reg.decode_tp_rank)
                != (batch[0][0].decode_engine_id, batch[0][0].decode_tp_rank)
                or len(batch) >= self.config.max_requests_per_write
                or nbytes + size > self.config.max_bytes_per_write
            ):
                self._start_transfer(batch)
                batch, nbytes = [], 0
            batch.append((reg, send))
            nbytes += size
        if batch:
            self._start_transfer(batch)

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
        agent = agents.get(first.decode_tp_rank)
        if agent is None:
            self.registry.end_transfer(decode_id)
            fail(
                FailureType.TRANSFER_SETUP_FAILED,
                f"engine {decode_id} has no rank {first.decode_tp_rank}",
                None,
            )
            return
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
        now = self._clock()
        try:
            handle, state = self.transport.write_blocks(agent, local, remote, done)
        except TransportError as exc:
            self.registry.end_transfer(decode_id)
            fail(FailureType.TRANSFER_FAILED, str(exc), decode_id)
            return
        xfer = _InFlight(
            handle,
            decode_id,
            agent,
            now + self.config.transfer_timeout_s,
            now,
            len(local) * self.block_len,
            rids,
        )
        if state == "DONE":  # shared-memory WRITEs often finish inside the post
            self._end_transfer(xfer, "DONE", self._clock())
            return
        with self._state_lock:
            self._in_flight[rids[0]] = xfer
            self._writing.update(rids)

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
            state = self.transport.poll(xfer.handle)
            if state == "PROC" and now < xfer.deadline:
                continue
            ended += 1
            with self._state_lock:
                self._in_flight.pop(rid, None)
                self._writing.difference_update(xfer.request_ids)
            self._end_transfer(xfer, state, now)
        return ended

    def _end_transfer(self, xfer: _InFlight, state: XferState, now: float) -> None:
        """Releases a WRITE that ended (DONE, ERR, or PROC past its deadline) and ends each
        of its requests: sent, or failed with the reason (and the decode engine told)."""
        try:
            self.transport.release(xfer.handle)
        finally:
            self.registry.end_transfer(xfer.decode_engine_id)
        if state == "DONE":
            self.metrics.transfer_seconds.observe(now - xfer.started)
            self.metrics.transfer_bytes_total.inc(xfer.nbytes)
            for rid in xfer.request_ids:
                self._report("sent", rid)
        else:
            why = "WRITE failed" if state == "ERR" else "WRITE timed out"
            for rid in xfer.request_ids:
                self._fail_send(rid, FailureType.TRANSFER_FAILED, why, xfer.decode_engine_id)

    def _fail_send(
        self, request_id: str, reason: FailureType, message: str, tell_engine: str | None = None
    ) -> None:
        """Fails a prefill-side request once and, best effort, tells the decode engine."""
        self.metrics.record_failure(
            reason, {"request_id": request_id, "engine_id": tell_engine or "", "msg": message}
        )
        self._report_failure(FailedRequest(request_id, reason, message))
        if tell_engine is not None:
            self._notify_fail(request_id, tell_engine, reason, message)

    def _notify_fail(
        self, request_id: str, decode_engine_id: str, reason: FailureType, message: str
    ) -> None:
        for agent in self.registry.snapshot(decode_engine_id).values():
            payload = encode_notification(
                PushFail(
                    request_id=request_id,
                    prefill_engine_id=self.engine_id,
                    reason=reason,
                    message=message[:200],
                )
            )
            try:
                self.transport.send_notif(agent, payload)
            except TransportError as exc:
                self.metrics.record_failure(
                    FailureType.NOTIFICATION_FAILED,
                    {"request_id": request_id, "engine_id": decode_engine_id, "msg": str(exc)},
                    level=logging.INFO,
                )

    def _expire(self, now: float) -> None:
        with self._state_lock:
            recv = [r for r, p in self._pending_recv.items() if p.deadline <= now]
            sends = [r for r, p in self._pending_send.items() if p.deadline <= now]
            for r in sends:
                del self._pending_send[r]
            regs = [(r, reg) for r, (reg, dl) in self._pending_reg.items() if dl <= now]
            for r, _ in regs:
                del self._pending_reg[r]
        for rid in recv:
            self._fail_recv(
                rid,
                FailureType.REGISTRATION_TIMEOUT,
                f"no completion within {self.config.registration_timeout_s:g} s",
            )
        for rid in sends:
            msg = f"no registration within the {self.config.kv_lease_s:g} s KV lease"
            self._fail_send(rid, FailureType.KV_EXPIRED, msg)
        for rid, reg in regs:
            # A registration for a request this prefill never had: tell decode, count it.
            self.metrics.reject("orphan_registration")
            self._notify_fail(
                rid, reg.decode_engine_id, FailureType.REMOTE_REJECTED, "unknown request"
            )
