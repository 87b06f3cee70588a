"""The operator's pure decisions: observed state and time in, a plan and a status out.

Owns `evaluate()`: which prefill/decode pairs must be connected, which engines are gone
(pod deleted, not Ready, replaced, or restarted with a new engine id), when a gone engine
is evicted from its peers (after `eviction.graceSeconds`), which pairs are incompatible,
which held peers are re-handshaked because their holder reports them unhealthy (NIXL dropped
them, or their transfers keep failing; the worker renews them on the add),
which workers' idle TTL differs from `eviction.idleTTLSeconds`, how worker failure counters
accumulate into totals that survive restarts, and the whole status (conditions, summary,
engines). Also owns the claim (`owned_pods`): a pod belongs to at most one topology, the
oldest of its namespace that selects it; the others leave it alone and report a Conflict.
No I/O, no clock of its own: the same observed state and time always give the same plan.
Called by `kvtopo_operator.reconcile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from kvtopo_operator.api import (
    MAX_ENGINES_IN_STATUS,
    Condition,
    ConditionType,
    EngineState,
    EngineStatus,
    Failures,
    KVTopologySpec,
    KVTopologyStatus,
    LabelSelector,
    LastFailure,
    Reason,
    Summary,
)

EVICTED_RETENTION = timedelta(minutes=5)
Role = str  # "prefill" | "decode"
PEER_UNHEALTHY = "PeerUnhealthy"  # the Event's reason when held peers are re-handshaked


# --- observed state ----------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """An engine pod as the operator sees it (from the pod watch)."""

    name: str
    role: Role
    labels: Mapping[str, str]
    # The engine is up: the pod's ContainersReady (its Ready waits for the kv-connected
    # readiness gate where the pod lists it; Ready only where a pod has no ContainersReady).
    ready: bool
    deleting: bool
    endpoint: str  # the worker's control endpoint, "" when the pod has no address yet
    ready_since: float | None = None  # when the engine came up (epoch seconds), for metrics
    uid: str = ""  # the pod's metadata.uid: its worker must report the same
    endpoint_error: str = ""  # why the pod's endpoint is refused (it is then never dialled)
    gated: bool = False  # the pod lists the readiness gate kvtopo.dev/kv-connected
    gate: str = ""  # that condition's status now ("True", "False"; "" when not set)


@dataclass(frozen=True)
class FailureView:
    time: float
    type: str
    request_id: str = ""
    engine_id: str = ""
    message: str = ""


@dataclass(frozen=True)
class WorkerView:
    """A worker's `/v1/state` (what matters to the operator)."""

    engine_id: str
    role: Role
    compat_hash: str
    peers: frozenset[str]
    evicting: frozenset[str] = frozenset()
    failures: Mapping[str, int] = field(default_factory=dict)
    last_failure: FailureView | None = None
    incarnation: str = ""  # the worker process's boot id
    pod_uid: str = ""  # the pod uid the worker says it runs in ("" when it does not say)
    peer_incarnations: Mapping[str, str] = field(default_factory=dict)  # held peer -> its
    # Held peers the worker reports dropped or failing: engine id -> "health: reason".
    unhealthy_peers: Mapping[str, str] = field(default_factory=dict)
    # The worker's settings; None from a worker that predates them (it must not be sent them).
    handshake_timeout_s: float | None = None  # its default; it takes one per batch
    idle_ttl_s: float | None = None  # its idle-TTL backstop (0: off); PUT /v1/settings


@dataclass(frozen=True)
class WorkerUnreachable:
    """The worker's state could not be read this round."""

    message: str


@dataclass(frozen=True)
class Memory:
    """What the operator remembers of a topology between rounds, whether or not its status
    was written (a write refused by 403, 429 or a webhook) and beyond the status's 2,048
    engines: when each gone engine was first seen gone (its eviction timer), the failure
    counters last read from each engine (the baselines of the deltas, kept while an engine
    blips NotReady), and the totals. Empty after an operator restart: the status is then the
    only record, and `evaluate` falls back to it."""

    gone_since: Mapping[str, datetime] = field(default_factory=dict)
    baselines: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    seen_at: Mapping[str, datetime] = field(default_factory=dict)  # when a baseline was read
    # Connections between live engines no longer paired: (holder, peer) -> since when.
    unpairing_since: Mapping[tuple[str, str], datetime] = field(default_factory=dict)
    # (holder, peer) of live engines whose holder reported the peer unhealthy last round
    # (a PeerUnhealthy Event is said when a pair joins).
    unhealthy: frozenset[tuple[str, str]] = frozenset()
    counts: Mapping[str, int] | None = None  # None: take the status's
    last: LastFailure | None = None


@dataclass(frozen=True)
class Observed:
    generation: int
    spec: KVTopologySpec
    pods: tuple[PodView, ...]
    workers: Mapping[str, WorkerView | WorkerUnreachable]  # by pod name
    previous: KVTopologyStatus
    # Pods the spec selects but an older topology owns (`owned_pods`): pod -> that topology.
    # They are left alone, not counted, not listed, and reported by the Conflict condition.
    claimed: Mapping[str, str] = field(default_factory=dict)
    memory: Memory = field(default_factory=Memory)


