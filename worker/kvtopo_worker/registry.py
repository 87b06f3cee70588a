"""The remote-engine registry: which NIXL agents this worker may talk to, right now.

Owns `engine_id -> {rank: agent_name}` and its reverse (which engine owns an agent), the
in-flight handshake futures (at most one per engine), the per-engine count of transfers in
flight, the idle clock, and the agents still being torn down, all guarded by one RLock
(`EngineRegistry.lock`). The rules that close vLLM's X1 race:

- readers take a snapshot under the lock and do their slow NIXL work outside it;
- eviction pops under the lock and tears the agents down outside it, so a sender that
  already holds a snapshot either finished before the pop or fails cleanly afterwards;
- an engine with a transfer in flight is never evicted: the eviction is deferred and runs
  when the last transfer ends; asking for the engine again cancels the deferred eviction;
- an agent belongs to one engine: its name stays reserved until its teardown has finished,
  and a handshake that would load it again waits for that first (`wait_released`), so the
  registry and NIXL never disagree about which agents exist.

Also owns each held engine's health as this worker sees it (`PeerHealth`): `dropped` once
NIXL said its agent disconnected, `failing` after `failing_after` failed transfers in a row
(a success starts the count again), each recorded against the agent the transfer used, so
a failure of an agent replaced since says nothing of its successor. Only a renewal (the
engine evicted and added again) makes a dropped engine ok.

Called by `push` (senders, transfers), `agent` (handshakes, operator-driven eviction) and the
idle-TTL backstop. NIXL teardown is injected (`remove_agent`), so this module needs no nixl.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

from kvtopo_worker.protocol import MAX_HEALTH_REASON, PeerHealth, PeerState

log = logging.getLogger(__name__)

EvictResult = Literal["evicted", "deferred", "absent"]
FORMER_AGENTS_KEPT = 4096  # torn-down agents whose notifications are still attributed
_NO_AGENTS: Mapping[int, str] = MappingProxyType({})


@dataclass
class _Engine:
    # Copy-on-write: replaced, never changed in place, so a reader is handed a read-only
    # view of it (no copy under the lock) that no later change can alter.
    agents: dict[int, str]
    last_used: float
    transfers_in_flight: int = 0
    eviction_pending: bool = False
    eviction_reason: str = ""
    ranks_pending: set[int] = field(default_factory=set)  # ranks whose eviction is deferred
    incarnation: str = ""  # the engine process the agents belong to
    health: PeerHealth = "ok"
    health_reason: str = ""
    failures_in_a_row: int = 0  # failed transfers since the last success


class RegistryListener(Protocol):
    """Told (outside the lock, on the thread that changed the registry) when agents enter
    and when they have left (their NIXL teardown has finished): the push connectors greet a
    new peer's agent and forget what an agent that left had pending with them."""

    def agents_added(self, engine_id: str, agents: Mapping[int, str]) -> None: ...

    def agents_removed(self, engine_id: str, agents: Mapping[int, str]) -> None: ...


class AgentConflict(Exception):
    """An agent that belongs to another engine (a peer carrying someone else's identity)."""


