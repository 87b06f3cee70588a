"""What both halves of a push share: configuration, outcomes, notifications, peer health and
the progress thread.

Owns `PushConfig`, the outcome queues the engine thread drains (`get_finished`: done sending,
done receiving, failed; each request exactly once, a second outcome dropped and counted), the
one way a notification is sent (`_notify`: a failure is counted, never raised), what every
NIXL call says of a peer's health (`_transport_failed`), and the progress loop that paces
itself by the load. `PushConnector` is the base of the two halves, `decode.DecodePush` and
`prefill.PrefillPush` (`both.BothPush` runs the two for a kv_both engine); `new_connector`
builds the one a role needs. The halves keep each
request's phase in records moved only through the tables of `lifecycle`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    MAX_REQUESTS_PER_WRITE,
    FailureType,
    MalformedMessage,
    Notification,
    PushHello,
    Role,
    decode_notification,
    encode_notification,
)
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.transport import KVTransport, TransportError

log = logging.getLogger("kvtopo_worker.push")

# The notification path's per-sender budget: each pass handles at most this many
# notifications of one sender agent (the rest wait in that agent's queue, handled in later
# passes), so another agent's registration waits for at most this many of a flooder's
# messages, never for the flood.
NOTIFS_PER_SENDER_PER_PASS = 32
# What one sender agent may have waiting; beyond it its notifications are dropped and
# counted (an honest peer sends one registration or cancel per request it holds, far fewer).
MAX_QUEUED_PER_SENDER = 16384


@dataclass(frozen=True)
class PushConfig:
    """Timing and bounds of the push path. Defaults suit a real engine; tests shorten them."""

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
    # Prefill: what it keeps for one decode agent at most (registrations waiting for their
    # KV, and cancels that came first), beyond which a registration is refused at once.
    max_held_per_peer: int = 16384
    # Greet every peer agent added (PUSH_HELLO) and, on a decode, send a registration only
    # to a prefill agent that has greeted this engine (it holds our agent, so what we send
    # counts there). Off only where no peer can greet: unit tests' fakes, the benchmarks of
    # the registration writer alone.
    greet_peers: bool = True

    def __post_init__(self) -> None:
        """Refuses a configuration the protocol cannot carry or that never ends a request."""
        if not 1 <= self.max_requests_per_write <= MAX_REQUESTS_PER_WRITE:
            raise ValueError(
                f"max_requests_per_write must be 1..{MAX_REQUESTS_PER_WRITE} (one completion "
                f"names at most that many requests), not {self.max_requests_per_write}"
            )
        if self.max_bytes_per_write < 1:
            raise ValueError(f"max_bytes_per_write must be >= 1, not {self.max_bytes_per_write}")
        if self.max_held_per_peer < 1:
            raise ValueError(f"max_held_per_peer must be >= 1, not {self.max_held_per_peer}")
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


def signal_event(event: threading.Event) -> None:
    """Sets `event` unless it is set already (a set takes a lock and notifies). Safe for
    the connector's events because their waiters clear them before reading the state that
    the signal announces, and that state is written before the signal."""
    if not event.is_set():
        event.set()


class PushConnector:
    """The worker side of push-mode KV transfer for one engine rank (the shared part; see
    `decode.DecodePush` and `prefill.PrefillPush`)."""

    role: Role

    def __init__(
        self,
        *,
        engine_id: str,
        transport: KVTransport,
        registry: EngineRegistry,
        metrics: WorkerMetrics | None = None,
        config: PushConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tp_rank: int = 0,
        block_len: int = 0,
        outcome_ready: threading.Event | None = None,
        part_of: PushConnector | None = None,
    ) -> None:
        """`outcome_ready` is set whenever an outcome is queued; ranks of one engine may
        share one, so that one engine thread waits on all of them. `part_of`: the
        `both.BothPush` this half belongs to, which runs the threads and hears the registry
        for both halves (they share its stop and wake events)."""
        self.engine_id = engine_id
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
        self._state_lock = threading.Lock()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_cap = 200_000
        self._stop: threading.Event = part_of._stop if part_of else threading.Event()
        self._wake: threading.Event = part_of._wake if part_of else threading.Event()
        self._outcome_ready = outcome_ready or threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.requests_done = 0
        self.requests_failed = 0
        self._next_deadline_check = 0.0
        self._missing_agents: set[tuple[str, str]] = set()  # unknown to NIXL at the last check
        # Notifications taken from NIXL, not handled yet: per sender agent, in arrival order
        # (only the progress thread touches it). Senders are agents the transport holds a
        # pair key for, so their number is bounded by the peers held.
        self._inbox: dict[str, deque[bytes]] = {}
        # Label lookups cost a lock and a dict probe per call: bind the children once.
        self._requests_total = {
            o: self.metrics.requests_total.labels(o) for o in ("done", "failed")
        }
        self._init_side()
        if part_of is None:
            registry.add_listener(self)

    def _init_side(self) -> None:
        """The half's own state (called by `__init__`, before the registry tells it anything)."""

    # --- life cycle ----------------------------------------------------------------------

    def _thread_targets(self) -> list[tuple[str, Callable[[], None]]]:
        return [("progress", self._progress_loop)]

    def start(self) -> None:
        """Starts the background threads (the progress thread; on a decode, also the
        registration writer)."""
        if self._threads:
            return
        for name, target in self._thread_targets():
            t = threading.Thread(target=target, name=f"kvtopo-{name}-{self.engine_id[:8]}")
            t.daemon = True
            t.start()
            self._threads.append(t)

    def _wake_threads(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the threads, then ends every request still pending as failed with reason
        `shutdown` and tells the peers (`_stop_pending`). The outcomes wait in the queues
        for a last `get_finished()`."""
        self._stop.set()
        self._wake_threads()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
        self.registry.remove_listener(self)
        self._stop_pending("the engine stopped")

    def _stop_pending(self, why: str) -> None:
        raise NotImplementedError

    # --- registry events -------------------------------------------------------------------

    def agents_added(self, engine_id: str, agents: Mapping[int, str]) -> None:
        """A peer's agents entered the registry: greet the one of our rank (PUSH_HELLO)."""
        agent = agents.get(self.tp_rank)
        if agent is not None and self.config.greet_peers:
            self._notify(agent, PushHello(engine_id=self.engine_id), "", engine_id)

    def _on_hello(self, agent: str, msg: PushHello) -> None:
        """A peer's agent greeted us: it holds our agent. Answered (once) so that the side
        that added the other first hears it too."""
        engine = self._sender(agent)
        if engine is None or engine != msg.engine_id:
            self.metrics.reject("notification")
            return
        self._greeted(agent, engine)
        if not msg.ack:
            self._notify(agent, PushHello(engine_id=self.engine_id, ack=True), "", engine)

    def _greeted(self, agent: str, engine_id: str) -> None:
        """`agent` (of `engine_id`, our rank) holds our agent (a half may flush to it)."""

    def agents_removed(self, engine_id: str, agents: Mapping[int, str]) -> None:
        """A peer's agents left (their process was evicted or replaced)."""

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
        prompt_digest: str = "",
    ) -> None:
        """Decode side: ask the prefill engine to push `request_id` into `block_ids`."""
        raise RuntimeError("request_receive is the decode side's call")

    def request_send(
        self,
        request_id: str,
        block_ids: Sequence[int],
        decode_engine_id: str | None = None,
        *,
        alias: str = "",
        prompt_digest: str = "",
    ) -> None:
        """Prefill side: the request's KV is in `block_ids`; `alias`: another name a
        decode may know it by (the id a P/D router gave it), checked by `prompt_digest`."""
        raise RuntimeError("request_send is the prefill side's call")

    def abandon(self, request_id: str, reason: FailureType, message: str) -> None:
        """The engine gives a request up (an abort, its drain deadline): it ends with
        `reason` as soon as no WRITE of it can land, through `get_finished()`."""
        raise NotImplementedError

    def flush_registrations(self) -> int:
        """Decode side: sends the registrations queued so far on the calling thread."""
        return 0

    def writing(self, request_id: str) -> bool:
        """Prefill side: whether a WRITE of `request_id` is in flight now."""
        return False

    def in_flight(self) -> int:
        """Requests taken that have not ended yet."""
        raise NotImplementedError

    def settles_within(self) -> float:
        """Seconds until every request taken can have ended by this half's own bounds
        (the last moment a WRITE of it could land, and the margin after it); 0 when none
        is pending."""
        return 0.0

    def wait_finished(self, timeout: float) -> bool:
        """Blocks the engine thread until an outcome may be ready (or `timeout` passes)."""
        ready = self._outcome_ready.wait(timeout)
        self._outcome_ready.clear()
        return ready

    def _report(self, kind: str, request_id: str) -> None:
        self._finished_q.put((kind, request_id))
        signal_event(self._outcome_ready)

    def _report_failure(self, failed: FailedRequest) -> None:
        self.failed_requests.put(failed)
        signal_event(self._outcome_ready)

    def _record_and_report(
        self, request_id: str, engine_id: str, reason: FailureType, message: str
    ) -> None:
        """Counts and logs a request's failure once, and queues it for the engine thread."""
        self.metrics.record_failure(
            reason, {"request_id": request_id, "engine_id": engine_id, "msg": message}
        )
        self._report_failure(FailedRequest(request_id, reason, message))

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
        """Sends one notification to exactly `agent`; a failure is counted (it is a courtesy
        or an answer the peer's own deadline covers), never raised."""
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

    def _sender(self, agent_name: str) -> str | None:
        """The engine whose *current* agent of our rank `agent_name` is; None for an agent
        never added, one evicted or replaced since, or another rank's."""
        owner = self.registry.owner_of(agent_name)
        if owner is None or owner[1] != self.tp_rank:
            return None
        if self.registry.current_agent(owner[0], self.tp_rank) != agent_name:
            return None
        return owner[0]

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

    # --- the progress thread -------------------------------------------------------------

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
        """One pass: notifications (each sender's in the order they came, at most
        `NOTIFS_PER_SENDER_PER_PASS` of one sender per pass), the half's own work (matches
        and WRITE polls on a prefill), deadlines.

        Returns the load that paces the next pass: "transferring", "waiting" or "idle"
        (notifications still queued count as "transferring": the next pass comes at once).
        """
        self._take_notifications()
        backlog = self._handle_notifications()
        self._progress_side()
        now = self._clock()
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + self.config.deadline_check_s
            self._expire(now)
        return "transferring" if backlog else self._load()

    def _take_notifications(self) -> None:
        """Moves what NIXL holds for us into the senders' queues; a sender's beyond
        `MAX_QUEUED_PER_SENDER` are dropped and counted."""
        inbox = self._inbox

        def room(agent_name: str, waiting: int) -> int:
            queued = inbox.get(agent_name)
            free = MAX_QUEUED_PER_SENDER - (len(queued) if queued is not None else 0)
            if waiting <= free:
                return waiting
            self.metrics.reject("notification_backlog", waiting - max(free, 0))
            self.metrics.warn_limited(
                "backlog",
                "agent %s has %d notifications waiting here: %d more dropped",
                agent_name,
                MAX_QUEUED_PER_SENDER - free,
                waiting - max(free, 0),
            )
            return max(free, 0)

        for agent_name, data in self.transport.get_notifs(room):
            queued = inbox.get(agent_name)
            if queued is None:
                queued = inbox[agent_name] = deque()
            queued.append(data)

    def _handle_notifications(self) -> bool:
        """One round over the senders with something queued, each handled up to its budget;
        whether any still has notifications waiting."""
        inbox = self._inbox
        for agent_name in list(inbox):
            queued = inbox[agent_name]
            for _ in range(min(len(queued), NOTIFS_PER_SENDER_PER_PASS)):
                self._handle_notification(agent_name, queued.popleft())
            if not queued:
                del inbox[agent_name]
        return bool(inbox)

    def _handle_notification(self, agent_name: str, data: bytes) -> None:
        try:
            msg = decode_notification(data)
        except MalformedMessage as exc:
            self.metrics.reject("notification")
            self.metrics.warn_limited(
                "malformed",
                "dropped malformed notification from %s: %s",
                agent_name,
                exc.message,
            )
            return
        try:
            if isinstance(msg, PushHello):
                self._on_hello(agent_name, msg)
            else:
                self._on_message(agent_name, msg)
        except Exception:  # nothing a peer sends may stop the pass
            self.metrics.reject("notification")
            log.exception("handling a notification from %s", agent_name)

    def queued_notifications(self) -> int:
        """Notifications taken from NIXL and not handled yet (all senders)."""
        return sum(len(q) for q in list(self._inbox.values()))

    def _on_message(self, agent_name: str, msg: Notification) -> None:
        """One decoded notification (not a greeting) from `agent_name`, in arrival order;
        a kind the half does not receive is counted and dropped."""
        raise NotImplementedError

    def _progress_side(self) -> None:
        """The half's own work in a pass (nothing on a decode)."""

    def _expire(self, now: float) -> None:
        raise NotImplementedError

    def _load(self) -> str:
        raise NotImplementedError


def new_connector(
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
) -> PushConnector:
    """The push half a `role` needs (both halves for `both`), for one engine rank."""
    from kvtopo_worker.push.both import BothPush
    from kvtopo_worker.push.decode import DecodePush
    from kvtopo_worker.push.prefill import PrefillPush

    cls: type[PushConnector] = {"decode": DecodePush, "prefill": PrefillPush, "both": BothPush}[
        role
    ]
    return cls(
        engine_id=engine_id,
        transport=transport,
        registry=registry,
        metrics=metrics,
        config=config,
        clock=clock,
        wall_clock=wall_clock,
        tp_rank=tp_rank,
        block_len=block_len,
        outcome_ready=outcome_ready,
    )