# --- the plan ----------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Handshake:
    """Tell the worker at `endpoint` (pod `pod`) to add engine `peer_engine_id`."""

    pod: str
    endpoint: str
    peer_engine_id: str
    peer_endpoint: str
    peer_role: Role
    peer_pod_uid: str = ""  # the worker refuses a peer of another pod
    peer_incarnation: str = ""  # ... or of another process (an older one is replaced)
    engine_id: str = ""  # the engine of `pod` (which pair the handshake is half of)

    @property
    def pair(self) -> tuple[str, str]:
        """(prefill engine id, decode engine id) of the pair this handshake is half of."""
        if self.peer_role == "decode":
            return (self.engine_id, self.peer_engine_id)
        return (self.peer_engine_id, self.engine_id)


@dataclass(frozen=True)
class Progress:
    """What the conditions are computed from: before acting (in the plan) and again after
    acting, with the handshakes made and the failures that persist (`settle`)."""

    expected: frozenset[tuple[str, str]] = frozenset()
    connected: frozenset[tuple[str, str]] = frozenset()
    unpaired: tuple[str, ...] = ()  # pods of usable engines with no partner to pair with
    handshakes_left: int = 0
    draining: int = 0
    incompatible: int = 0
    unreachable: tuple[tuple[str, Reason], ...] = ()  # (pod, why), sorted
    failing: tuple[str, ...] = ()  # handshakes failing past the progress deadline, described
    claimed: tuple[tuple[str, str], ...] = ()  # (pod, older topology owning it): Conflict
    selected: tuple[int, int] = (0, 0)  # (prefill, decode) pods this topology owns
    live: tuple[tuple[str, str], ...] = ()  # (pod, engine id) of each usable engine, sorted


@dataclass(frozen=True, order=True)
class Eviction:
    """Tell the worker at `endpoint` (pod `pod`) to evict engine `engine_id`."""

    pod: str
    endpoint: str
    engine_id: str


@dataclass(frozen=True, order=True)
class SetIdleTTL:
    """Set the idle-TTL backstop of the worker at `endpoint` (pod `pod`) to `idle_ttl_s`."""

    pod: str
    endpoint: str
    idle_ttl_s: float


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    handshakes: tuple[Handshake, ...]
    evictions: tuple[Eviction, ...]
    status: KVTopologyStatus
    events: tuple[Event, ...]
    expected_pairs: frozenset[tuple[str, str]]
    connected_pairs: frozenset[tuple[str, str]]
    wake_in_s: float | None = None  # when the next eviction falls due, if one is waiting
    idle_ttls: tuple[SetIdleTTL, ...] = ()  # workers whose idle TTL differs from the spec's
    progress: Progress = Progress()  # what the conditions were computed from, before acting
    memory: Memory | None = None  # what to remember for the next round (see `Memory`)
    # (holder, peer) engine ids of expected pairs whose holder reports the peer unhealthy:
    # their handshakes (in `handshakes`) renew the peer.
    unhealthy_peers: frozenset[tuple[str, str]] = frozenset()


# --- helpers -----------------------------------------------------------------------------


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def precise(t: datetime) -> str:
    """RFC 3339 with milliseconds: engine `since` stamps drive the eviction grace, and a
    stamp truncated to the second would evict up to a second early."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def parse_time(s: str) -> datetime:
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if "." in s else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.strptime(s, fmt).replace(tzinfo=UTC)


def selector_matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics; an empty selector matches nothing here."""
    if not selector.match_labels and not selector.match_expressions:
        return False
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    for req in selector.match_expressions:
        present = req.key in labels
        value = labels.get(req.key)
        if req.operator == "In" and value not in req.values:
            return False
        if req.operator == "NotIn" and present and value in req.values:
            return False
        if req.operator == "Exists" and not present:
            return False
        if req.operator == "DoesNotExist" and present:
            return False
    return True


def pods_of(spec: KVTopologySpec, pods: Iterable[PodView]) -> tuple[PodView, ...]:
    """The pods this topology selects: role label and the role's selector both match (which
    of them it owns: `owned_pods`)."""
    out = []
    for pod in pods:
        role_spec = spec.prefill if pod.role == "prefill" else spec.decode
        if pod.role in ("prefill", "decode") and selector_matches(role_spec.selector, pod.labels):
            out.append(pod)
    return tuple(sorted(out, key=lambda p: p.name))


# --- ownership: a pod belongs to at most one topology ------------------------------------


@dataclass(frozen=True)
class TopologyView:
    """A KVTopology of the namespace as the claim sees it: its name, when it was created
    and its spec (None when this operator cannot read the spec: such a topology acts on
    nothing, so it claims nothing)."""

    name: str
    created: str  # metadata.creationTimestamp (RFC 3339); "" sorts after every stamp
    spec: KVTopologySpec | None


_NEVER = datetime.max.replace(tzinfo=UTC)


def claim_order(topology: TopologyView) -> tuple[datetime, str]:
    """The claim's order: the oldest topology first (metadata.creationTimestamp, which has
    a resolution of one second), ties broken by name (unique in a namespace)."""
    try:
        created = parse_time(topology.created) if topology.created else _NEVER
    except ValueError:
        created = _NEVER
    return created, topology.name


