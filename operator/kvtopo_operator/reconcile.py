"""Gather -> evaluate -> act, once per topology at a time: the per-topology loops.

Owns one asyncio task per KVTopology and what starts, pokes and stops them. Each task waits
for a poke (a change of a pod its selectors match, or of its spec) or its resync period,
then reconciles: reads the topology, takes its pods from the namespace's claim (made once
per change of the namespace and shared by every loop there: `logic.claim_namespace`),
gathers the workers' `/v1/state` (incrementally: `gather.WorkerViews` reads only new, moved
or failed workers in the round, and stale ones in the background, poking the loop when one
changed), asks `logic.evaluate` for a plan, makes the handshakes and evictions
(`calls.WorkerCalls`: one batched call per worker, bounded concurrency, timeouts), hands the
status to its writer (`statuswriter.StatusWriter`), writes the gates that changed and records
Events and metrics. Every write passes the fence (`fence`: only a leading replica with a fresh
lease writes); a loop that stops writes only what the stop policy says
(`stopping.on_loop_stop`: nothing, but after a deletion). A topology's reconciles never
overlap because only its own task runs them. Called by `handlers` (kopf).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from kvtopo_operator.api import (
    KV_CONNECTED_GATE,
    ROLE_LABEL,
    KVTopologySpec,
    KVTopologyStatus,
    read_tolerant,
)
from kvtopo_operator.calls import Calls, WorkerCalls
from kvtopo_operator.events import EventRecorder
from kvtopo_operator.fence import Fence, Fenced, FencedWrites
from kvtopo_operator.gate import (
    NOT_SELECTED,
    GateChange,
    gate_changes,
    stray_gates,
    transition,
)
from kvtopo_operator.gather import WorkerViews, wait_set
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import (
    NamespaceClaim,
    admissions,
    claim_namespace,
    claim_order,
    evaluate,
    invalid_spec,
    owned_pods,
    pods_of,
    record_operator_failures,
    selector_matches,
    settle,
)
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import (
    Event,
    FailingHandshake,
    Handshake,
    Memory,
    Observed,
    Plan,
    PodView,
    TopologyView,
    WorkerUnreachable,
    WorkerView,
    rfc3339,
)
from kvtopo_operator.statuswriter import Pacing, StatusWriter, status_pause
from kvtopo_operator.stopping import StopCause, StopWrites, on_loop_stop
from kvtopo_operator.workers import WorkerClient

log = logging.getLogger(__name__)

TopologyKey = tuple[str, str]  # (namespace, name)
PodSource = Callable[[str, int], Iterable[PodView]]  # (namespace, control port) -> pods
# namespace -> the KVTopologies in it (for the claim: a pod belongs to at most one)
TopologySource = Callable[[str], Iterable[TopologyView]]
# (namespace, name) -> the topology's latest body as a watch delivered it (None: not known;
# it is then read from the API server)
BodySource = Callable[[TopologyKey], Mapping[str, Any] | None]
# namespace -> (name, uid) of each pod that left the engine-pod watch with its gate True
# (its role label removed: `podwatch.PodStore.departed`), and the call that forgets one.
DepartedSource = Callable[[str], Iterable[tuple[str, str]]]
Settled = Callable[[str, str], None]  # (namespace, uid)
# A topology the API server no longer has (a deletion the watch missed): forgotten by the
# handlers as a relist would (`handlers._topology_gone`).
TopologyGone = Callable[[TopologyKey], None]
OWNER_CHECK_S = 5.0  # how often a topology claiming this one's pods is asked after


@dataclass
class Settings:
    resync_s: float = 2.0  # worker state is polled at least this often
    # ... unless the topology is so large that this would take more re-reads a second than
    # this (per namespace, its topologies sharing it): a worker's state then goes unread
    # for up to workers / this
    # (10 s at 1,000 workers, 20 s at 2,000). New, moved and failed workers are read at
    # once, and whatever the operator changes by its own calls it knows without a read; the
    # re-reads only look for drift (a failure a worker reports, a restart in place). At 250
    # a second they were a fifth of the operator's CPU at 2,000 workers and as much again
    # in the fleet answering them, taken from the control plane on a shared machine.
    state_reads_per_s: float = 100.0
    # Status writes at most this often per topology (the newest status is written at the
    # end of the interval): a rollout changes it every round, and each write of up to
    # 2,048 engine lines costs the API server and every watcher of KVTopologies. The
    # interval grows with the status: one more `status_interval_s` per
    # `status_engines_per_interval` engine lines (2 s at 1,000 engines, 4 s at 2,000), so a
    # large topology's writes cost the API server about what a small one's do.
    status_interval_s: float = 1.0
    status_engines_per_interval: int = 500
    max_gap_s: float = 0.5  # the longest pause between rounds for their CPU (see `_run`)
    # A pause between rounds at least this long begins with the fast pass (`_fast_pass`):
    # the engines that came up during the last round, or whose read ended after its wait,
    # are read and paired then, not at the end of the next round (math.inf: off). At
    # 64 x 2,000 on a 2-core machine shared with the control plane it takes ready ->
    # connected p50 from about 1.2 to 0.7 s for a sixth more operator CPU. It was off for a
    # while: beside a garbage and a hung worker the healthy engines' p99 rose 1.26-1.43
    # times, because a hung new worker's read held each pass (and round) for its whole wait;
    # rounds and passes now stop waiting for stragglers (`gather.wait_most`). BENCHMARKS.md,
    # issue 32.
    fast_pass_min_gap_s: float = 0.05
    # Fast passes also while a round waits for its calls (`_passes_while`): an engine that
    # comes up then is paired before the round ends. Off: at 64 x 2,000 side by side it
    # paired a quarter of a rollout's engines but moved neither p50 nor p99 beyond the
    # noise, for more operator CPU (BENCHMARKS.md, eighth session).
    passes_while_acting: bool = False
    # Passes for the rest of the pause between rounds too (after the fast pass, as while
    # acting): an engine that comes up during the pause is read and paired then, not at
    # the next round's gather. Off: at 64 x 2,000 side by side (A B B A) it took ready ->
    # connected p50 from 0.44 to 0.32 s but not the p99 (1.76 / 1.56 against 2.05 /
    # 1.68 s), for 13% more operator CPU (BENCHMARKS.md, twelfth session).
    passes_between_rounds: bool = False
    # The engines that came up after a round's gather join its calls (`_arrivals`): their
    # workers are read just before the round acts, waiting at most this long (0: off), and
    # their halves go in the same call to each prefill as the round's own.
    late_arrivals_s: float = 0.1
    # The engines a round's gather read for the first time get their halves while the
    # round decides (`_admit_gathered`, by `logic.admissions` under the last round's
    # decision), not after it: in a rollout's surge a 2,000-engine round decides for a
    # share of a second, and the surge's decodes are those waiting. The round's own plan
    # then finds their halves made (or queued behind the calls out: `calls.WorkerCalls.act`).
    admit_while_deciding: bool = True
    # A worker whose pod became usable is read as soon as the pod watch says so, at most
    # this often per topology (`Reconciler._prefetch`; math.inf: off), not when the next
    # round or pass looks: at 64 x 2,000 such a worker otherwise waited for the round under
    # way to end (1-2.6 s in a rollout on two busy cores) before its first read began.
    # The rounds and passes wait for a first read already out rather than start another.
    # Off by default: side by side at 64 x 2,000 (A B B A, BENCHMARKS.md, tenth session) it
    # halved the first read's p50 (0.39 -> 0.18 s) but not its p99 (1.13 / 1.54 against
    # 1.63 / 0.88 s), ready -> connected p99 2.46 / 2.43 against 2.93 / 1.72 s, for 12% more
    # operator CPU; at 32 x 1,000 no gain. The pairing, not the read, is what the tail waits on.
    prefetch_interval_s: float = math.inf
    # How long a round waits for a worker's read or calls: one still out then goes on in
    # the background, bounded by its own deadline (the handshake timeout), and pokes the
    # loop when it ends. A hung worker costs its own engine, not every decision.
    round_wait_s: float = 0.5
    retry_s: float = 0.2  # re-reconcile this soon after acting
    max_backoff_s: float = 10.0
    # A status write that failed is tried again after retry_s, doubling with each failure
    # in a row up to this (a refusal that lasts costs the API server little).
    max_write_backoff_s: float = 30.0
    # The control ports a NetworkPolicy guards (`--guarded-control-ports`); a topology whose
    # controlPort is none of them gets a ControlPortUnguarded Event. Empty: no check.
    guarded_ports: frozenset[int] = frozenset()


def _timed_evaluate(obs: Observed, now: datetime) -> tuple[Plan, float]:
    """`evaluate`, and the CPU seconds its thread spent on it (the round's log sets it
    beside the decision's wall time: the rest is waiting for the interpreter or a core)."""
    began = time.thread_time()
    plan = evaluate(obs, now)
    return plan, time.thread_time() - began


# A round this large or this long is logged (INFO) with where its time went.
LOUD_ROUND_HANDSHAKES = 1000
LOUD_ROUND_S = 1.0
QUIET_FULL_ROUND_S = 30.0  # a quiet topology still decides afresh this often
# The passes while a round acts (`Reconciler._passes_while`) start at most this often.
PASS_INTERVAL_S = 0.05


@dataclass(frozen=True)
class _Decided:
    """What the last full round went by: the engines that came up since are paired under it
    (`_arrivals`: late arrivals joining that round's calls, and the fast pass; and
    `_admit_gathered`: those the next round's gather reads first, while it decides)."""

    generation: int
    me: TopologyView  # the topology as the claim sees it (its spec)
    live: Mapping[str, str]  # engine id -> pod of each usable engine
    pods_of_role: Mapping[str, frozenset[str]]  # role -> the pods of its usable engines
    # The pods whose workers the round decided on (a view held at its gather): a worker
    # read since that it did not see (a read that ended after its wait, a new worker's
    # retry) is an arrival too (`_arrivals`), paired once (`admitted`).
    seen: frozenset[str] = frozenset()
    admitted: set[str] = field(default_factory=set)


@dataclass
class _Loop:
    task: asyncio.Task[None]
    views: WorkerViews
    poke: asyncio.Event = field(default_factory=asyncio.Event)
    # Set with `poke` by what may bring an arrival (the pod watch, a read that ended after
    # its wait), not by the loop's own calls: the passes during a round's act wait on it.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    decided: _Decided | None = None  # the last full round's (None: none yet, or refused)
    # Set by the pod watch; the prefetch task (`Reconciler._prefetch`) reads new workers.
    pods_changed: asyncio.Event = field(default_factory=asyncio.Event)
    prefetcher: asyncio.Task[None] | None = None
    generation: int = -1
    uid: str = ""  # the object's metadata.uid, as its first round read it
    failed_rounds: int = 0
    connected_at: dict[str, float] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # unknown fields last reported
    failing: dict[Handshake, FailingHandshake] = field(default_factory=dict)
    memory: Memory = field(default_factory=Memory)  # see logic.Memory
    calls: Calls = field(
        default_factory=Calls
    )  # worker calls still out (see `calls.WorkerCalls.act`)
    # When a round last ended, well or not (from the loop's start until its first), and
    # when one last succeeded (None: never); monotonic. See `Reconciler.stuck`.
    round_ended: float = field(default_factory=time.monotonic)
    succeeded: float | None = None
    # The status the last round decided (the next round's "previous"; read from the server
    # only by a loop's first round), and the loop's writer of it (`statuswriter`).
    status: KVTopologyStatus | None = None
    writer: StatusWriter | None = None
    swept: object | None = None  # the namespace's claim version its strays were swept at
    spec: KVTopologySpec | None = None  # the spec the last round read (`poke_pods`)
    # What the last full round decided from, when it had nothing to do (`_quiet_signature`),
    # and when it ran: a round that finds the same skips its decision.
    quiet: tuple[object, ...] | None = None
    quiet_since: float = 0.0
    spec_read: tuple[str, int] = ("", -1)  # (uid, generation) `spec` was read at
    ignored_spec: list[str] = field(default_factory=list)  # what reading it ignored


class Reconciler:
    """Runs and pokes the per-topology loops."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        workers: WorkerClient,
        pods: PodSource,
        topologies: TopologySource = lambda namespace: (),
        bodies: BodySource = lambda key: None,
        departed: DepartedSource = lambda namespace: (),
        settled: Settled = lambda namespace, uid: None,
        topology_gone: TopologyGone = lambda key: None,
        pods_version: Callable[[str], object | None] = lambda namespace: None,
        metrics: OperatorMetrics,
        settings: Settings | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        fence: Fence | None = None,
    ) -> None:
        self.kube = kube
        self.workers = workers
        self.pods = pods
        self.topologies = topologies
        self.bodies = bodies
        self.departed = departed
        self.settled = settled
        self.topology_gone = topology_gone
        # namespace -> a number that changes with its pods (and nodes); None: not known.
        self.pods_version = pods_version
        # namespace -> (the version it was made at, its pods, the claim): `_claim_of`
        self._claims: dict[str, tuple[object, tuple[PodView, ...], NamespaceClaim]] = {}
        self._owners_checked: dict[TopologyKey, float] = {}  # owner -> when asked (monotonic)
        self.metrics = metrics
        self.settings = settings or Settings()
        self.clock = clock
        # Every write goes through the fence: only a leading replica with a fresh lease
        # changes anything (`kvtopo_operator.fence`); without one, this replica leads.
        self.fence = fence if fence is not None else Fence()
        self.writes = FencedWrites(kube, workers, self.fence, metrics)
        self.worker_calls = WorkerCalls(self.writes, metrics)
        self._loops: dict[TopologyKey, _Loop] = {}
        self._ungating: set[asyncio.Task[bool]] = set()  # gates a forgotten topology left
        # Events leave the reconcile path: queued, de-duplicated and rate-limited per object.
        self.events = EventRecorder(self._post_event, metrics)

    # --- loop management -----------------------------------------------------------------

    def ensure(self, key: TopologyKey, generation: int | None = None) -> None:
        """Starts the topology's loop if needed; pokes it when its spec changed."""
        loop = self._loops.get(key)
        if loop is None or loop.task.done():
            poke, arrived = asyncio.Event(), asyncio.Event()

            def changed() -> None:
                poke.set()
                arrived.set()

            task = asyncio.create_task(self._run(key, poke), name=f"kvtopo-{key[0]}/{key[1]}")
            # A stale worker is re-read in the background; a different view pokes the loop.
            views = WorkerViews(
                self.workers.state,
                max_age_s=0.9 * self.settings.resync_s,
                reads_per_s=self.settings.state_reads_per_s,
                on_change=changed,
                sharing=lambda: self._namespace_engines(key[0]),
            )
            loop = _Loop(task=task, views=views, poke=poke, arrived=arrived)
            if self.settings.prefetch_interval_s < math.inf:
                loop.prefetcher = asyncio.create_task(
                    self._prefetch(key, loop), name=f"kvtopo-prefetch-{key[0]}/{key[1]}"
                )
            self._loops[key] = loop
            poke.set()
            return
        if generation is not None and generation != loop.generation:
            loop.poke.set()

    def poke_pods(self, namespace: str, pods: Iterable[tuple[str, Mapping[str, str]]]) -> None:
        """Pods of the namespace changed ((role, labels) of each, as it was and as it is):
        only the loops whose selectors match one of them are poked (a loop that has not
        read its spec yet always is). A pod event used to poke every loop of the
        namespace: 100 topologies there each ran a round per event."""
        changed = list(pods)
        for (ns, _), loop in self._loops.items():
            if ns != namespace:
                continue
            spec = loop.spec
            if spec is None or any(
                role in ("prefill", "decode")
                and selector_matches(
                    (spec.prefill if role == "prefill" else spec.decode).selector, labels
                )
                for role, labels in changed
            ):
                loop.poke.set()
                loop.arrived.set()
                loop.pods_changed.set()

    def poke_namespace(self, namespace: str) -> None:
        for (ns, _), loop in self._loops.items():
            if ns == namespace:
                loop.poke.set()
                loop.arrived.set()
                loop.pods_changed.set()

    def forget(self, key: TopologyKey) -> None:
        """The topology is gone (deleted): its loop stops, and the gates of the pods only
        it selected turn False (`stop_loop`)."""
        self.stop_loop(key, StopCause.DELETED)

    def stop_loop(self, key: TopologyKey, cause: StopCause) -> None:
        """Stops the topology's loop for `cause` and makes the writes the fail-static
        policy names for it (`stopping.on_loop_stop`): after a deletion, the gates of the
        pods only it selected turn False, by the loop of the namespace's oldest topology
        left (`_strays`, poked now) or here when none is left; after anything else,
        nothing. Each write is fenced on leadership."""
        self._stop_loop(key)
        namespace, name = key
        others = False
        if cause is StopCause.DELETED:
            others = any(t.name != name and t.spec is not None for t in self.topologies(namespace))
        writes = on_loop_stop(cause, others)
        if writes is StopWrites.UNGATE_BY_OLDEST:
            self.poke_namespace(namespace)
            return
        if writes is not StopWrites.UNGATE_HERE:
            return
        with contextlib.suppress(RuntimeError):  # no running event loop: nothing to write
            pods = tuple(self.pods(namespace, 0))
            changes = stray_gates(pods, (), ())
            if changes:
                task = asyncio.get_running_loop().create_task(
                    self._set_gates(namespace, pods, changes, asyncio.Semaphore(16), self.clock())
                )
                self._ungating.add(task)
                task.add_done_callback(self._ungating.discard)

    def _stop_loop(self, key: TopologyKey) -> None:
        """Stops the topology's loop, its background reads, calls and status writer, and
        removes its gauges."""
        loop = self._loops.pop(key, None)
        if loop is not None:
            loop.task.cancel()
            if loop.prefetcher is not None:
                loop.prefetcher.cancel()
            loop.views.close()
            loop.calls.cancel()
            if loop.writer is not None:
                loop.writer.cancel()
        self.metrics.forget_topology(*key)

    def replaced(self, key: TopologyKey) -> None:
        """Another object now has the topology's name (deleted and created again, maybe
        while the watch was away): the loop of the old one stops with all it remembered
        (status, timers, failure baselines, views), and a fresh loop starts on the new one.
        Its pods' gates are left to the new loop."""
        self._stop_loop(key)
        self.ensure(key)

    def _claim_of(
        self, me: TopologyView, namespace: str
    ) -> tuple[
        tuple[PodView, ...],
        tuple[TopologyView, ...],
        tuple[PodView, ...],
        dict[str, str],
        object | None,
    ]:
        """The namespace's pods and topologies, and `me`'s part of the claim: its owned
        pods and those an older topology owns (`logic.owned_pods`). The claim is made once
        per change of the namespace's pods, topologies or the control port, for every loop
        there (`logic.claim_namespace`: 100 topologies of one namespace once each walked
        every pod every round); a spec newer than the one claimed under is claimed on its
        own. Also returns the version the claim was made at (None: not shared)."""
        spec = me.spec
        assert spec is not None
        others = tuple(self.topologies(namespace))
        version = self.pods_version(namespace)
        if version is None:  # no versions to go by: claimed afresh
            all_pods = tuple(self.pods(namespace, spec.control_port))
            return all_pods, others, *owned_pods(me, others, all_pods), None
        key = (
            version,
            spec.control_port,
            tuple((t.name, t.created, id(t.spec)) for t in others),
        )
        held = self._claims.get(namespace)
        if held is None or held[0] != key:
            all_pods = tuple(self.pods(namespace, spec.control_port))
            held = (key, all_pods, claim_namespace(others, all_pods))
            self._claims[namespace] = held
        _, all_pods, claim = held
        index = next((t for t in others if t.name == me.name), None)
        if index is None or index.created != me.created or claim.specs.get(me.name) != spec:
            return all_pods, others, *owned_pods(me, others, all_pods), key
        return all_pods, others, claim.owned[me.name], dict(claim.claimed[me.name]), key

    def _namespace_engines(self, namespace: str) -> int:
        """The engine pods of the namespace as its last claim counted them (0: none yet):
        the namespace's topologies share one budget of state re-reads."""
        held = self._claims.get(namespace)
        return len(held[1]) if held is not None else 0

    def _pods_now(self, namespace: str, port: int) -> tuple[PodView, ...]:
        """The namespace's pods: those its claim was made of while they have not changed
        since (a walk over them is made once per change, not once per round or pass)."""
        held = self._claims.get(namespace)
        version = self.pods_version(namespace)
        if held is not None and version is not None and held[0][:2] == (version, port):  # type: ignore[index]
            return held[1]
        return tuple(self.pods(namespace, port))

    async def _owners_gone(self, namespace: str, owners: set[str]) -> bool:
        """Whether any of `owners` (older topologies claiming pods this one selects) is gone
        from the API server: each is asked at most every OWNER_CHECK_S. A deletion the
        watch missed (an API server restart; kopf's index keeps the object) otherwise left
        the pods to a topology that no longer exists until the next relist (`--relist-
        seconds`); one found gone is forgotten as the relist would (`topology_gone`)."""
        gone = False
        now = time.monotonic()
        for owner in sorted(owners)[:8]:
            key = (namespace, owner)
            if now - self._owners_checked.get(key, -math.inf) < OWNER_CHECK_S:
                continue
            self._owners_checked[key] = now
            if len(self._owners_checked) > 4096:
                self._owners_checked.pop(next(iter(self._owners_checked)))
            try:
                body = await self.kube.get_topology(namespace, owner)
            except Exception as exc:  # asked again later
                log.debug("%s/%s: asking for a claiming topology: %s", namespace, owner, exc)
                continue
            if body is None:
                log.warning(
                    "%s/%s: claims pods but is gone from the API server (its deletion was "
                    "missed); forgotten",
                    namespace,
                    owner,
                )
                self.topology_gone(key)
                gone = True
        return gone

    def _oldest(self, me: TopologyView, others: Iterable[TopologyView]) -> bool:
        """Whether `me` is the namespace's oldest readable topology: its loop un-gates what
        no topology selects (`_strays`, `_sweep_departed`); the others leave it to it."""
        tops = [t for t in others if t.spec is not None and t.name != me.name]
        if me.spec is not None:
            tops.append(me)
        return bool(tops) and min(tops, key=claim_order).name == me.name

    async def _sweep_departed(self, namespace: str, sem: asyncio.Semaphore, now: datetime) -> None:
        """The pods that left the engine-pod watch with their gate True (their role label
        removed: the watch reports them deleted, while they run on): each is read, and its
        gate turned False (NotSelected) if it is still that pod with the gate True; a pod
        gone, replaced, being deleted or already False needs nothing. A read or write that
        fails is tried again next round."""
        for name, uid in list(self.departed(namespace))[:64]:
            try:
                got = await self.kube.read_pod_gate(namespace, name)
            except Exception as exc:  # tried again next round
                log.warning("%s/%s: reading a pod that left the watch: %s", namespace, name, exc)
                continue
            if got is None or got[0] != uid or got[2] or got[1] != "True":
                self.settled(namespace, uid)
                continue
            pod = PodView(
                name=name,
                role="",
                labels={},
                ready=True,
                deleting=False,
                endpoint="",
                uid=uid,
                gated=True,
                gate="True",
            )
            change = GateChange(
                name,
                "False",
                NOT_SELECTED,
                f"the pod no longer carries the {ROLE_LABEL} label: no KVTopology manages it",
            )
            ok = await self._set_gates(namespace, (pod,), (change,), sem, now)
            if ok:
                self.settled(namespace, uid)

    def _strays(
        self,
        me: TopologyView,
        others: Iterable[TopologyView],
        pods: Iterable[PodView],
        mine: Iterable[str],
    ) -> tuple[GateChange, ...]:
        """The namespace's oldest topology's loop turns False the gates no topology selects
        any more (`gate.stray_gates`); the other loops leave them to it. `mine`: the pods
        `me` selects (the round's claim found them: owned or claimed by another)."""
        if not self._oldest(me, others):
            return ()
        tops = {t.name: t for t in others if t.spec is not None}
        if me.spec is not None:
            tops[me.name] = me
        pods = tuple(pods)
        selected = set(mine)
        for t in tops.values():
            if t is not me and t.spec is not None:
                selected.update(p.name for p in pods_of(t.spec, pods))
        return stray_gates(pods, selected, tops)

    def cancel_all(self, cause: StopCause = StopCause.LEASE_LOST) -> None:
        """Cancels every loop at once (leadership lost, or the process stopping); the
        clients stay open, so `ensure` starts fresh loops later (with fresh worker views).
        A loop that stops is not a topology deleted: what it controls is left exactly as
        it is (`stopping.on_loop_stop`)."""
        for key in list(self._loops):
            self.stop_loop(key, cause)

    @property
    def running(self) -> int:
        """How many loops run."""
        return sum(not loop.task.done() for loop in self._loops.values())

    def stuck(self, max_age_s: float) -> list[TopologyKey]:
        """The running loops whose round has not ended for over `max_age_s` seconds: wedged
        in a round (between rounds a loop waits at most its resync period or its backoff).
        A loop whose rounds fail is not stuck: each failed round ends."""
        now = time.monotonic()
        return sorted(
            key
            for key, loop in self._loops.items()
            if not loop.task.done() and now - loop.round_ended > max_age_s
        )

    def since_success(self) -> dict[TopologyKey, float | None]:
        """Each running loop's seconds since its last successful round (None: none yet)."""
        now = time.monotonic()
        return {
            key: None if loop.succeeded is None else now - loop.succeeded
            for key, loop in self._loops.items()
            if not loop.task.done()
        }

    async def _post_event(
        self, body: Mapping[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        try:
            await self.writes.record_event(body, event_type, reason, message)
        except Fenced:
            return  # counted; an Event is never worth a write this replica may not make

    async def stop(self) -> None:
        """The process stops: nothing is written from now on (the fence closes first), and
        every loop stops leaving what it controls as it is."""
        self.fence.stop()
        self.cancel_all(StopCause.PROCESS_STOP)
        await self.events.close()
        await self.workers.close()

    # --- the loop ------------------------------------------------------------------------

    async def _run(self, key: TopologyKey, poke: asyncio.Event) -> None:
        delay = self.settings.resync_s
        gap = 0.0
        while True:
            # Pacing: between rounds at least as long as the last round kept the CPU busy
            # (the process's CPU time over the round, at most `max_gap_s`). While pods
            # churn, pokes arrive faster than rounds end; one round over many changes costs
            # much less than one per change, and the loop leaves the CPU to the rest of the
            # cluster at least half of the time. A round that mostly waited on its calls
            # (a small fleet's handshakes) cost little CPU and is followed at once.
            await self._between_rounds(key, gap)
            await wait_set(poke, max(0.0, delay - gap))  # a stopped loop stops here
            poke.clear()
            loop = self._loops.get(key)
            if loop is None:
                return
            cpu_began = time.process_time()
            gap = 0.0
            try:
                acted, wake_in = await self.reconcile(key, loop)
                gap = min(self.settings.max_gap_s, time.process_time() - cpu_began)
                loop.failed_rounds = 0
                loop.succeeded = loop.round_ended = time.monotonic()
                # Nothing to do: the next round is for the re-reads, which a namespace's
                # budget may space out further than the resync period (`idle_wake_s`).
                delay = self.settings.retry_s if acted else loop.views.idle_wake_s()
                if wake_in is not None:  # an eviction falls due before the next resync
                    delay = min(delay, max(0.05, wake_in))
            except asyncio.CancelledError:
                raise
            except Exception:
                loop.round_ended = time.monotonic()
                loop.failed_rounds += 1
                delay = min(self.settings.max_backoff_s, 0.5 * 2**loop.failed_rounds)
                log.exception("reconcile of %s/%s failed; retrying in %.1fs", *key, delay)

    async def _between_rounds(self, key: TopologyKey, gap: float) -> None:
        """The pause between rounds (`gap` seconds, see `_run`). One at least
        `Settings.fast_pass_min_gap_s` long begins with the fast pass (`_fast_pass`): the
        engines that came up during the round are read and paired then."""
        loop = self._loops.get(key)
        end = time.monotonic() + gap
        if loop is not None and gap >= self.settings.fast_pass_min_gap_s:
            passes = self.settings.passes_between_rounds
            if passes:
                loop.arrived.clear()  # what arrives from here on is the passes'
            try:
                await self._fast_pass(key, loop, end, wait_calls=not passes)
            except asyncio.CancelledError:
                raise
            except Exception:  # the next round decides it all again
                log.exception("the fast pass of %s/%s failed; the next round decides", *key)
            if passes:
                pause = asyncio.ensure_future(asyncio.sleep(max(0.0, end - time.monotonic())))
                try:
                    await self._passes_while(key, loop, pause, clear=False)
                finally:
                    pause.cancel()
        await asyncio.sleep(max(0.0, end - time.monotonic()))

    async def _fast_pass(
        self, key: TopologyKey, loop: _Loop, until: float, *, wait_calls: bool = True
    ) -> bool:
        """Pairs the engines that came up since the last round, between rounds
        (`_arrivals`), waiting for their reads and calls at most until `until`
        (monotonic). What the calls end with is the next round's (its outcome, its
        status, Events and gates): that round runs as it would have, on views that already
        hold the pairs made. False when it could not judge (`_arrivals`)."""
        handshakes = await self._arrivals(key, loop, until)
        if not handshakes:
            return handshakes is not None
        decided = loop.decided
        assert decided is not None and decided.me.spec is not None
        spec = decided.me.spec
        plan = Plan(handshakes, (), KVTopologyStatus(), (), 0, 0)
        await self.worker_calls.act(
            plan,
            loop.views,
            asyncio.Semaphore(spec.handshake.max_concurrent),
            float(spec.handshake.timeout_seconds),
            self.clock(),
            set(loop.failing),
            calls=loop.calls,
            wait_s=max(0.0, until - time.monotonic()) if wait_calls else 0.0,
            on_late=loop.poke.set,
            take=False,
        )
        # The next round takes what the calls ended with (its status, gates, Events),
        # those that ended during the pass too: it must run.
        loop.poke.set()
        return True

    async def _passes_while(
        self, key: TopologyKey, loop: _Loop, acting: asyncio.Future[Any], *, clear: bool = True
    ) -> None:
        """Fast passes while a round acts (its calls to a rollout's prefills take a share
        of a second under load): an engine that comes up meanwhile, or whose read ends
        meanwhile, is read and paired then (`_arrivals`), not after the round. A pass's
        own calls are not waited for (what they end with is the next round's), and its
        part for a worker whose calls are out is queued behind them
        (`calls.WorkerCalls.act`). Returns once the round's calls are done and no pass is
        under way. Also for the rest of the pause
        between rounds (`acting`: that pause; `clear=False`: what arrived since the fast
        pass began is the passes')."""
        if clear:
            loop.arrived.clear()
        waiting = asyncio.ensure_future(loop.arrived.wait())
        passing: asyncio.Future[bool] | None = None
        try:
            while True:
                await asyncio.wait({acting, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if acting.done():
                    return
                loop.arrived.clear()
                waiting = asyncio.ensure_future(loop.arrived.wait())
                began = time.monotonic()
                passing = asyncio.ensure_future(
                    self._fast_pass(key, loop, began + self.settings.round_wait_s, wait_calls=False)
                )
                await asyncio.wait({acting, passing}, return_when=asyncio.FIRST_COMPLETED)
                if not passing.done():
                    # The round's calls are done: it must not wait for a pass still reading
                    # (a hung new worker's read). What the pass read is the next pass's
                    # (read since the round's gather: `_arrivals`).
                    passing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await passing
                    return
                if (exc := passing.exception()) is not None:  # the next round decides it all
                    log.error("a pass of %s/%s failed: %r; the next round decides", *key, exc)
                # A rollout's pod events come many a second: one pass per interval at most.
                pause = began + PASS_INTERVAL_S - time.monotonic()
                if pause > 0:
                    await asyncio.wait({acting}, timeout=pause)
        finally:
            waiting.cancel()
            if passing is not None:
                passing.cancel()  # done: nothing; else the loop stopped meanwhile

    async def _prefetch(self, key: TopologyKey, loop: _Loop) -> None:
        """Starts the first read of each new worker of the topology as soon as the pod
        watch reports its pod usable, at most once per `Settings.prefetch_interval_s`,
        without waiting for it: a read that ends pokes the loop, and the round or pass that
        pairs the engine finds its view read or waits for the read already out
        (`WorkerViews.read_new`). Judged under the last round's spec and claim; before the
        first round, or when that is wrong since, the round reads them as it always did."""
        while True:
            await loop.pods_changed.wait()
            loop.pods_changed.clear()
            began = time.monotonic()
            try:
                await self._prefetch_once(key, loop)
            except asyncio.CancelledError:
                raise
            except Exception:  # the rounds read them as before
                log.exception("the prefetch of %s/%s failed; the rounds read", *key)
            await asyncio.sleep(
                max(0.0, began + self.settings.prefetch_interval_s - time.monotonic())
            )

    async def _prefetch_once(self, key: TopologyKey, loop: _Loop) -> int:
        """One look for new workers (`_prefetch`); returns how many reads it started."""
        decided = loop.decided
        if decided is None or decided.me.spec is None:
            return 0
        spec = decided.me.spec
        namespace, _ = key
        new = [
            p
            for p in self.pods(namespace, spec.control_port)
            if p.ready and not p.deleting and p.endpoint and loop.views.is_new(p)
        ]
        if not new:
            return 0
        pods, _ = owned_pods(decided.me, tuple(self.topologies(namespace)), new)
        if not pods:
            return 0
        self.metrics.state_prefetches.inc(len(pods))
        await loop.views.read_new(
            pods,
            concurrency=spec.handshake.max_concurrent,
            timeout_s=float(spec.handshake.timeout_seconds),
            wait_s=0.0,
        )
        return len(pods)

    async def _arrivals(
        self, key: TopologyKey, loop: _Loop, until: float
    ) -> tuple[Handshake, ...] | None:
        """The handshakes of the engines that came up since the last round's gather: their
        workers are read (waiting at most until `until`, monotonic; a read still out then
        pokes the loop when it ends) and paired by `logic.admissions`, under the last
        round's spec, claim and view of which engines are usable (`loop.decided`). None
        when that cannot be judged: no round decided yet, or the spec or the object
        changed since."""
        decided = loop.decided
        if decided is None or decided.me.spec is None:
            return None
        spec = decided.me.spec
        namespace, _ = key
        body = self.bodies(key) or await self.kube.get_topology(*key)
        if body is None:
            return None
        meta = body.get("metadata") or {}
        if int(meta.get("generation", 0)) != decided.generation or (
            loop.uid and str(meta.get("uid") or "") != loop.uid
        ):
            return None  # the round reads the topology afresh
        # The pods this topology owns now, by the namespace's shared claim (the pods of the
        # namespace's other topologies are never this loop's arrivals: 100 topologies in
        # one namespace once made every pass of every loop claim all 1,000 pods afresh).
        _, _, owned, _, _ = self._claim_of(decided.me, namespace)
        # With the prefetch on, a first read already out is waited for (`read_new`); off, as
        # measured: a read out (the round's, still going) is the next pass's once it ends.
        prefetching = self.settings.prefetch_interval_s < math.inf
        arriving = loop.views.arriving if prefetching else loop.views.is_new
        new: list[PodView] = []
        unseen: list[PodView] = []  # read since the round's gather, which did not see them
        for p in owned:
            if not p.ready or p.deleting:
                continue
            if arriving(p):
                new.append(p)
            elif (
                p.name not in decided.seen
                and p.name not in decided.admitted
                and isinstance(loop.views.view(p.name), WorkerView)
            ):
                unseen.append(p)
        if not new and not unseen:
            return ()
        names = {p.name for p in new} | {p.name for p in unseen}
        wanted: set[str] = set()
        for role in {p.role for p in (*new, *unseen)}:
            wanted |= decided.pods_of_role.get("decode" if role == "prefill" else "prefill", set())
        pods = [p for p in owned if p.name in names or p.name in wanted]
        read: dict[str, WorkerView | WorkerUnreachable] = dict(
            await loop.views.read_new(
                [p for p in pods if p.name in names],
                concurrency=spec.handshake.max_concurrent,
                timeout_s=float(spec.handshake.timeout_seconds),
                wait_s=max(0.0, min(self.settings.round_wait_s, until - time.monotonic())),
            )
        )
        for p in pods:
            if p.name in names and p.name not in read:
                view = loop.views.view(p.name)
                if isinstance(view, WorkerView) and p.name not in decided.seen:
                    read[p.name] = view
        if not read:
            return ()
        workers: dict[str, WorkerView | WorkerUnreachable] = dict(read)
        for p in pods:
            if p.name in wanted:
                view = loop.views.view(p.name)
                if view is not None:
                    workers[p.name] = view
        handshakes = await asyncio.to_thread(
            admissions, spec, pods, workers, frozenset(read), decided.live
        )
        # Paired once (a pass cancelled before this point pairs nothing: the next pairs it).
        decided.admitted.update(n for n, v in read.items() if isinstance(v, WorkerView))
        self.metrics.arrival_handshakes.inc(len(handshakes))
        return handshakes

    async def _admit_gathered(
        self,
        key: TopologyKey,
        loop: _Loop,
        generation: int,
        pods: tuple[PodView, ...],
        workers: Mapping[str, WorkerView | WorkerUnreachable],
        sem: asyncio.Semaphore,
        call_timeout: float,
        now: datetime,
    ) -> None:
        """Pairs the engines this round's gather read that the last round's decision did
        not see (new workers, mostly: a rollout's surge) while this round decides
        (`Settings.admit_while_deciding`): `logic.admissions` under the last round's spec
        and view of which engines are usable, as the fast pass does, and their calls
        started without waiting for them (what they end with is this round's if they end
        before it acts, else the next one's). Nothing when the last decision was under
        another generation (the round decides it all)."""
        decided = loop.decided
        if decided is None or decided.me.spec is None or decided.generation != generation:
            return
        spec = decided.me.spec
        new = frozenset(
            name
            for name, view in workers.items()
            if isinstance(view, WorkerView)
            and name not in decided.seen
            and name not in decided.admitted
        )
        if not new:
            return
        wanted: set[str] = set()
        for role in {p.role for p in pods if p.name in new}:
            wanted |= decided.pods_of_role.get("decode" if role == "prefill" else "prefill", set())
        candidates = [p for p in pods if p.name in new or p.name in wanted]
        try:
            handshakes = await asyncio.to_thread(
                admissions, spec, candidates, workers, new, decided.live
            )
            decided.admitted.update(new)
            if not handshakes:
                return
            self.metrics.arrival_handshakes.inc(len(handshakes))
            await self.worker_calls.act(
                Plan(handshakes, (), KVTopologyStatus(), (), 0, 0),
                loop.views,
                sem,
                call_timeout,
                now,
                set(loop.failing),
                calls=loop.calls,
                wait_s=0.0,
                on_late=loop.poke.set,
                take=False,
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # the round decides them as it always did
            log.exception("pairing the gathered arrivals of %s/%s failed; the round decides", *key)

    async def reconcile(self, key: TopologyKey, loop: _Loop) -> tuple[bool, float | None]:
        """One round; returns whether it changed something (so it runs again soon) and when
        the next eviction falls due."""
        started = time.monotonic()
        namespace, name = key
        # The body kopf's watch delivered last (its spec and generation are what a poke
        # announced), else a read; the status in it matters only to a loop's first round.
        body = self.bodies(key) or await self.kube.get_topology(namespace, name)
        if body is None:
            self.forget(key)
            return False, None
        uid = str(body["metadata"].get("uid") or "")
        if loop.uid and uid and uid != loop.uid:
            log.info(
                "%s/%s: another object now (uid %s -> %s); starting afresh", *key, loop.uid, uid
            )
            self.replaced(key)
            return False, None
        loop.uid = loop.uid or uid
        generation = int(body["metadata"].get("generation", 0))
        loop.generation = generation
        # Read tolerantly: what a newer CRD or operator wrote and this one does not know is
        # ignored (and logged once), never a reason to skip the topology or forget its status.
        # The server's status is read by a loop's first round (an operator restart or a new
        # leader carries on from it); later rounds carry on from the one the last decided,
        # whether or not its write has landed yet.
        ignored: list[str] = []
        previous = loop.status
        if previous is None:
            try:
                previous, ignored = read_tolerant(KVTopologyStatus, body.get("status"), ".status")
            except ValidationError as exc:  # nothing of it could be kept
                log.warning("%s/%s: the status cannot be read, starting afresh: %s", *key, exc)
                previous, ignored = KVTopologyStatus(), [".status"]
            # Nothing counts as written yet: a loop's first status is always written.
            self._writer_of(key, loop).start_from(
                str(body["metadata"].get("resourceVersion") or ""), loop.uid
            )
        try:
            # Read once per generation of the object (the spec does not change without one).
            if loop.spec is not None and loop.spec_read == (uid, generation):
                spec, ignored_spec = loop.spec, loop.ignored_spec
            else:
                spec, ignored_spec = read_tolerant(
                    KVTopologySpec, body.get("spec"), ".spec", drop_invalid=False
                )
                loop.spec_read, loop.ignored_spec = (uid, generation), ignored_spec
        except ValidationError as exc:
            loop.decided = None
            await self._invalid_spec(key, loop, body, previous, generation, exc)
            return False, None
        ignored = ignored_spec + ignored
        if ignored and ignored != loop.ignored:
            log.warning(
                "%s/%s: ignoring fields this operator does not know: %s",
                *key,
                ", ".join(ignored[:20]),
            )
        loop.ignored = ignored
        loop.spec = spec

        # The claim: of the pods this spec selects, those an older topology of the namespace
        # selects too are that one's; they are left alone (`logic.owned_pods`).
        me = TopologyView(name, str(body["metadata"].get("creationTimestamp") or ""), spec)
        all_pods, others, pods, claimed, shared = self._claim_of(me, namespace)
        if claimed and await self._owners_gone(namespace, set(claimed.values())):
            # An older topology that claimed pods is gone (its deletion was missed): the
            # claim is made again without it.
            all_pods, others, pods, claimed, shared = self._claim_of(me, namespace)
        sem = asyncio.Semaphore(spec.handshake.max_concurrent)
        timeout = float(spec.handshake.timeout_seconds)
        reads, unchanged = loop.views.reads, loop.views.unchanged
        workers = await loop.views.gather(
            pods,
            concurrency=spec.handshake.max_concurrent,
            timeout_s=timeout,
            wait_s=self.settings.round_wait_s,
        )
        self.metrics.state_reads.inc(loop.views.reads - reads)
        self.metrics.state_unchanged.inc(loop.views.unchanged - unchanged)
        quiet = self._quiet_signature(loop, generation, shared, spec, workers)
        if quiet is not None and loop.quiet == quiet and self._nothing_pending(loop):
            # Nothing changed since a round that had nothing to do and no timer running:
            # its decision stands. The round was for the re-reads (started by the gather).
            self.metrics.quiet_rounds.inc()
            return False, None
        gathered = time.monotonic()
        now = self.clock()
        admitting = (
            asyncio.ensure_future(
                self._admit_gathered(key, loop, generation, pods, workers, sem, timeout, now)
            )
            if self.settings.admit_while_deciding
            else None
        )
        # The decision runs off the event loop (a large topology's round takes a share of a
        # second of pure Python): the Lease renewals, the pod watch and the other loops go
        # on meanwhile. Only this loop touches its memory, and it waits for the plan.
        try:
            observed = Observed(
                generation=generation,
                spec=spec,
                pods=pods,
                workers=workers,
                previous=previous,
                claimed=claimed,
                memory=loop.memory,
            )
            plan, decide_cpu = await asyncio.to_thread(_timed_evaluate, observed, now)
            if admitting is not None:  # its calls go on; only their start is waited for
                await admitting
        finally:  # the round failed or the loop stopped meanwhile: so does the pairing
            if admitting is not None:
                admitting.cancel()
        decided = time.monotonic()
        roles = plan.progress.live_roles or {}
        by_role: dict[str, set[str]] = {}
        for pod_name, eid in plan.progress.live:
            by_role.setdefault(roles.get(eid, ""), set()).add(pod_name)
        loop.decided = _Decided(
            generation,
            me,
            {eid: pod_name for pod_name, eid in plan.progress.live},
            {role: frozenset(names) for role, names in by_role.items()},
            frozenset(n for n, v in workers.items() if isinstance(v, WorkerView)),
        )
        if self.settings.late_arrivals_s > 0:
            # The engines that came up while this round gathered and decided join its
            # calls: one wave of calls to every prefill carries their halves too.
            late = await self._arrivals(key, loop, time.monotonic() + self.settings.late_arrivals_s)
            if late:
                plan = dataclasses.replace(plan, handshakes=plan.handshakes + late)
        acting = asyncio.ensure_future(
            self.worker_calls.act(
                plan,
                loop.views,
                sem,
                timeout,
                now,
                set(loop.failing),
                calls=loop.calls,
                wait_s=self.settings.round_wait_s,
                on_late=loop.poke.set,
            )
        )
        try:
            if self.settings.passes_while_acting and self.settings.fast_pass_min_gap_s < math.inf:
                await self._passes_while(key, loop, acting)
            out = await acting
        finally:  # the loop stopped meanwhile: so do the round's calls
            acting.cancel()
        acted_at = time.monotonic()
        if len(plan.handshakes) >= LOUD_ROUND_HANDSHAKES or acted_at - started > LOUD_ROUND_S:
            log.info(
                "%s/%s: a round of %d engines, %d handshake halves planned; %d made and %d "
                "failed (with those of earlier rounds' calls that ended since), %d left to a "
                "later round (their worker's calls still out); %.2f s: gather %.2f, decide "
                "%.2f (%.2f of it the decision's own CPU), act %.2f",
                *key,
                len(workers),
                len(plan.handshakes),
                len(out.made),
                len(out.failed),
                len(out.deferred),
                acted_at - started,
                gathered - started,
                decided - gathered,
                decide_cpu,
                acted_at - decided,
            )
        # Handshakes failing round after round: since when (the progress deadline counts
        # from there); one that succeeded or is no longer wanted is forgotten, one left to a
        # later round (its worker's calls still out) is kept as it was.
        failing = {h: loop.failing[h] for h in out.deferred if h in loop.failing}
        failing.update(
            (h, FailingHandshake(loop.failing[h].since if h in loop.failing else now, message))
            for h, message in out.failed.items()
        )
        loop.failing = failing
        # The conditions are those of the outcome of acting, not of the plan.
        status, settle_events, settled = settle(
            plan,
            out.made,
            loop.failing,
            previous,
            generation,
            timedelta(seconds=spec.handshake.progress_deadline_seconds),
            now,
        )
        status = record_operator_failures(status, out.failures)
        if plan.memory is not None:
            # Remembered whether or not the status write below succeeds: eviction timers
            # and failure baselines never depend on it.
            loop.memory = dataclasses.replace(
                plan.memory, counts=dict(status.failures.counts), last=status.failures.last
            )
        acted, act_events = out.acted, [*out.events, *settle_events]
        loop.status = status
        # Handed to the writer as it is: it is dumped (2,048 engine lines) only when the
        # writer is about to write it, not every round (`_write_status`).
        self._write_status(key, loop, status)
        for event in (*plan.events, *act_events):
            self.events.record(body, event)
        guarded = self.settings.guarded_ports
        if guarded and spec.control_port not in guarded:  # said once per repeat window
            ports = ", ".join(map(str, sorted(guarded)))
            self.events.record(
                body,
                Event(
                    "Warning",
                    "ControlPortUnguarded",
                    f"spec.controlPort {spec.control_port} is not among the ports the "
                    f"chart's NetworkPolicy guards ({ports}): its workers' control API is "
                    "open to any pod; add it to the chart's workers.extraControlPorts",
                ),
            )
        # The readiness gate of the pods that list it, from the outcome of acting.
        changes = gate_changes(pods, settled, spec.readiness_gate.min_connected_partners)
        if shared is None or loop.swept != shared:  # on a change of the namespace only
            changes += self._strays(me, others, all_pods, [*(p.name for p in pods), *claimed])
            loop.swept = shared
        if changes:
            await self._set_gates(namespace, all_pods, changes, sem, now)
        if self._oldest(me, others):
            await self._sweep_departed(namespace, sem, now)
        self._observe(key, loop, plan, pods, time.monotonic() - started)
        still = not (acted or plan.handshakes or plan.evictions or plan.idle_ttls or changes)
        loop.quiet = quiet if still and plan.wake_in_s is None and not loop.failing else None
        loop.quiet_since = time.monotonic()
        return acted, plan.wake_in_s

    def _quiet_signature(
        self,
        loop: _Loop,
        generation: int,
        shared: object | None,
        spec: KVTopologySpec,
        workers: Mapping[str, WorkerView | WorkerUnreachable],
    ) -> tuple[object, ...] | None:
        """What a round decides from, by identity: the object's generation, the namespace's
        claim (its version: pods, nodes, topologies), the spec and every worker's view (a
        view is a new object whenever its worker said something new). None when it cannot
        be told (no claim version)."""
        if shared is None:
            return None
        return (generation, shared, id(spec), tuple((n, id(v)) for n, v in workers.items()))

    def _nothing_pending(self, loop: _Loop) -> bool:
        """No call out, none that ended unseen, no handshake failing, and a full round not
        too long ago (`QUIET_FULL_ROUND_S`: time-kept parts of the status, such as how long
        evicted engines are listed, move on)."""
        out = loop.calls.outcome
        return (
            not loop.calls.out
            and not loop.calls.queued
            and not (out.acted or out.made or out.failed or out.events or out.failures)
            and not loop.failing
            and time.monotonic() - loop.quiet_since < QUIET_FULL_ROUND_S
        )

    def _write_status(self, key: TopologyKey, loop: _Loop, status: KVTopologyStatus) -> None:
        """Hands the round's status to the loop's writer (`statuswriter.StatusWriter`),
        off the round's path; the rounds' decisions and timers never wait for it."""
        self._writer_of(key, loop).write(status)

    def _writer_of(self, key: TopologyKey, loop: _Loop) -> StatusWriter:
        if loop.writer is None:
            loop.writer = StatusWriter(
                key,
                writes=self.writes,
                kube=self.kube,
                events=self.events,
                metrics=self.metrics,
                pacing=self._pacing,
                body=lambda: self.bodies(key),
                gone=lambda: self.forget(key),
            )
        return loop.writer

    def status_pause(self, status: Mapping[str, Any]) -> float:
        """How long the writer waits after writing `status` (see `Settings`)."""
        return status_pause(status, self._pacing())

    def _pacing(self) -> Pacing:
        s = self.settings
        return Pacing(
            s.status_interval_s, s.status_engines_per_interval, s.retry_s, s.max_write_backoff_s
        )

    async def _set_gates(
        self,
        namespace: str,
        pods: tuple[PodView, ...],
        changes: tuple[GateChange, ...],
        sem: asyncio.Semaphore,
        now: datetime,
    ) -> bool:
        """Writes the kv-connected condition of each pod in `changes` (`pods/status`), at
        most `sem` calls at once; whether every write was made. A write that fails is
        left: the pod's condition still differs next round, so it is written again then."""
        by_name = {p.name: p for p in pods}

        async def one(change: GateChange) -> bool:
            condition = {
                "type": KV_CONNECTED_GATE,
                "status": change.status,
                "reason": change.reason,
                "message": change.message,
            }
            if transition(change, by_name.get(change.pod)):  # else the time stays as it was
                condition["lastTransitionTime"] = rfc3339(now)
            pod = by_name.get(change.pod)
            try:
                async with sem:
                    ok = await self.writes.patch_pod_condition(
                        namespace, change.pod, pod.uid if pod is not None else "", condition
                    )
            except Fenced:
                return False  # counted; this replica changes no gate now
            except Exception as exc:  # 403, 429, a timeout: next round tries again
                log.warning("%s/%s: setting %s: %s", namespace, change.pod, KV_CONNECTED_GATE, exc)
                ok = False
            self.metrics.gate_writes.labels(change.status if ok else "failed").inc()
            return ok

        return all(await asyncio.gather(*map(one, changes)))

    async def _invalid_spec(
        self,
        key: TopologyKey,
        loop: _Loop,
        body: Mapping[str, Any],
        previous: KVTopologyStatus,
        generation: int,
        exc: ValidationError,
    ) -> None:
        """A spec this operator cannot read: say so in the conditions (and an Event), keep
        everything else, act on nothing."""
        problems = "; ".join(
            f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        status, events = invalid_spec(previous, generation, problems, self.clock())
        loop.status = status
        self._write_status(key, loop, status)
        for event in events:
            self.events.record(body, event)
        log.error("%s/%s: %s", *key, problems)

    def _observe(
        self, key: TopologyKey, loop: _Loop, plan: Plan, pods: tuple[PodView, ...], seconds: float
    ) -> None:
        self.metrics.reconcile_seconds.observe(seconds)
        ready_since = {p.name: p.ready_since for p in pods if p.ready_since is not None}
        # Remembered while the engine is live: a thousand rollouts leave no trace.
        live = plan.progress.pair_counts or {}
        if len(loop.connected_at) > len(live):
            loop.connected_at = {k: v for k, v in loop.connected_at.items() if k in live}
        for engine in plan.status.engines:
            first = engine.state == "Connected" and engine.engine_id not in loop.connected_at
            if first and engine.pod in ready_since:
                loop.connected_at[engine.engine_id] = time.time()
                self.metrics.ready_to_connected.observe(
                    max(0.0, time.time() - ready_since[engine.pod])
                )
        self.metrics.pairs_expected.labels(*key).set(plan.pairs_expected)
        self.metrics.pairs_connected.labels(*key).set(plan.pairs_connected)
        self.metrics.peers_unhealthy.labels(*key).set(len(plan.unhealthy_peers))