class EngineRegistry:
    """Lock-guarded map of remote engines to their NIXL agents.

    `remove_agent` is called (outside the lock) once for every agent that leaves the
    registry; `clock` is injectable for tests; `idle_ttl_s` > 0 turns on the idle backstop
    (same meaning as vLLM's `engine_ttl`), 0 leaves eviction to the operator. It may be
    changed while the engine runs (`PUT /v1/settings`): `evict_idle` reads it on every call.
    `failing_after` failed transfers in a row make a held engine `failing`.
    """

    def __init__(
        self,
        *,
        remove_agent: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        idle_ttl_s: float = 0.0,
        on_evicted: Callable[[str, dict[int, str]], None] | None = None,
        failing_after: int = 3,
    ) -> None:
        if idle_ttl_s < 0:
            raise ValueError("idle_ttl_s must be >= 0 (0 turns the backstop off)")
        if failing_after < 1:
            raise ValueError(f"failing_after must be >= 1, not {failing_after}")
        self.failing_after = failing_after
        # One RLock for the agent map, the handshake futures and the in-flight counts.
        # Public so that regression tests can hold it and prove who waits on it.
        self.lock = threading.RLock()
        self._engines: dict[str, _Engine] = {}
        self._handshakes: dict[str, Future[dict[int, str]]] = {}
        # agent name -> (engine id, rank), from its add until its teardown has finished
        self._owners: dict[str, tuple[str, int]] = {}
        # Agents popped and not torn down yet; the Event is made only for a handshake that
        # waits on one (`wait_released`): an eviction of 8 ranks used to make 8 Events
        # (a Condition and a lock each) nobody waited on, the churn benchmark's main cost.
        self._releasing: dict[str, threading.Event | None] = {}
        self._former: OrderedDict[str, tuple[str, int]] = OrderedDict()  # torn down, recent
        self._remove_agent = remove_agent
        self._on_evicted = on_evicted
        self._clock = clock
        self.idle_ttl_s = idle_ttl_s
        self.teardown_errors = 0
        self.evictions = 0
        self._listeners: list[RegistryListener] = []

    def add_listener(self, listener: RegistryListener) -> None:
        with self.lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: RegistryListener) -> None:
        with self.lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _tell(self, added: bool, engine_id: str, agents: Mapping[int, str]) -> None:
        if not self._listeners:  # none registered (an unlocked read: one may be joining)
            return
        with self.lock:
            listeners = list(self._listeners)
        agents = MappingProxyType(agents)  # theirs to read, not to change
        for listener in listeners:
            try:
                if added:
                    listener.agents_added(engine_id, agents)
                else:
                    listener.agents_removed(engine_id, agents)
            except Exception:
                log.exception("a registry listener failed on engine %s", engine_id)

    # --- reads ---------------------------------------------------------------------------

    def snapshot(self, engine_id: str) -> Mapping[int, str]:
        """The engine's agents as they are now (empty when unknown): a read-only view that
        no later change alters (the registry replaces an engine's agents, never edits them),
        so the lock is held for a lookup, not a copy (and no call: see `use`)."""
        engines = self._engines
        with self.lock:
            try:
                agents = engines[engine_id].agents
            except KeyError:
                return _NO_AGENTS
        return MappingProxyType(agents)

    def current_agent(self, engine_id: str, rank: int) -> str | None:
        """The agent `engine_id` holds for `rank` now (None when absent, or being evicted)."""
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.eviction_pending or rank in eng.ranks_pending:
                return None
            return eng.agents.get(rank)

    def engine_ids(self) -> list[str]:
        with self.lock:
            return sorted(self._engines)

    def agent_owner(self, agent_name: str) -> str | None:
        """The engine an agent belongs to (also while its teardown runs), or None."""
        with self.lock:
            owner = self._owners.get(agent_name)
        return owner[0] if owner is not None else None

    def owner_of(self, agent_name: str) -> tuple[str, int] | None:
        """(engine id, rank) an agent belongs to, or belonged to until a recent eviction:
        who a notification from it comes from (a WRITE's completion may arrive after its
        engine was evicted). None for an agent never added."""
        with self.lock:
            return self._owners.get(agent_name) or self._former.get(agent_name)

    def wait_released(self, agent_name: str, timeout: float) -> bool:
        """Waits until a popped agent's teardown has finished; False on timeout."""
        with self.lock:
            if agent_name not in self._releasing:
                return True
            event = self._releasing[agent_name]
            if event is None:
                event = self._releasing[agent_name] = threading.Event()
        return event.wait(timeout)

    def incarnation(self, engine_id: str) -> str | None:
        """The incarnation the engine's agents were added under; None when it is absent."""
        with self.lock:
            eng = self._engines.get(engine_id)
            return eng.incarnation if eng is not None else None

    def claim_present(self, engine_id: str) -> Mapping[int, str]:
        """The engine's agents when it is present (empty otherwise); being asked for, it is
        in use: a deferred eviction is cancelled and its idle clock restarts."""
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                return _NO_AGENTS
            eng.eviction_pending = False
            eng.ranks_pending.clear()
            eng.last_used = self._clock()
            return MappingProxyType(eng.agents)

    def __contains__(self, engine_id: object) -> bool:
        with self.lock:
            return engine_id in self._engines

    def peer_states(self) -> list[PeerState]:
        now = self._clock()
        with self.lock:
            return [
                PeerState(
                    engine_id=eid,
                    agents=dict(eng.agents),
                    transfers_in_flight=eng.transfers_in_flight,
                    eviction_pending=eng.eviction_pending,
                    idle_s=round(max(0.0, now - eng.last_used), 3),
                    incarnation=eng.incarnation,
                    health=eng.health,
                    health_reason=eng.health_reason,
                )
                for eid, eng in sorted(self._engines.items())
            ]

    # --- health --------------------------------------------------------------------------

    def health(self, engine_id: str) -> tuple[PeerHealth, str] | None:
        """(health, reason) of a held engine; None when it is absent."""
        with self.lock:
            eng = self._engines.get(engine_id)
            return (eng.health, eng.health_reason) if eng is not None else None

    def agents_of_rank(self, rank: int) -> list[tuple[str, str]]:
        """(engine id, agent name) of every held engine's agent of `rank`."""
        with self.lock:
            return [
                (eid, eng.agents[rank]) for eid, eng in self._engines.items() if rank in eng.agents
            ]

    def peer_failed(
        self, engine_id: str, agent_name: str, reason: str, *, dropped: bool = False
    ) -> PeerHealth | None:
        """Records a failed transfer (a WRITE, a registration, a notification) through
        `agent_name` of `engine_id`: `dropped` when NIXL said the remote disconnected (the
        engine is dropped at once), else one more failure in a row (`failing` at
        `failing_after`). Ignored when the engine no longer has that agent (replaced since).
        Returns the health the engine moved to; None when it did not change."""
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None or agent_name not in eng.agents.values():
                return None
            eng.failures_in_a_row += 1
            if dropped:
                health: PeerHealth = "dropped"
            elif eng.failures_in_a_row >= self.failing_after and eng.health == "ok":
                health = "failing"
            else:
                return None
            if eng.health == health:
                return None
            eng.health, eng.health_reason = health, reason[:MAX_HEALTH_REASON]
            count = eng.failures_in_a_row
        log.warning(
            "peer %s is %s (%d failed transfers in a row): %s", engine_id, health, count, reason
        )
        return health

    def peer_succeeded(self, engine_id: str, agent_name: str) -> PeerHealth | None:
        """Records a transfer through `agent_name` of `engine_id` that succeeded: the count
        of failures starts again, and a `failing` engine is ok again (a `dropped` one stays
        dropped: NIXL does not reconnect a disconnected agent; only a renewal helps).
        Returns "ok" when the engine was failing; None when nothing changed."""
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None or agent_name not in eng.agents.values():
                return None
            eng.failures_in_a_row = 0
            if eng.health != "failing":
                return None
            eng.health, eng.health_reason = "ok", ""
        log.info("peer %s is ok again: a transfer succeeded", engine_id)
        return "ok"

    # --- handshakes ----------------------------------------------------------------------

    def add_engine(self, engine_id: str, agents: Mapping[int, str], incarnation: str = "") -> bool:
        """Records the engine's agents (of its process `incarnation`); returns False when it
        was already present.

        A re-add while an eviction is pending cancels the eviction: the operator has decided
        the engine is wanted again (the same process, so the same agents). Agents of another
        incarnation of a present engine are refused (AgentConflict): the old incarnation's
        agents must be evicted first.
        """
        if not agents:
            raise ValueError("an engine needs at least one agent")
        added = dict(agents)  # ours: the caller's mapping may change after the call
        with self.lock:
            held = self._engines.get(engine_id)
            if held is not None and held.incarnation != incarnation:
                raise AgentConflict(
                    f"engine {engine_id} is held under incarnation {held.incarnation!r}, "
                    f"not {incarnation!r}: evict it first"
                )
            owners = self._owners
            for name in added.values():
                owner = owners.get(name)
                if owner is not None and owner[0] != engine_id:
                    raise AgentConflict(f"agent {name} belongs to engine {owner[0]}")
            for rank, name in added.items():
                owners[name] = (engine_id, rank)
            if held is None:
                self._engines[engine_id] = _Engine(
                    agents=added, last_used=self._clock(), incarnation=incarnation
                )
                new = True
            else:
                held.agents = {**held.agents, **added}
                held.eviction_pending = False
                held.ranks_pending.difference_update(added)
                held.last_used = self._clock()
                new = False
        self._tell(True, engine_id, added)
        return new

    def handshake(
        self, engine_id: str, start: Callable[[], Future[dict[int, str]]]
    ) -> Future[dict[int, str]]:
        """At most one handshake per engine: joins the one in flight or starts one.

        `start` must only submit the work (e.g. to the single NIXL executor) and return its
        future; it runs under the lock. The future is forgotten when it completes.
        """
        with self.lock:
            fut = self._handshakes.get(engine_id)
            if fut is not None and not fut.done():
                return fut
            fut = start()
            self._handshakes[engine_id] = fut

        def _forget(done: Future[dict[int, str]]) -> None:
            with self.lock:
                if self._handshakes.get(engine_id) is done:
                    del self._handshakes[engine_id]

        fut.add_done_callback(_forget)
        return fut

    def handshakes_in_flight(self) -> int:
        with self.lock:
            return sum(1 for f in self._handshakes.values() if not f.done())

    # --- transfers -----------------------------------------------------------------------

    def begin_transfer(self, engine_id: str) -> Mapping[int, str] | None:
        """Pins the engine for one transfer: the agents new transfers may use (not those of
        ranks being evicted); None when it is absent or being evicted."""
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None or eng.eviction_pending:
                return None
            eng.transfers_in_flight += 1
            eng.last_used = self._clock()
            if not eng.ranks_pending:
                return MappingProxyType(eng.agents)
            return {r: a for r, a in eng.agents.items() if r not in eng.ranks_pending}

    def end_transfer(self, engine_id: str) -> None:
        """Unpins; runs a deferred eviction when this was the last transfer in flight."""
        popped: dict[int, str] | None = None
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                return
            eng.transfers_in_flight = max(0, eng.transfers_in_flight - 1)
            eng.last_used = self._clock()
            if eng.transfers_in_flight == 0:
                if eng.eviction_pending or eng.ranks_pending >= set(eng.agents):
                    popped = self._pop(engine_id)
                elif eng.ranks_pending:
                    popped = self._pop_ranks(eng, eng.ranks_pending)
        if popped:
            self._teardown(engine_id, popped)

    def use(self, engine_id: str, rank: int) -> str | None:
        """The engine's agent of `rank` (None when absent), the engine marked used now: a
        registration writer's one pass under the lock (a snapshot then a `touch` took it
        twice per registration).

        The lock is held over no call, only lookups and a store: CPython hands the GIL to a
        waiting thread at a call or a loop, so a thread that evicts can never find the lock
        held by a writer it preempted there (a convoy: it blocks on the lock, the writer
        resumes, releases it, then waits for the GIL the evicting thread now needs, and
        blocks on the lock itself; several thread switches, each eviction)."""
        now = self._clock()
        engines = self._engines
        with self.lock:
            try:  # subscripts, not `get`: no call (and as fast, as a miss is rare)
                eng = engines[engine_id]
            except KeyError:
                return None
            eng.last_used = now
            try:
                return eng.agents[rank]
            except KeyError:
                return None

    def touch(self, engine_id: str) -> None:
        now = self._clock()
        engines = self._engines
        with self.lock:  # no call under the lock (see `use`)
            try:  # noqa: SIM105 (contextlib.suppress is a call)
                engines[engine_id].last_used = now
            except KeyError:
                pass

    # --- eviction ------------------------------------------------------------------------

    def evict(
        self, engine_id: str, reason: str = "operator", rank: int | None = None
    ) -> EvictResult:
        """Removes the engine (or only its agent of `rank`): popped under the lock, NIXL
        teardown outside it.

        With a transfer in flight the eviction is only marked and runs when the last
        transfer ends ("deferred"); new transfers to the engine (to that rank) are refused
        meanwhile. Evicting an engine's last rank evicts the engine.
        """
        with self.lock:
            eng = self._engines.get(engine_id)
            if eng is None or (rank is not None and rank not in eng.agents):
                return "absent"
            if rank is None:
                ranks, whole = set(eng.agents), True
            else:
                ranks = {rank}
                whole = set(eng.agents) <= eng.ranks_pending | ranks
            if eng.transfers_in_flight > 0:
                if whole:
                    eng.eviction_pending = True
                    eng.eviction_reason = reason
                else:
                    eng.ranks_pending |= ranks
                return "deferred"
            agents = self._pop(engine_id) if whole else self._pop_ranks(eng, ranks)
        self._teardown(engine_id, agents)
        if log.isEnabledFor(logging.INFO):  # the sort only when it is written
            log.info(
                "evicted engine %s (%s): agents %s", engine_id, reason, sorted(agents.values())
            )
        return "evicted"

    def evict_idle(self) -> list[str]:
        """The idle-TTL backstop: evicts engines unused for longer than `idle_ttl_s`."""
        if self.idle_ttl_s <= 0:
            return []
        now = self._clock()
        with self.lock:
            stale = [
                eid
                for eid, eng in self._engines.items()
                if eng.transfers_in_flight == 0 and now - eng.last_used > self.idle_ttl_s
            ]
        return [eid for eid in stale if self.evict(eid, reason="idle_ttl") == "evicted"]

    def _pop(self, engine_id: str) -> dict[int, str]:
        """Removes the engine (call with the lock held); its agents stay reserved until
        `_teardown` has removed them from NIXL."""
        agents = self._engines.pop(engine_id).agents
        for name in agents.values():
            self._releasing.setdefault(name, None)
        return agents

    def _pop_ranks(self, eng: _Engine, ranks: set[int]) -> dict[int, str]:
        """Removes some ranks' agents of an engine that keeps others (lock held)."""
        popped = {r: eng.agents[r] for r in sorted(ranks) if r in eng.agents}
        eng.agents = {r: a for r, a in eng.agents.items() if r not in popped}
        eng.ranks_pending.difference_update(ranks)
        for name in popped.values():
            self._releasing.setdefault(name, None)
        return popped

    def _teardown(self, engine_id: str, agents: dict[int, str]) -> None:
        self.evictions += 1
        try:
            for agent_name in agents.values():
                try:
                    self._remove_agent(agent_name)
                except Exception:
                    # The agent is gone from the registry either way; a failed teardown
                    # leaks at most the NIXL connection, which the peer's death closes.
                    self.teardown_errors += 1
                    log.exception("removing agent %s of engine %s failed", agent_name, engine_id)
        finally:
            # One pass under the lock for all of the engine's agents (not one per agent).
            waiting: list[threading.Event] = []
            owners, former, releasing = self._owners, self._former, self._releasing
            with self.lock:
                for agent_name in agents.values():
                    owner = owners.get(agent_name)
                    if owner is not None and owner[0] == engine_id:
                        del owners[agent_name]
                        former[agent_name] = owner
                        former.move_to_end(agent_name)
                    released = releasing.pop(agent_name, None)
                    if released is not None:
                        waiting.append(released)
                while len(former) > FORMER_AGENTS_KEPT:
                    former.popitem(last=False)
            for released in waiting:
                released.set()
        if self._on_evicted is not None:
            self._on_evicted(engine_id, agents)
        self._tell(False, engine_id, agents)