def owned_pods(
    me: TopologyView, others: Iterable[TopologyView], pods: Iterable[PodView]
) -> tuple[tuple[PodView, ...], dict[str, str]]:
    """The claim: among the topologies of a namespace whose role selector matches a pod
    (`pods_of`), the oldest (`claim_order`) owns it, and only the owner acts on it.

    Returns (the pods `me` selects and owns, sorted by name; pod name -> the owning topology
    for the pods `me` selects but an older topology owns). `others` are the namespace's other
    topologies (one named as `me` is skipped: `me`, as read fresh, stands for it). The claim
    depends only on the topologies' creation times, names and selectors and on the pods'
    labels: never on timing, so two topologies never take turns."""
    if me.spec is None:
        return (), {}
    mine = pods_of(me.spec, pods)
    rank = claim_order(me)
    older = sorted(
        (t for t in others if t.name != me.name and t.spec is not None and claim_order(t) < rank),
        key=claim_order,
    )
    owned: list[PodView] = []
    elsewhere: dict[str, str] = {}
    for pod in mine:
        owner = next((t.name for t in older if t.spec is not None and pods_of(t.spec, [pod])), None)
        if owner is None:
            owned.append(pod)
        else:
            elsewhere[pod.name] = owner
    return tuple(owned), elsewhere


def conflict_of(claimed: Iterable[tuple[str, str]]) -> tuple[str, Reason, str]:
    """The Conflict condition (status, reason, message) of a topology, given the pods it
    selects that older topologies own, as (pod, owner). Always present: False without any."""
    by_owner: dict[str, list[str]] = {}
    for pod, owner in sorted(claimed):
        by_owner.setdefault(owner, []).append(pod)
    if not by_owner:
        return "False", Reason.NO_CONFLICT, "no pod selected here belongs to another KVTopology"
    n = sum(len(pods) for pods in by_owner.values())
    parts = []
    for owner, pods in sorted(by_owner.items()):
        more = f" and {len(pods) - 20} more" if len(pods) > 20 else ""
        parts.append(f"{', '.join(pods[:20])}{more} (owned by KVTopology {owner})")
    message = (
        f"{n} selected pod(s) belong to an older KVTopology (the oldest selecting a pod owns "
        f"it, ties by name) and are left alone here: {'; '.join(parts)}"
    )
    return "True", Reason.PODS_CLAIMED_ELSEWHERE, message


def _paired(spec: KVTopologySpec, p: PodView, d: PodView) -> bool:
    return all(p.labels.get(k, "") == d.labels.get(k, "") for k in spec.pairing.match_labels)


def _condition(
    previous: Mapping[str, Condition],
    ctype: ConditionType,
    status: str,
    reason: Reason,
    message: str,
    generation: int,
    now: datetime,
) -> Condition:
    old = previous.get(ctype.value)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    return Condition(
        type=ctype,
        status=status,  # type: ignore[arg-type]
        reason=reason.value,
        message=message[:1024],
        last_transition_time=since,
        observed_generation=generation,
    )


# --- evaluate ----------------------------------------------------------------------------


@dataclass
class _Live:
    pod: PodView
    worker: WorkerView


def _holds(holder: WorkerView, peer: WorkerView) -> bool:
    """Whether `holder` holds `peer` as it is now: its engine, not being evicted, its
    current incarnation (agents of a process that restarted under the same engine id are a
    dead peer's, to be replaced), and healthy (a peer NIXL has dropped, or whose transfers
    keep failing, is renewed by the next add of it)."""
    return (
        peer.engine_id in holder.peers
        and peer.engine_id not in holder.evicting
        and holder.peer_incarnations.get(peer.engine_id, "") == peer.incarnation
        and peer.engine_id not in holder.unhealthy_peers
    )


