"""The operator's data: what it observes and what it decides, as plain frozen values.

Owns the types the decision functions (`kvtopo_operator.logic`, `kvtopo_operator.gate`) take
and return, and the reconciler (`kvtopo_operator.reconcile`) builds and acts on: the views of
pods, workers and topologies; the operator's memory between rounds; the plan (handshakes,
evictions, settings, Events, the status) and the progress the conditions are computed from;
and the time stamps the status uses. No behaviour beyond small derived properties and a
worker view made from another (`WorkerView.answered`: what a worker's answer to the
operator's call changed, with the lineage the decision's memo patches by); no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from kvtopo_operator.api import KVTopologySpec, KVTopologyStatus, LastFailure, Reason

Role = str  # "prefill" | "decode"

# The largest failure count the status carries: counters saturate here (the API server
# stores integers as int64; one past refuses the whole status with 422).
MAX_COUNT = 2**63 - 1


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
    gate_reason: str = ""  # and its reason
    # The pod was marked not Ready by its node's lifecycle (node NotReady or unreachable):
    # since when (epoch seconds). Such a pod is not `ready`; its engine is gone from then.
    lost_since: float | None = None


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
    # The worker's ETag of the answer this view was read from ("": none, or the view was
    # changed here since: only a view exactly as read may be confirmed by a 304).
    etag: str = ""
    # Not data (never compared, shown or copied by `dataclasses.replace`): the views this
    # one was made from here by `derive`, nearest first, each weakly, with the engine ids
    # whose holding (peers, evicting, incarnations, health) may differ since. A round's
    # decision patches last round's results by it instead of computing them anew.
    lineage: tuple[tuple[weakref.ref[WorkerView], frozenset[str]], ...] = field(
        default=(), init=False, compare=False, repr=False
    )

    def derive(self, changed: Iterable[str], **fields: Any) -> WorkerView:
        """This view with `fields` replaced and no ETag (no longer the view as read), where
        the holding of no engine beyond `changed` differs."""
        new = dataclasses.replace(self, etag="", **fields)
        ids = frozenset(changed)
        older = [(ref, held | ids) for ref, held in self.lineage[: LINEAGE_DEPTH - 1]]
        object.__setattr__(new, "lineage", ((weakref.ref(self), ids), *older))
        return new

    def changed_since(self, old: WorkerView) -> frozenset[str] | None:
        """The engine ids whose holding may differ between `old` and this view, when this
        view was derived from it (None when that is not known: compare them whole)."""
        if old is self:
            return frozenset()
        for ref, ids in self.lineage:
            if ref() is old:
                return ids
        return None

    def answered(self, added: Mapping[str, str], evicted: Mapping[str, str]) -> WorkerView:
        """This view after the worker answered a batch: it holds each engine of `added`
        (engine id -> its incarnation; added, renewed or present, healthy), and each of
        `evicted` (engine id -> the result) is evicted or absent, or "deferred" (held
        until its transfers finish)."""
        # One copy of each record (a prefill's holds two thousand peers), made by the set
        # and dict operations in C; the evicting set is tiny and copied only when touched.
        unhealthy = self.unhealthy_peers
        if any(eid in unhealthy for eid in added):
            unhealthy = {k: w for k, w in unhealthy.items() if k not in added}
        incarnations = {**self.peer_incarnations, **added}
        deferred = [eid for eid, result in evicted.items() if result == "deferred"]
        gone = [eid for eid, result in evicted.items() if result != "deferred"]
        peers = self.peers.union(added).difference(gone) if gone else self.peers.union(added)
        evicting = self.evicting
        if deferred or (gone and not evicting.isdisjoint(gone)):
            evicting = evicting.union(deferred).difference(gone)
        return self.derive(
            added.keys() | evicted.keys(),
            peers=peers,
            evicting=evicting,
            peer_incarnations=incarnations,
            unhealthy_peers=unhealthy,
        )


# How many views back a view's `lineage` reaches (a round's calls derive a view once or
# twice: adds, then evictions).
LINEAGE_DEPTH = 4


@dataclass(frozen=True)
class WorkerUnreachable:
    """The worker's state could not be read this round (`identity_mismatch`: its endpoint
    claims to be another pod's worker, so nothing signed was sent there; `refused`: the
    worker answered, with something the operator refuses: garbage, or a field beyond what
    the status or the pairing can carry; known against the engine, unlike a worker that
    cannot be reached, which may be the operator's own network's fault)."""

    message: str
    identity_mismatch: bool = False
    refused: bool = False


class RoundCache:
    """`evaluate`'s memo of its per-engine set operations (a prefill holds a thousand
    peers; 500 x 1,500 engines are 750,000 pairs a round): each holder's result kept with
    the worker view and the engine set it was computed from. It is taken as it is while
    both are the same objects (views are immutable: a worker that changed is a new view),
    patched for the engines that changed where the new view was derived from the old one
    (`WorkerView.lineage`) and the set from last round's, and kept for one round after its
    last use. Not data: never compared, shown or written; an empty one only costs a round
    its full price."""

    def __init__(self) -> None:
        self.groups: dict[object, object] = {}  # group key -> its engine set (logic._Among)
        # (kind, holder engine id) -> (its view, its partners' set, the result)
        self.results: dict[tuple[str, str], tuple[object, object, frozenset[str]]] = {}
        # pod name -> (its pod view, its worker view, how `logic.usable_engines` judged them)
        self.usable: dict[str, tuple[Any, object, Any]] = {}


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
    cache: RoundCache = field(default_factory=RoundCache, compare=False, repr=False)


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


class Handshake(NamedTuple):
    """Tell the worker at `endpoint` (pod `pod`) to add engine `peer_engine_id`.

    A named tuple, not a dataclass: a rollout's surge makes tens of thousands of these in
    one round (500 new decodes x 64 prefills x 2 halves), and a tuple is built, hashed and
    ordered (field by field, as a dataclass's `order=True`) in C."""

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

    pairs_expected: int = 0  # (prefill, decode) pairs that must be connected
    missing: frozenset[tuple[str, str]] = frozenset()  # those of them not connected
    unpaired: tuple[str, ...] = ()  # pods of usable engines with no partner to pair with
    handshakes_left: int = 0
    draining: int = 0
    incompatible: int = 0
    unreachable: tuple[tuple[str, Reason], ...] = ()  # (pod, why), sorted
    failing: tuple[str, ...] = ()  # handshakes failing past the progress deadline, described
    claimed: tuple[tuple[str, str], ...] = ()  # (pod, older topology owning it): Conflict
    selected: tuple[int, int] = (0, 0)  # (prefill, decode) pods this topology owns
    live: tuple[tuple[str, str], ...] = ()  # (pod, engine id) of each usable engine, sorted
    # engine id -> (its pairs connected, its pairs expected)
    pair_counts: Mapping[str, tuple[int, int]] | None = None
    # engine id -> role of each usable engine (the summary counts from these and
    # `pair_counts`, never from the status's engine lines, which are bounded)
    live_roles: Mapping[str, str] | None = None
    # The spec's readinessGate.minConnectedPartners and availability minimums (prefill,
    # decode; None: every engine): what "available" means and when the topology is Ready.
    min_partners: int = 1
    min_available: tuple[int | None, int | None] = (None, None)
    # Pods whose engine the round cannot judge: up (ContainersReady, not being deleted)
    # but their worker not read yet or unreachable (pod name -> why). A gate that is True
    # stays True for them: nothing is known against it (fail-static; `gate.gate_changes`).
    cannot_tell: Mapping[str, str] = field(default_factory=dict)
    # engine id -> how many of the engines it holds as peers are of such pods (by the
    # engine id their pod last had): partners it may still be connected to. A True gate is
    # not turned False for want of partners those could be.
    maybe_partners: Mapping[str, int] = field(default_factory=dict)

    @property
    def pairs_connected(self) -> int:
        return self.pairs_expected - len(self.missing)


class Eviction(NamedTuple):
    """Tell the worker at `endpoint` (pod `pod`) to evict engine `engine_id`.

    A named tuple, as `Handshake`: a rollout evicts each old decode from every prefill
    (64 x 500 in one round at 64 x 2,000), and the plan sorts them."""

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
    pairs_expected: int
    pairs_connected: int
    wake_in_s: float | None = None  # when the next eviction falls due, if one is waiting
    idle_ttls: tuple[SetIdleTTL, ...] = ()  # workers whose idle TTL differs from the spec's
    progress: Progress = Progress()  # what the conditions were computed from, before acting
    memory: Memory | None = None  # what to remember for the next round (see `Memory`)
    # (holder, peer) engine ids of expected pairs whose holder reports the peer unhealthy:
    # their handshakes (in `handshakes`) renew the peer.
    unhealthy_peers: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class TopologyView:
    """A KVTopology of the namespace as the claim sees it: its name, when it was created
    and its spec (None when this operator cannot read the spec: such a topology acts on
    nothing, so it claims nothing)."""

    name: str
    created: str  # metadata.creationTimestamp (RFC 3339); "" sorts after every stamp
    spec: KVTopologySpec | None


@dataclass(frozen=True)
class FailingHandshake:
    """A handshake that has failed in every round since `since` (the operator's memory)."""

    since: datetime
    message: str


# --- time stamps -------------------------------------------------------------------------


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@functools.lru_cache(maxsize=64)
def precise(t: datetime) -> str:
    """RFC 3339 with milliseconds: engine `since` stamps drive the eviction grace, and a
    stamp truncated to the second would evict up to a second early. (A round stamps every
    line that changed with its one `now`: remembered.)"""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


@functools.lru_cache(maxsize=8192)
def parse_time(s: str) -> datetime:
    """A stamp this operator wrote (RFC 3339, with or without milliseconds); ValueError
    for anything else. Remembered: a rollout's round reads the same two thousand `since`
    stamps of its evicted engines' lines, round after round, and `strptime` is slow."""
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if "." in s else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.strptime(s, fmt).replace(tzinfo=UTC)