def evaluate(obs: Observed, now: datetime) -> Plan:
    """Gather -> **evaluate** -> act: everything the operator decides, as data."""
    spec = obs.spec
    prev_engines = {e.engine_id: e for e in obs.previous.engines if e.engine_id}
    pods = tuple(p for p in pods_of(spec, obs.pods) if p.name not in obs.claimed)
    grace = timedelta(seconds=spec.eviction.grace_seconds)

    live: dict[str, _Live] = {}  # engine_id -> usable engine
    # pod name -> (pod, message, reason): engines the operator cannot (or must not) act on
    unreachable: dict[str, tuple[PodView, str, Reason]] = {}
    waiting: list[PodView] = []
    for pod in pods:
        worker = obs.workers.get(pod.name)
        if pod.endpoint_error and pod.ready and not pod.deleting:
            unreachable[pod.name] = (pod, pod.endpoint_error, Reason.ENDPOINT_REFUSED)
            continue
        if not pod.ready or pod.deleting or not pod.endpoint:
            continue
        if isinstance(worker, WorkerUnreachable):
            unreachable[pod.name] = (
                pod,
                f"worker unreachable: {worker.message}",
                Reason.WORKER_UNREACHABLE,
            )
        elif worker is None:
            waiting.append(pod)
        elif worker.pod_uid != pod.uid:
            msg = (
                f"the worker at {pod.endpoint} is not this pod's: it reports pod uid "
                f"{worker.pod_uid or '(none)'}, the pod's is {pod.uid}; start the worker "
                "with its pod identity (--pod-uid, from the downward API)"
            )
            unreachable[pod.name] = (pod, msg, Reason.IDENTITY_MISMATCH)
        elif worker.role != pod.role:
            msg = f"worker unreachable: worker reports role {worker.role}, pod says {pod.role}"
            unreachable[pod.name] = (pod, msg, Reason.WORKER_UNREACHABLE)
        else:
            live[worker.engine_id] = _Live(pod, worker)
    pods_with_unreachable_worker = set(unreachable)

    # Pairs.
    prefills = sorted(
        (e for e in live.values() if e.pod.role == "prefill"), key=lambda e: e.pod.name
    )
    decodes = sorted((e for e in live.values() if e.pod.role == "decode"), key=lambda e: e.pod.name)
    expected: set[tuple[str, str]] = set()
    incompatible: dict[str, list[str]] = {}
    connected: set[tuple[str, str]] = set()
    handshakes: list[Handshake] = []
    # (holder, peer) -> (holder pod, peer pod, "health: reason") of peers held unhealthy
    unhealthy: dict[tuple[str, str], tuple[str, str, str]] = {}
    for p in prefills:
        for d in decodes:
            if not _paired(spec, p.pod, d.pod):
                continue
            pid, did = p.worker.engine_id, d.worker.engine_id
            if p.worker.compat_hash != d.worker.compat_hash:
                msg = (
                    f"{p.pod.name} ({p.worker.compat_hash}) and {d.pod.name} "
                    f"({d.worker.compat_hash}) have different compatibility hashes"
                )
                incompatible.setdefault(pid, []).append(msg)
                incompatible.setdefault(did, []).append(msg)
                continue
            expected.add((pid, did))
            for a, b in ((p, d), (d, p)):
                health = a.worker.unhealthy_peers.get(b.worker.engine_id)
                if health is not None and b.worker.engine_id in a.worker.peers:
                    key = (a.worker.engine_id, b.worker.engine_id)
                    unhealthy[key] = (a.pod.name, b.pod.name, health)
            p_has = _holds(p.worker, d.worker)
            d_has = _holds(d.worker, p.worker)
            if p_has and d_has:
                connected.add((pid, did))
            if not p_has:
                handshakes.append(
                    Handshake(
                        p.pod.name,
                        p.pod.endpoint,
                        did,
                        d.pod.endpoint,
                        "decode",
                        d.pod.uid,
                        d.worker.incarnation,
                        pid,
                    )
                )
            if not d_has:
                handshakes.append(
                    Handshake(
                        d.pod.name,
                        d.pod.endpoint,
                        pid,
                        p.pod.endpoint,
                        "prefill",
                        p.pod.uid,
                        p.worker.incarnation,
                        did,
                    )
                )

    # Gone engines: known before (or held as a peer somewhere) but not live now.
    gone: dict[str, tuple[str, str, str, datetime]] = {}  # id -> (pod, role, endpoint, since)
    held = {peer for e in live.values() for peer in e.worker.peers - e.worker.evicting}
    for eid, prev in prev_engines.items():
        if eid in live or prev.state == EngineState.EVICTED:
            continue
        if prev.pod in obs.claimed and eid not in held:
            continue  # handed over to the older topology that owns its pod: not gone
        if prev.pod in pods_with_unreachable_worker and prev.state != EngineState.DRAINING:
            continue  # cannot tell: keep it as it was until its worker answers again
        since = parse_time(prev.since) if prev.state == EngineState.DRAINING else now
        since = min(since, obs.memory.gone_since.get(eid, since))
        gone[eid] = (prev.pod, prev.role, prev.endpoint, since)
    for e in live.values():
        for peer in e.worker.peers - e.worker.evicting:
            if peer not in live and peer not in gone:
                known = prev_engines.get(peer)
                if known is not None and known.state == EngineState.EVICTED:
                    since = parse_time(known.since) - grace  # evicted before: due at once
                else:
                    since = obs.memory.gone_since.get(peer, now)
                role = "decode" if e.pod.role == "prefill" else "prefill"
                gone[peer] = (
                    known.pod if known else "",
                    role,
                    known.endpoint if known else "",
                    since,
                )

    evictions: list[Eviction] = []
    still_held: dict[str, int] = {}
    due_in: list[float] = []
    # Pairing is level-based both ways: a connection between two live engines that should
    # no longer be paired (a pairing label or the spec's pairing changed, or they became
    # incompatible) is evicted after the grace, like a gone engine.
    partners: dict[str, set[str]] = {}
    for pid, did in expected:
        partners.setdefault(pid, set()).add(did)
        partners.setdefault(did, set()).add(pid)
    unpairing: dict[tuple[str, str], datetime] = {}  # (holder, peer) -> since
    for eid, e in live.items():
        for peer in sorted(e.worker.peers - e.worker.evicting):
            if peer not in live or peer in partners.get(eid, set()):
                continue
            since = obs.memory.unpairing_since.get((eid, peer), now)
            unpairing[(eid, peer)] = since
            if now - since >= grace:
                evictions.append(Eviction(e.pod.name, e.pod.endpoint, peer))
            else:
                due_in.append((since + grace - now).total_seconds())
    for eid, (_pod, _role, _ep, since) in gone.items():
        holders = [e for e in live.values() if eid in e.worker.peers]
        still_held[eid] = len(holders)
        if holders and now - since < grace:
            due_in.append((since + grace - now).total_seconds())
        if now - since >= grace:
            evictions.extend(
                Eviction(h.pod.name, h.pod.endpoint, eid)
                for h in holders
                if eid not in h.worker.evicting
            )

    # Failures: deltas of each worker's counters since the last time we read them.
    memory = obs.memory
    counts = dict(obs.previous.failures.counts if memory.counts is None else memory.counts)
    last = obs.previous.failures.last if memory.counts is None else memory.last
    newest: tuple[float, LastFailure] | None = None
    seen_now: dict[str, dict[str, int]] = {}
    delta_total: dict[str, int] = {}
    for eid, e in live.items():
        if eid in memory.baselines:  # read before, also while it blipped NotReady
            prev_seen = dict(memory.baselines[eid])
        else:
            prev_seen = prev_engines[eid].failures_seen if eid in prev_engines else {}
        seen_now[eid] = dict(e.worker.failures)
        grew = False
        for ftype, value in e.worker.failures.items():
            base = prev_seen.get(ftype, 0)
            delta = value - base if value >= base else value
            if delta > 0:
                counts[ftype] = counts.get(ftype, 0) + delta
                delta_total[ftype] = delta_total.get(ftype, 0) + delta
                grew = True
        lf = e.worker.last_failure
        if grew and lf is not None and (newest is None or lf.time > newest[0]):
            newest = (
                lf.time,
                LastFailure(
                    time=rfc3339(datetime.fromtimestamp(lf.time, UTC)),
                    type=lf.type,
                    engine_id=eid,
                    pod=e.pod.name,
                    request_id=lf.request_id,
                    message=(f"peer {lf.engine_id}: " if lf.engine_id else "") + lf.message,
                ),
            )
    if newest is not None:
        last = newest[1]

    # Engines in status.
    engines: list[EngineStatus] = []
    events: list[Event] = []
    pair_count: dict[str, tuple[int, int]] = {}
    for pid, did in expected:
        for eid in (pid, did):
            ok, total = pair_count.get(eid, (0, 0))
            pair_count[eid] = (ok + ((pid, did) in connected), total + 1)
    for eid, e in sorted(live.items(), key=lambda kv: kv[1].pod.name):
        was = prev_engines.get(eid)
        ok, total = pair_count.get(eid, (0, 0))
        if eid in incompatible:
            state, message = EngineState.INCOMPATIBLE, "; ".join(incompatible[eid])[:512]
            if was is None or was.state != EngineState.INCOMPATIBLE:
                events.append(Event("Warning", "Incompatible", message))
        elif total == 0:
            state, message = EngineState.PENDING, "no peer to pair with"
        elif ok == total:
            state, message = EngineState.CONNECTED, f"{ok}/{total} pairs connected"
        else:
            state, message = EngineState.HANDSHAKING, f"{ok}/{total} pairs connected"
        stamp = was.since if was is not None and was.state == state else precise(now)
        engines.append(
            EngineStatus(
                pod=e.pod.name,
                role=e.pod.role,  # type: ignore[arg-type]
                engine_id=eid,
                endpoint=e.pod.endpoint,
                state=state,
                peers=len(e.worker.peers - e.worker.evicting),
                since=stamp,
                message=message,
                compat_hash=e.worker.compat_hash,
                failures_seen=seen_now.get(eid, {}),
            )
        )
    for pod, message, why in sorted(unreachable.values(), key=lambda pr: pr[0].name):
        prev_for_pod = next((x for x in obs.previous.engines if x.pod == pod.name), None)
        told = prev_for_pod is not None and prev_for_pod.message == message[:512]
        if why != Reason.WORKER_UNREACHABLE and not told:
            events.append(Event("Warning", why.value, f"{pod.name}: {message}"))
        engines.append(
            EngineStatus(
                pod=pod.name,
                role=pod.role,  # type: ignore[arg-type]
                engine_id=prev_for_pod.engine_id if prev_for_pod else "",
                endpoint=pod.endpoint,
                state=EngineState.FAILED,
                since=prev_for_pod.since
                if prev_for_pod and prev_for_pod.state == EngineState.FAILED
                else precise(now),
                message=message[:512],
                failures_seen=prev_for_pod.failures_seen if prev_for_pod else {},
            )
        )
    for eid, (pod_name, role, endpoint, since) in sorted(gone.items()):
        was = prev_engines.get(eid)
        if still_held[eid] == 0 and (now - since >= grace or not pod_name):
            state = EngineState.EVICTED
            if was is not None and was.state != EngineState.EVICTED:
                events.append(
                    Event(
                        "Normal",
                        "EngineEvicted",
                        f"engine {eid} ({pod_name}) evicted from every peer",
                    )
                )
            stamp = (
                was.since if was is not None and was.state == EngineState.EVICTED else precise(now)
            )
            message = "evicted from every peer"
        else:
            state = EngineState.DRAINING
            stamp = precise(since)
            message = (
                f"gone; evicted from {still_held[eid]} peer(s) "
                f"after {spec.eviction.grace_seconds}s grace"
            )
        if not pod_name and state == EngineState.EVICTED:
            continue  # an unknown stale peer, now gone: nothing worth keeping
        engines.append(
            EngineStatus(
                pod=pod_name,
                role=role,  # type: ignore[arg-type]
                engine_id=eid,
                endpoint=endpoint,
                state=state,
                peers=0,
                since=stamp,
                message=message,
            )
        )
    # Keep recently evicted engines a while, then let them go.
    for old in obs.previous.engines:
        if (
            old.state == EngineState.EVICTED
            and old.pod not in obs.claimed
            and old.engine_id not in gone
            and old.engine_id not in live
            and now - parse_time(old.since) < EVICTED_RETENTION
        ):
            engines.append(old.model_copy(update={"failures_seen": {}}))
    engines.sort(key=lambda x: (x.state == EngineState.EVICTED, x.role, x.pod, x.engine_id))
    engines = engines[:MAX_ENGINES_IN_STATUS]

    if delta_total:
        desc = ", ".join(f"{k}={v}" for k, v in sorted(delta_total.items()))
        events.append(
            Event("Warning", "TransferFailures", f"new failures reported by workers: {desc}")
        )
    # Peers held unhealthy are re-handshaked (the worker renews them): a Warning when a
    # (holder, peer) starts being so, not every round.
    fresh = sorted(k for k in unhealthy if k not in obs.memory.unhealthy)
    if fresh:
        said = "; ".join(
            f"{unhealthy[k][0]} reports {unhealthy[k][1]} (engine {k[1]}) {unhealthy[k][2]}"
            for k in fresh[:5]
        )
        more = f" (and {len(fresh) - 5} more)" if len(fresh) > 5 else ""
        warning = f"re-handshaking {len(fresh)} peer(s) their holders report unhealthy: {said}"
        events.append(Event("Warning", PEER_UNHEALTHY, warning + more))

    # Conflict: pods selected here that an older topology owns (`owned_pods`) are left to it;
    # a Warning Event when that begins (the condition: `conditions_of`, `conflict_of`).
    claimed = tuple(sorted(obs.claimed.items()))
    was_conflict = next(
        (c for c in obs.previous.conditions if c.type == ConditionType.CONFLICT), None
    )
    if claimed and (was_conflict is None or was_conflict.status != "True"):
        events.append(Event("Warning", ConditionType.CONFLICT.value, conflict_of(claimed)[2]))

    # Conditions.
    unpaired = tuple(
        sorted(
            e.pod.name
            for eid, e in live.items()
            if eid not in incompatible and not any(eid in pair for pair in expected)
        )
    )
    progress = Progress(
        expected=frozenset(expected),
        connected=frozenset(connected),
        unpaired=unpaired,
        handshakes_left=len(handshakes),
        draining=sum(1 for e in engines if e.state == EngineState.DRAINING),
        incompatible=len(incompatible),
        unreachable=tuple(sorted((name, why) for name, (_, _, why) in unreachable.items())),
        claimed=claimed,
        selected=(
            sum(1 for p in pods if p.role == "prefill"),
            sum(1 for p in pods if p.role == "decode"),
        ),
        live=tuple(sorted((e.pod.name, eid) for eid, e in live.items())),
    )
    conditions = conditions_of(progress, obs.previous.conditions, obs.generation, now)
    status = KVTopologyStatus(
        observed_generation=obs.generation,
        conditions=conditions,
        summary=summary_of(engines, progress),
        engines=engines,
        failures=Failures(counts=counts, last=last),
    )
    # Settings: eviction.idleTTLSeconds on every usable worker that reports another value.
    ttl = float(spec.eviction.idle_ttl_seconds)
    idle_ttls = [
        SetIdleTTL(e.pod.name, e.pod.endpoint, ttl)
        for e in live.values()
        if e.worker.idle_ttl_s is not None and e.worker.idle_ttl_s != ttl
    ]
    return Plan(
        handshakes=tuple(sorted(handshakes)),
        evictions=tuple(sorted(evictions)),
        status=status,
        events=tuple(events),
        expected_pairs=frozenset(expected),
        connected_pairs=frozenset(connected),
        progress=progress,
        memory=dataclasses.replace(
            _remember(memory, gone, seen_now, counts, last, now),
            unpairing_since=unpairing,
            unhealthy=frozenset(unhealthy),
        ),
        wake_in_s=min(due_in) if due_in else None,
        idle_ttls=tuple(sorted(idle_ttls)),
        unhealthy_peers=frozenset(unhealthy),
    )


def _remember(
    memory: Memory,
    gone: Mapping[str, tuple[str, str, str, datetime]],
    seen_now: Mapping[str, Mapping[str, int]],
    counts: Mapping[str, int],
    last: LastFailure | None,
    now: datetime,
) -> Memory:
    """The memory after this round: gone engines' timers, baselines (kept EVICTED_RETENTION
    after an engine was last read, so a NotReady blip does not count its counters twice)."""
    baselines = dict(memory.baselines)
    seen_at = dict(memory.seen_at)
    for eid, seen in seen_now.items():
        baselines[eid] = dict(seen)
        seen_at[eid] = now
    for eid in [e for e, t in seen_at.items() if now - t > EVICTED_RETENTION]:
        baselines.pop(eid, None)
        seen_at.pop(eid, None)
    return Memory(
        gone_since={eid: g[3] for eid, g in gone.items()},
        baselines=baselines,
        seen_at=seen_at,
        counts=dict(counts),
        last=last,
    )


def conditions_of(
    progress: Progress, previous: Iterable[Condition], generation: int, now: datetime
) -> list[Condition]:
    """Ready, Progressing and Degraded, told as they are.

    Ready is True only when every pair is connected and every usable engine has a partner
    (an engine with none is not ready to move KV, whatever the pair count says). Degraded
    names the worst problem: incompatible engines, engines that cannot be acted on, then
    handshakes failing past the progress deadline (`HandshakeFailed`)."""
    prev = {c.type.value: c for c in previous}
    n_exp, n_conn = len(progress.expected), len(progress.connected)
    pairs = f"{n_conn}/{n_exp} pairs connected"
    lonely = ""
    if progress.unpaired:
        names = ", ".join(progress.unpaired[:10])
        more = f" and {len(progress.unpaired) - 10} more" if len(progress.unpaired) > 10 else ""
        lonely = f"{len(progress.unpaired)} engine(s) with no partner to pair with: {names}{more}"
    if n_exp == 0 and lonely:
        ready = ("False", Reason.ENGINES_UNPAIRED, f"{lonely}; no pair to connect")
    elif n_exp == 0:
        message = "no prefill/decode pair to connect"
        if progress.claimed:
            message += (
                f"; {len(progress.claimed)} selected pod(s) belong to an older KVTopology "
                "(see the Conflict condition)"
            )
        ready = ("False", Reason.NO_ENGINES, message)
    elif lonely:
        ready = ("False", Reason.ENGINES_UNPAIRED, f"{lonely}; {pairs}")
    elif n_conn == n_exp:
        ready = ("True", Reason.ALL_PAIRS_CONNECTED, pairs)
    else:
        ready = ("False", Reason.PAIRS_MISSING, pairs)
    if progress.failing and progress.handshakes_left:
        progressing = (
            "True",
            Reason.HANDSHAKING,
            f"{progress.handshakes_left} handshake(s) to make, "
            f"{len(progress.failing)} failing past the progress deadline",
        )
    elif progress.handshakes_left:
        progressing = (
            "True",
            Reason.HANDSHAKING,
            f"{progress.handshakes_left} handshake(s) to make",
        )
    elif progress.draining:
        progressing = ("True", Reason.DRAINING, f"{progress.draining} engine(s) draining")
    else:
        progressing = ("False", Reason.STABLE, "nothing to do")
    if progress.incompatible:
        degraded = ("True", Reason.INCOMPATIBLE, f"{progress.incompatible} engine(s) incompatible")
    elif progress.unreachable:
        order = [Reason.ENDPOINT_REFUSED, Reason.IDENTITY_MISMATCH, Reason.WORKER_UNREACHABLE]
        worst = min((why for _, why in progress.unreachable), key=order.index)
        names = ", ".join(name for name, _ in progress.unreachable)
        label = {
            Reason.ENDPOINT_REFUSED: "engines with a refused endpoint or unreachable workers",
            Reason.IDENTITY_MISMATCH: "engines whose worker is not their pod's, or unreachable",
        }.get(worst, "unreachable workers")
        degraded = ("True", worst, f"{label}: {names}")
    elif progress.failing:
        shown = "; ".join(progress.failing[:5])
        more = f" (and {len(progress.failing) - 5} more)" if len(progress.failing) > 5 else ""
        degraded = (
            "True",
            Reason.HANDSHAKE_FAILED,
            f"{len(progress.failing)} handshake(s) failing past the progress deadline: "
            f"{shown}{more}",
        )
    else:
        degraded = ("False", Reason.HEALTHY, "")
    return [
        _condition(prev, ConditionType.READY, *ready, generation, now),
        _condition(prev, ConditionType.PROGRESSING, *progressing, generation, now),
        _condition(prev, ConditionType.DEGRADED, *degraded, generation, now),
        _condition(prev, ConditionType.CONFLICT, *conflict_of(progress.claimed), generation, now),
    ]


@dataclass(frozen=True)
class FailingHandshake:
    """A handshake that has failed in every round since `since` (the operator's memory)."""

    since: datetime
    message: str


def settle(
    plan: Plan,
    made: Iterable[Handshake],
    failing: Mapping[Handshake, FailingHandshake],
    previous: KVTopologyStatus,
    generation: int,
    deadline: timedelta,
    now: datetime,
) -> tuple[KVTopologyStatus, tuple[Event, ...], Progress]:
    """The plan's status after acting: pairs whose missing halves were all made are
    connected, their engines too, and the conditions are computed from that and from the
    handshakes failing past `deadline` (one Warning Event when that first happens). Also
    returns the progress after acting (what the readiness gate is decided from)."""
    made_set = set(made)
    missing: dict[tuple[str, str], list[Handshake]] = {}
    for h in plan.handshakes:
        missing.setdefault(h.pair, []).append(h)
    connected = set(plan.progress.connected) | {
        pair
        for pair, halves in missing.items()
        if pair in plan.progress.expected and all(h in made_set for h in halves)
    }
    late = [
        f"{h.pod} adding {h.peer_role} {h.peer_engine_id}: {f.message}"[:300]
        for h, f in sorted(failing.items())
        if now - f.since >= deadline
    ]
    progress = dataclasses.replace(
        plan.progress,
        connected=frozenset(connected),
        handshakes_left=len(plan.handshakes) - len(made_set & set(plan.handshakes)),
        failing=tuple(late),
    )
    per_engine: dict[str, tuple[int, int]] = {}
    for pair in progress.expected:
        for eid in pair:
            ok, total = per_engine.get(eid, (0, 0))
            per_engine[eid] = (ok + (pair in connected), total + 1)
    engines = []
    for entry in plan.status.engines:
        ok, total = per_engine.get(entry.engine_id, (0, 0))
        settled = entry
        if entry.state in (EngineState.HANDSHAKING, EngineState.CONNECTED) and total:
            state = EngineState.CONNECTED if ok == total else EngineState.HANDSHAKING
            if state != entry.state:
                was = next((x for x in previous.engines if x.engine_id == entry.engine_id), None)
                since = was.since if was is not None and was.state == state else precise(now)
                message = f"{ok}/{total} pairs connected"
                settled = entry.model_copy(
                    update={"state": state, "since": since, "message": message}
                )
        engines.append(settled)
    conditions = conditions_of(progress, previous.conditions, generation, now)
    summary = summary_of(engines, progress)
    events: tuple[Event, ...] = ()
    was_degraded = next((c for c in previous.conditions if c.type == ConditionType.DEGRADED), None)
    now_degraded = next(c for c in conditions if c.type == ConditionType.DEGRADED)
    if now_degraded.reason == Reason.HANDSHAKE_FAILED.value and (
        was_degraded is None or was_degraded.reason != Reason.HANDSHAKE_FAILED.value
    ):
        events = (Event("Warning", Reason.HANDSHAKE_FAILED.value, now_degraded.message),)
    status = plan.status.model_copy(
        update={"conditions": conditions, "engines": engines, "summary": summary}
    )
    return status, events, progress


def summary_of(engines: Iterable[EngineStatus], progress: Progress) -> Summary:
    """The printer columns: engines Connected (to every partner they must have) / pods
    selected, per role, and connected / expected pairs."""
    done = {"prefill": 0, "decode": 0}
    for e in engines:
        if e.state == EngineState.CONNECTED and e.role in done:
            done[e.role] += 1
    n_prefill, n_decode = progress.selected
    return Summary(
        prefill=f"{done['prefill']}/{n_prefill}",
        decode=f"{done['decode']}/{n_decode}",
        pairs=f"{len(progress.connected)}/{len(progress.expected)}",
    )


def invalid_spec(
    previous: KVTopologyStatus, generation: int, message: str, now: datetime
) -> tuple[KVTopologyStatus, tuple[Event, ...]]:
    """The status of a topology whose spec this operator cannot read (a CRD of another
    version let it through): the conditions say so (Ready=False, Progressing=False,
    Degraded=True, reason InvalidSpec) and everything else is kept as it was (engines,
    counters, the Conflict condition): nothing is decided or done until the spec is fixed
    (nor does such a topology claim any pod). An Event on the way in."""
    prev = {c.type.value: c for c in previous.conditions}
    text = f"the spec cannot be read by this operator: {message}"
    conditions = [
        _condition(prev, ConditionType.READY, "False", Reason.INVALID_SPEC, text, generation, now),
        _condition(
            prev, ConditionType.PROGRESSING, "False", Reason.INVALID_SPEC, text, generation, now
        ),
        _condition(
            prev, ConditionType.DEGRADED, "True", Reason.INVALID_SPEC, text, generation, now
        ),
        *[c for c in previous.conditions if c.type == ConditionType.CONFLICT],
    ]
    was = prev.get(ConditionType.DEGRADED.value)
    events: tuple[Event, ...] = ()
    if was is None or was.reason != Reason.INVALID_SPEC.value:
        events = (Event("Warning", Reason.INVALID_SPEC.value, text[:1024]),)
    status = previous.model_copy(
        update={"observed_generation": generation, "conditions": conditions}
    )
    return status, events


def record_operator_failures(
    status: KVTopologyStatus, failures: Iterable[tuple[str, LastFailure]]
) -> KVTopologyStatus:
    """Adds failures the operator itself saw while acting (e.g. a worker it could not reach
    for a handshake) to the status counters."""
    items = list(failures)
    if not items:
        return status
    counts = dict(status.failures.counts)
    for ftype, _ in items:
        counts[ftype] = counts.get(ftype, 0) + 1
    return status.model_copy(update={"failures": Failures(counts=counts, last=items[-1][1])})
