"""The operator's pure decisions: observed state and time in, a plan and a status out.

Owns `evaluate()`, a chain of small named policies, each a pure function with its own
table test (tests/operator/test_policies.py):
- `usable_engines`: which engines can be acted on, and why the others cannot;
- `pair_engines`: which prefill/decode pairs must be connected (`pairing.matchLabels`,
  compatibility hashes), which are, and the handshakes missing (a half held under an old
  incarnation, being evicted, or reported unhealthy by its holder is made again);
- `gone_engines`: which engines are gone (pod deleted, not up, replaced, or restarted with a
  new engine id) and since when; an engine whose worker cannot be read is not gone;
- `evictions_due`: gone engines and connections no longer paired, evicted after
  `eviction.graceSeconds`;
- `tally_failures`: worker failure counters into totals that survive restarts and blips;
- `engine_statuses` and `topology_events`: the status's engine lines and the Events of
  transitions; `idle_ttl_changes`: workers whose idle TTL differs from the spec's.
Then the conditions (`conditions_of`, and `settle` after acting). Also owns the claim
(`owned_pods`): a pod belongs to at most one topology, the oldest of its namespace that
selects it; the others leave it alone and report a Conflict. The data types live in
`kvtopo_operator.model`. No I/O, no clock of its own: the same observed state and time
always give the same plan. Called by `kvtopo_operator.reconcile`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import repeat

from kvtopo_operator.api import (
    MAX_ENGINES_IN_STATUS,
    STALE_PEER_EXAMPLES,
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
    StalePeers,
    Summary,
)
from kvtopo_operator.model import (
    MAX_COUNT,
    Event,
    Eviction,
    FailingHandshake,
    Handshake,
    Memory,
    Observed,
    Plan,
    PodView,
    Progress,
    Role,
    RoundCache,
    SetIdleTTL,
    TopologyView,
    WorkerUnreachable,
    WorkerView,
    parse_time,
    precise,
    rfc3339,
)

EVICTED_RETENTION = timedelta(minutes=5)
PEER_UNHEALTHY = "PeerUnhealthy"  # the Event's reason when held peers are re-handshaked


# --- helpers -----------------------------------------------------------------------------


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


@dataclass(frozen=True)
class NamespaceClaim:
    """The claim of a whole namespace, made once per change of its pods or topologies and
    shared by every loop there (`claim_namespace`): each readable topology's owned pods
    (sorted by name) and the pods it selects that an older one owns (pod -> owner), and
    every pod any topology selects."""

    owned: Mapping[str, tuple[PodView, ...]]
    claimed: Mapping[str, Mapping[str, str]]
    selected: frozenset[str]
    specs: Mapping[str, KVTopologySpec]  # the spec each was claimed under


def _candidates(
    selector: LabelSelector,
    role: str,
    by_label: Mapping[tuple[str, str], list[PodView]],
    by_role: Mapping[str, list[PodView]],
) -> Iterable[PodView]:
    """The pods of `role` that may match `selector`: those carrying one of its matchLabels
    (the rarest), else every pod of the role."""
    if selector.match_labels:
        return min((by_label.get(kv, []) for kv in selector.match_labels.items()), key=len)
    return by_role.get(role, [])


def claim_namespace(topologies: Iterable[TopologyView], pods: Iterable[PodView]) -> NamespaceClaim:
    """`owned_pods` for every topology of a namespace at once, in one pass over its pods
    (a label index finds each selector's candidates): 100 topologies of 10 engines in one
    namespace once cost every round of every loop a walk over all 1,000 pods (issue 54)."""
    tops = sorted((t for t in topologies if t.spec is not None), key=claim_order)
    by_label: dict[tuple[str, str], list[PodView]] = {}
    by_role: dict[str, list[PodView]] = {}
    for pod in pods:
        if pod.role not in ("prefill", "decode"):
            continue
        by_role.setdefault(pod.role, []).append(pod)
        for kv in pod.labels.items():
            by_label.setdefault(kv, []).append(pod)
    owner: dict[str, str] = {}
    owned: dict[str, tuple[PodView, ...]] = {}
    claimed: dict[str, dict[str, str]] = {}
    for t in tops:
        assert t.spec is not None
        mine: list[PodView] = []
        elsewhere: dict[str, str] = {}
        for role, role_spec in (("prefill", t.spec.prefill), ("decode", t.spec.decode)):
            for pod in _candidates(role_spec.selector, role, by_label, by_role):
                if pod.role != role or not selector_matches(role_spec.selector, pod.labels):
                    continue
                first = owner.setdefault(pod.name, t.name)
                if first == t.name:
                    mine.append(pod)
                else:
                    elsewhere[pod.name] = first
        owned[t.name] = tuple(sorted(mine, key=lambda p: p.name))
        claimed[t.name] = elsewhere
    return NamespaceClaim(
        owned, claimed, frozenset(owner), {t.name: t.spec for t in tops if t.spec is not None}
    )


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


# --- the policies: `evaluate` is their chain ---------------------------------------------


@dataclass(frozen=True)
class Usable:
    """An engine the operator can act on: its pod and its worker's state."""

    pod: PodView
    worker: WorkerView


@dataclass(frozen=True)
class Engines:
    """The selected pods' engines, by what the operator can do with them."""

    live: Mapping[str, Usable]  # engine id -> usable engine
    # pod name -> (pod, why, reason): engines the operator cannot (or must not) act on
    unusable: Mapping[str, tuple[PodView, str, Reason]]
    # pod name -> pod: up, with an endpoint, but its worker not read yet (this round has
    # no view of it: a new leader's first rounds, a read still out)
    unread: Mapping[str, PodView] = field(default_factory=dict)


_Verdict = Usable | tuple[PodView, str, Reason] | None  # usable, why not, or not up yet


def _judge(pod: PodView, worker: WorkerView | WorkerUnreachable | None) -> _Verdict:
    """One pod's engine, for `usable_engines` (before the duplicate engine ids)."""
    if pod.endpoint_error and pod.ready and not pod.deleting:
        return (pod, pod.endpoint_error, Reason.ENDPOINT_REFUSED)
    if not pod.ready or pod.deleting or not pod.endpoint or worker is None:
        return None  # not up, going, or not read yet
    if isinstance(worker, WorkerUnreachable):
        if worker.identity_mismatch:
            return (pod, worker.message, Reason.IDENTITY_MISMATCH)
        if worker.refused:
            return (pod, worker.message, Reason.WORKER_ANSWER_REFUSED)
        return (pod, f"worker unreachable: {worker.message}", Reason.WORKER_UNREACHABLE)
    if worker.pod_uid != pod.uid:
        why = (
            f"the worker at {pod.endpoint} is not this pod's: it reports pod uid "
            f"{worker.pod_uid or '(none)'}, the pod's is {pod.uid}; start the worker "
            "with its pod identity (--pod-uid, from the downward API)"
        )
        return (pod, why, Reason.IDENTITY_MISMATCH)
    if worker.role not in (pod.role, "both"):  # a kv_both engine takes its pod's part
        why = f"worker unreachable: worker reports role {worker.role}, pod says {pod.role}"
        return (pod, why, Reason.WORKER_UNREACHABLE)
    return Usable(pod, worker)


def usable_engines(
    pods: Iterable[PodView],
    workers: Mapping[str, WorkerView | WorkerUnreachable],
    cache: RoundCache | None = None,
    holders: Mapping[str, str] | None = None,
) -> Engines:
    """Policy: which engines can be acted on. A pod that is not up, is being deleted or has
    no endpoint yet has none; a refused endpoint, an unreachable worker, a worker of another
    pod (its uid) or of another role makes the engine unusable, with the reason.

    An engine id is one engine's: the pod that held it keeps it (`holders`: engine id ->
    the pod whose engine had it, as the last round decided), and any other pod whose
    worker reports it is unusable (DuplicateEngineId, naming the holder): ids are public
    (in the status, in every peer add), so a newcomer claiming one must never knock its
    holder out. An id no pod held is kept by the claimant up first (then by name). The
    same rule decides the round (`evaluate`) and the arrivals paired between rounds
    (`admissions`).

    `cache` (last round's): a pod whose view and worker view are the objects judged last
    round (both immutable) is judged as it was, without a new `Usable`."""
    live: dict[str, Usable] = {}
    unusable: dict[str, tuple[PodView, str, Reason]] = {}
    claims: dict[str, list[Usable]] = {}
    before = cache.usable if cache is not None else {}
    judged: dict[str, tuple[PodView, object, _Verdict]] = {}
    unread: dict[str, PodView] = {}
    for pod in pods:
        worker = workers.get(pod.name)
        hit = before.get(pod.name)
        if hit is not None and hit[0] is pod and hit[1] is worker:
            verdict = hit[2]
        else:
            verdict = _judge(pod, worker)
        judged[pod.name] = (pod, worker, verdict)
        if isinstance(verdict, Usable):
            claims.setdefault(verdict.worker.engine_id, []).append(verdict)
        elif verdict is not None:
            unusable[pod.name] = verdict
        elif worker is None and pod.ready and not pod.deleting and pod.endpoint:
            unread[pod.name] = pod
    if cache is not None:
        cache.usable = judged
    held = holders or {}
    for eid, usable in claims.items():
        holder = held.get(eid)
        if len(usable) == 1 and holder in (None, usable[0].pod.name):
            live[eid] = usable[0]
            continue
        keeper = first_holder(usable, holder)
        if keeper is not None:
            live[eid] = keeper
        owner = keeper.pod.name if keeper is not None else holder
        for u in usable:
            if u is keeper:
                continue
            why = (
                f"engine id {eid} is held by pod {owner}; pod {u.pod.name}'s worker reports "
                "it too and is not paired (give each engine an id of its own)"
            )
            unusable[u.pod.name] = (u.pod, why[:480], Reason.DUPLICATE_ENGINE_ID)
    return Engines(live, unusable, unread)


STRANGER_SLACK = 64


def refuse_strangers(engines: Engines, known: Callable[[], Collection[str]]) -> Engines:
    """Policy: an engine whose worker reports more peers no pod of the topology owns
    (not in `known()`: the engines read now or remembered, the status's lines) than it has
    partners plus a slack (the larger of STRANGER_SLACK and its partner count: a rollout
    leaves gone engines it still holds) is not believed: it is unusable
    (WorkerAnswerRefused, with the count) and nothing it holds is evicted or listed. A
    worker once reported 1,500 made-up peers: they became 1,446 status lines and spent the
    topology's Event budget. Only an engine holding more peers than that bound could fail
    it, so the set difference is taken for those only."""
    per_role: Counter[str] = Counter(e.pod.role for e in engines.live.values())
    refused: dict[str, tuple[PodView, str, Reason]] = {}
    ids: Collection[str] | None = None
    for eid, e in engines.live.items():
        partners = per_role["decode" if e.pod.role == "prefill" else "prefill"]
        bound = partners + max(STRANGER_SLACK, partners)
        if len(e.worker.peers) <= bound:
            continue
        ids = known() if ids is None else ids
        strangers = len(e.worker.peers.difference(ids))
        if strangers > bound:
            why = (
                f"worker answer refused: it holds {strangers} peers no pod of the topology "
                f"has (at most {bound} believed: {partners} partners and the slack)"
            )
            refused[eid] = (e.pod, why, Reason.WORKER_ANSWER_REFUSED)
    if not refused:
        return engines
    live = {eid: e for eid, e in engines.live.items() if eid not in refused}
    unusable = dict(engines.unusable)
    unusable.update((v[0].name, v) for v in refused.values())
    return Engines(live, unusable, engines.unread)


def _known_ids(obs: Observed, engines: Engines) -> set[str]:
    """The engine ids of the topology as this round knows them: usable now, in the last
    status, gone or read within the memory's retention."""
    known = set(engines.live)
    known.update(e.engine_id for e in obs.previous.engines if e.engine_id)
    known.update(obs.memory.gone_since)
    known.update(obs.memory.seen_at)
    return known


def id_holders(previous: KVTopologyStatus, pods: Iterable[PodView]) -> dict[str, str]:
    """engine id -> the pod whose engine had it at the last round (its status line), for
    the pods still here and not being deleted: who keeps an id several workers report."""
    here = {p.name for p in pods if not p.deleting}
    return {
        e.engine_id: e.pod
        for e in previous.engines
        if e.engine_id and e.pod in here and e.state != EngineState.EVICTED
    }


def first_holder(claimants: list[Usable], holder: str | None) -> Usable | None:
    """Of the engines whose workers report one engine id, the one that keeps it: the pod
    that held it (`holder`); when no claimant is that pod and it held the id, nobody (the
    holder is elsewhere: not among these, or its engine cannot be judged now); when no pod
    held it, the claimant up first, then by pod name."""
    if holder is not None:
        return next((u for u in claimants if u.pod.name == holder), None)
    return min(
        claimants, key=lambda u: (u.pod.ready_since is None, u.pod.ready_since or 0.0, u.pod.name)
    )


def cannot_tell(
    engines: Engines, previous: KVTopologyStatus
) -> tuple[dict[str, str], dict[str, int]]:
    """Policy (fail-static): the pods whose engine this round cannot judge, and for each
    usable engine how many of its held peers are theirs. Such a pod is up but its worker
    is unread (a new leader's or a restarted operator's first rounds) or unreachable from
    the operator (which may be the operator's own network, not the engine's): nothing is
    known against its engine, so its gate is not turned False, nor are its partners'
    for want of it (`gate.gate_changes`). A peer is recognised by the engine id its pod
    had in the last status. Returns (pod -> why, engine id -> such peers held)."""
    unknown = {name: "its worker is not read yet" for name in engines.unread}
    for name, (_, why, reason) in engines.unusable.items():
        if reason == Reason.WORKER_UNREACHABLE:
            unknown[name] = why
    if not unknown:
        return {}, {}
    last_ids = frozenset(e.engine_id for e in previous.engines if e.pod in unknown and e.engine_id)
    maybe: dict[str, int] = {}
    if last_ids:
        for eid, e in engines.live.items():
            n = len(e.worker.peers & last_ids)
            if n:
                maybe[eid] = n
    return unknown, maybe


def holds(holder: WorkerView, peer: WorkerView) -> bool:
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


@dataclass(frozen=True)
class Pairing:
    """Which pairs must be connected, which are, and the handshakes that are missing.

    The pairs are kept by engine, not one by one (32 prefills and 1,000 decodes make 32,000
    pairs every round): each engine's partners, and the pairs not connected (those with a
    handshake to make). `expected` and `connected` spell the pairs out on demand."""

    partner_ids: Mapping[str, frozenset[str]]  # engine id -> the engine ids it pairs with
    missing: frozenset[tuple[str, str]]  # expected (prefill, decode) pairs not connected
    incompatible: Mapping[str, tuple[str, ...]]  # engine id -> why (compatibility hashes)
    handshakes: tuple[Handshake, ...]
    # (holder, peer) engine ids of expected pairs whose holder reports the peer unhealthy
    # -> (holder pod, peer pod, "health: reason")
    unhealthy: Mapping[tuple[str, str], tuple[str, str, str]]
    pair_counts: Mapping[str, tuple[int, int]]  # engine id -> (connected, expected) pairs
    n_expected: int
    roles: Mapping[str, str] = field(default_factory=dict)  # engine id -> its role
    # Usable engine id -> the peers it holds (not being evicted) that are not its partners:
    # gone engines' and unpaired ones', nearly always none.
    extra_held: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @property
    def n_connected(self) -> int:
        return self.n_expected - len(self.missing)

    @property
    def expected(self) -> frozenset[tuple[str, str]]:
        """Every (prefill, decode) pair that must be connected."""
        return frozenset(
            (eid, other)
            for eid, others in self.partner_ids.items()
            if self.roles.get(eid) == "prefill"
            for other in others
        )

    @property
    def connected(self) -> frozenset[tuple[str, str]]:
        return self.expected - self.missing

    def partners(self) -> Mapping[str, frozenset[str]]:
        """Engine id -> the engine ids it must be paired with."""
        return self.partner_ids

    def counts(self) -> Mapping[str, tuple[int, int]]:
        """Engine id -> (its pairs connected, its pairs expected)."""
        return self.pair_counts


@dataclass(frozen=True)
class _Among:
    """The engines of one side of a pairing group: their ids, and their (id, incarnation)
    pairs (those with an incarnation) for a C-speed comparison with a holder's."""

    ids: frozenset[str]
    items: frozenset[tuple[str, str]]
    no_incarnation: frozenset[str]

    @staticmethod
    def of(ids: frozenset[str], incarnation: Mapping[str, str]) -> _Among:
        return _Among(
            ids,
            frozenset((eid, incarnation[eid]) for eid in ids if incarnation[eid]),
            frozenset(eid for eid in ids if not incarnation[eid]),
        )

    def changed_since(self, old: _Among) -> frozenset[str]:
        """The engines that joined, left or changed incarnation since `old`."""
        return frozenset(eid for eid, _ in self.items ^ old.items).union(
            self.no_incarnation ^ old.no_incarnation
        )


_NO_PARTNERS: frozenset[str] = frozenset()
_NOBODY = _Among(_NO_PARTNERS, frozenset(), _NO_PARTNERS)  # an unpaired engine's partners
_new = tuple.__new__  # a Handshake from one tuple of its fields (no per-field call)


def _extra_held(holder: WorkerView, partners: frozenset[str]) -> frozenset[str]:
    """What `holder` holds, not being evicted, beyond `partners`."""
    held = holder.peers - holder.evicting if holder.evicting else holder.peers
    return held - partners


class _Memo:
    """One round's use of a `RoundCache`: an engine set equal to last round's is last
    round's object; a holder's result for the view and the set it was computed from last
    round is taken as it was (every input of these functions is immutable), and for a view
    derived from that one (`WorkerView.changed_since`) and a set changed from that one it is
    patched for the engines that changed only (a rollout's round changes every prefill's
    view and its group's set, each by a few engines of a thousand). What this round did not
    use is dropped at `done`."""

    def __init__(self, cache: RoundCache | None) -> None:
        self.cache = cache
        self.groups: dict[object, object] = {}
        self.results: dict[tuple[str, str], tuple[object, object, frozenset[str]]] = {}
        # id(this round's set) -> (last round's set at its key, the engine ids changed)
        self.since: dict[int, tuple[_Among, frozenset[str]]] = {}

    def among(self, key: object, ids: frozenset[str], incarnation: Mapping[str, str]) -> _Among:
        fresh = _Among.of(ids, incarnation)
        old = self.cache.groups.get(key) if self.cache is not None else None
        if isinstance(old, _Among):
            if old == fresh:
                fresh = old
            else:
                self.since[id(fresh)] = (old, fresh.changed_since(old))
        self.groups[key] = fresh
        return fresh

    def _changed(
        self, view: WorkerView, among: _Among, old_view: object, old_among: object
    ) -> frozenset[str] | None:
        """The engine ids whose result may differ from that for (`old_view`, `old_among`),
        or None when that is not known."""
        if not isinstance(old_view, WorkerView):
            return None
        in_view = view.changed_since(old_view)
        if in_view is None:
            return None
        if among is old_among:
            return in_view
        since = self.since.get(id(among))
        if since is None or since[0] is not old_among:
            return None
        return in_view | since[1]

    def _result(
        self,
        kind: str,
        view: WorkerView,
        among: _Among,
        compute: Callable[[], frozenset[str]],
        patch: Callable[[frozenset[str], frozenset[str]], frozenset[str]],
    ) -> frozenset[str]:
        """The holder's result for these objects when last round's was for others (its
        callers take one for these very objects first, `_same`): `patch(last round's, the
        engines changed)` when they changed from those by known engines, else `compute()`;
        kept for the next round."""
        key = (kind, view.engine_id)
        hit = self.cache.results.get(key) if self.cache is not None else None
        if hit is None:
            value = compute()
        else:
            changed = self._changed(view, among, hit[0], hit[1])
            value = compute() if changed is None else patch(hit[2], changed)
        self.results[key] = (view, among, value)
        return value

    def _same(self, kind: str, view: WorkerView, among: _Among) -> frozenset[str] | None:
        """Last round's result for these very objects, kept for the next round (None: not
        computed for them). Most holders of a large topology, round after round: their
        lookup makes nothing new."""
        if self.cache is None:
            return None
        key = (kind, view.engine_id)
        hit = self.cache.results.get(key)
        if hit is None or hit[0] is not view or hit[1] is not among:
            return None
        self.results[key] = hit
        return hit[2]

    def lacking(self, holder: WorkerView, among: _Among) -> frozenset[str]:
        """The engines of `among` that `holder` does not hold as they are now."""
        same = self._same("lacking", holder, among)
        if same is not None:
            return same

        def patch(was: frozenset[str], changed: frozenset[str]) -> frozenset[str]:
            recheck = changed & among.ids
            now = [eid for eid in recheck if not _holds_one(holder, among, eid)]
            kept = was.difference(changed) if changed else was
            return kept.union(now) if now else kept

        return self._result(
            "lacking", holder, among, lambda: among.ids - _held_as_is(holder, among), patch
        )

    def extra_held(self, holder: WorkerView, partners: _Among) -> frozenset[str]:
        """The engines `holder` holds that are none of `partners` (`_extra_held`)."""
        same = self._same("extra", holder, partners)
        if same is not None:
            return same

        def patch(was: frozenset[str], changed: frozenset[str]) -> frozenset[str]:
            now = [
                eid
                for eid in changed
                if eid in holder.peers and eid not in holder.evicting and eid not in partners.ids
            ]
            kept = was.difference(changed) if changed else was
            return kept.union(now) if now else kept

        return self._result(
            "extra", holder, partners, lambda: _extra_held(holder, partners.ids), patch
        )

    def done(self) -> None:
        if self.cache is not None:
            self.cache.groups, self.cache.results = self.groups, self.results


def _holds_one(holder: WorkerView, among: _Among, eid: str) -> bool:
    """Whether `holder` holds `eid` of `among` as it is now (`holds`, for one engine)."""
    if eid not in holder.peers or eid in holder.evicting or eid in holder.unhealthy_peers:
        return False
    known = holder.peer_incarnations.get(eid, "")
    return not known if eid in among.no_incarnation else (eid, known) in among.items


def _held_as_is(holder: WorkerView, among: _Among) -> frozenset[str]:
    """The engines of `among` that `holder` holds as they are now (`holds`), by set
    operations: a prefill holds a thousand peers."""
    candidates = holder.peers & among.ids
    if holder.evicting:
        candidates = candidates.difference(holder.evicting)
    if holder.unhealthy_peers:
        candidates = candidates.difference(holder.unhealthy_peers)
    known = holder.peer_incarnations
    # Held at another incarnation (or at none): what of `among` the holder's record lacks,
    # from the smaller side (a prefill holds two thousand peers; a new decode's arrival
    # asks about one of them).
    if len(among.items) < len(known):
        stale = [eid for eid, inc in among.items if known.get(eid) != inc]
    else:
        stale = [eid for eid, _ in among.items.difference(known.items())]
    if stale:
        candidates = candidates.difference(stale)
    if among.no_incarnation:
        candidates = candidates.difference(
            eid for eid in among.no_incarnation & candidates if known.get(eid, "")
        )
    return candidates


def pair_engines(
    spec: KVTopologySpec,
    live: Mapping[str, Usable],
    cache: RoundCache | None = None,
    *,
    extra: bool = True,
) -> Pairing:
    """Policy: every usable prefill with every usable decode whose `pairing.matchLabels`
    agree is a pair, unless their compatibility hashes differ; each half that its holder
    does not hold as it is now (`holds`) is a handshake to make.

    Costs in proportion to the engines and the missing halves, not to the pairs: engines
    pair within a group of equal pairing-label values and compatibility hash, and what each
    engine holds of its group is found by set operations, which `cache` (last round's)
    spares for every worker whose view and group are unchanged. `extra=False`: no
    `Pairing.extra_held` (empty), which costs each holder's whole view (`admissions` needs
    only the handshakes)."""
    memo = _Memo(cache)
    keys = spec.pairing.match_labels
    groups: dict[tuple[str, ...], tuple[list[Usable], list[Usable]]] = {}
    for e in sorted(live.values(), key=_by_pod):
        group = groups.setdefault(tuple(e.pod.labels.get(k, "") for k in keys), ([], []))
        group[0 if e.pod.role == "prefill" else 1].append(e)
    incarnation = {eid: e.worker.incarnation for eid, e in live.items()}
    # Each engine as a handshake's peer: its id, endpoint, role, pod uid and incarnation.
    as_peer = {
        eid: (eid, e.pod.endpoint, e.pod.role, e.pod.uid, e.worker.incarnation)
        for eid, e in live.items()
    }

    incompatible: dict[str, list[str]] = {}
    handshakes: list[Handshake] = []
    unhealthy: dict[tuple[str, str], tuple[str, str, str]] = {}
    partner_ids: dict[str, frozenset[str]] = {}
    partner_among: dict[str, _Among] = {}
    missing: set[tuple[str, str]] = set()
    misses: Counter[str] = Counter()  # engine id -> its pairs not connected
    for gkey, (prefills, decodes) in groups.items():
        if not prefills or not decodes:
            continue
        # Incompatible: an engine with no engine of the other role and its compatibility
        # hash in its group, though it has some of another hash (a compatibility rollout
        # runs both hashes side by side: an engine with partners of its own hash is paired
        # with those, and not reported). One message per engine, not per pair.
        hashes = {e.worker.compat_hash for e in (*prefills, *decodes)}
        if len(hashes) > 1:
            by_hash: dict[str, tuple[list[Usable], list[Usable]]] = {}
            for e in (*prefills, *decodes):
                by_hash.setdefault(e.worker.compat_hash, ([], []))[
                    0 if e.pod.role == "prefill" else 1
                ].append(e)
            for mine, (hp, hd) in by_hash.items():
                for side, others_role, engines_ in ((1, "decode", hp), (0, "prefill", hd)):
                    if not engines_ or by_hash[mine][side]:
                        continue  # it has partners of its own hash (or none to report)
                    other = next((h, es[side]) for h, es in sorted(by_hash.items()) if es[side])
                    n = sum(len(es[side]) for es in by_hash.values())
                    for e in engines_:
                        incompatible[e.worker.engine_id] = [
                            f"{e.pod.name} ({mine}) has no {others_role} of its compatibility "
                            f"hash: the {n} of its pairing group have another, e.g. "
                            f"{other[1][0].pod.name} ({other[0]})"
                        ]
        for compat in sorted(hashes):
            ps = [p for p in prefills if p.worker.compat_hash == compat]
            ds = [d for d in decodes if d.worker.compat_hash == compat]
            if not ps or not ds:
                continue
            p_among = memo.among(
                (gkey, compat, "prefill"), frozenset(p.worker.engine_id for p in ps), incarnation
            )
            d_among = memo.among(
                (gkey, compat, "decode"), frozenset(d.worker.engine_id for d in ds), incarnation
            )
            pset, dset = p_among.ids, d_among.ids
            for pid in pset:
                partner_ids[pid] = dset
                partner_among[pid] = d_among
            for did in dset:
                partner_ids[did] = pset
                partner_among[did] = p_among
            # The decodes that do not hold a prefill as it is now, by prefill (only the
            # missing halves are visited).
            lacking: dict[str, list[Usable]] = {}
            for d in ds:
                for pid in memo.lacking(d.worker, p_among):
                    lacking.setdefault(pid, []).append(d)
            for a in (*ps, *ds):  # unhealthy halves: the few a holder reports
                others = dset if a.pod.role == "prefill" else pset
                for peer, why in a.worker.unhealthy_peers.items():
                    if peer in others and peer in a.worker.peers:
                        b = live[peer]
                        unhealthy[(a.worker.engine_id, peer)] = (a.pod.name, b.pod.name, why)
            for p in ps:
                pid = p.worker.engine_id
                p_lacks = memo.lacking(p.worker, d_among)
                d_lack = lacking.get(pid, [])
                if not p_lacks and not d_lack:
                    continue  # the whole row is connected
                # A half is one tuple joined from its holder's part and its peer's, in C: a
                # rollout's surge is tens of thousands of halves in one round.
                head = (p.pod.name, p.pod.endpoint)
                tail = (pid,)
                handshakes += [_new(Handshake, head + as_peer[did] + tail) for did in p_lacks]
                p_peer = as_peer[pid]
                handshakes += [
                    _new(Handshake, (d.pod.name, d.pod.endpoint, *p_peer, d.worker.engine_id))
                    for d in d_lack
                ]
                row = p_lacks.union([d.worker.engine_id for d in d_lack]) if d_lack else p_lacks
                missing.update(zip(repeat(pid), row))
                misses[pid] += len(row)
                misses.update(row)
    extra_held = (
        {eid: memo.extra_held(e.worker, partner_among.get(eid, _NOBODY)) for eid, e in live.items()}
        if extra
        else {}
    )
    memo.done()
    return Pairing(
        partner_ids=partner_ids,
        missing=frozenset(missing),
        incompatible={eid: tuple(why) for eid, why in incompatible.items()},
        handshakes=tuple(sorted(handshakes)),  # tuples: ordered field by field, in C
        unhealthy=unhealthy,
        pair_counts={eid: (len(ids) - misses[eid], len(ids)) for eid, ids in partner_ids.items()},
        n_expected=sum(
            len(ids) for eid, ids in partner_ids.items() if live[eid].pod.role == "prefill"
        ),
        roles={eid: live[eid].pod.role for eid in partner_ids},
        extra_held=extra_held,
    )


def _by_pod(e: Usable) -> str:
    return e.pod.name


@dataclass(frozen=True)
class Gone:
    """An engine that is gone (or a stale peer somebody holds), kept for the grace."""

    pod: str  # "" for a peer nobody knew
    role: Role
    endpoint: str
    since: datetime  # when it was first seen gone


def gone_engines(
    obs: Observed,
    engines: Engines,
    now: datetime,
    extra_held: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, Gone]:
    """Policy: engines known before (or held as a peer by a usable engine) that are not
    usable now, and since when. An engine whose pod is selected but whose worker cannot be
    read is not gone (nobody can tell; it is kept as it was, `Failed`), unless it was
    already draining; one whose pod an older topology now owns is handed over, not gone.

    `extra_held`: what each usable engine holds beyond its partners (`Pairing.extra_held`;
    by default all it holds): a gone engine is never a partner."""
    grace = timedelta(seconds=obs.spec.eviction.grace_seconds)
    prev_engines = {e.engine_id: e for e in obs.previous.engines if e.engine_id}
    # An unusable engine's pod, or one whose worker is not read yet: nobody can tell.
    live, cannot_tell = engines.live, set(engines.unusable).union(engines.unread)
    # Pods their node's lifecycle marked not Ready (node NotReady or unreachable): their
    # engines are gone since that flip, not since the operator first saw it.
    lost = {
        p.name: datetime.fromtimestamp(p.lost_since, UTC)
        for p in obs.pods
        if p.lost_since is not None and not p.deleting
    }
    if extra_held is None:
        extra_held = {eid: _extra_held(e.worker, _NO_PARTNERS) for eid, e in live.items()}
    held = frozenset().union(*extra_held.values())  # not usable ones, among others
    gone: dict[str, Gone] = {}
    for eid, prev in prev_engines.items():
        if eid in live or prev.state == EngineState.EVICTED:
            continue
        if prev.pod in obs.claimed and eid not in held:
            continue  # handed over to the older topology that owns its pod: not gone
        if prev.pod in cannot_tell and prev.state != EngineState.DRAINING:
            continue  # cannot tell: keep it as it was until its worker answers again
        # A time another replica wrote never lengthens a timer (its clock may be ahead).
        since = min(parse_time(prev.since), now) if prev.state == EngineState.DRAINING else now
        since = min(since, obs.memory.gone_since.get(eid, since), lost.get(prev.pod, since))
        gone[eid] = Gone(prev.pod, prev.role, prev.endpoint, since)
    # Peers held by a usable engine that is not usable and not gone yet (found by set
    # operations; the first holder, in order, tells the role).
    unknown = set(held.difference(live, gone))
    if unknown:  # an engine whose worker was read, but is not usable, is not gone either
        unknown.difference_update(
            w.engine_id for w in obs.workers.values() if isinstance(w, WorkerView)
        )
    for eid, e in live.items() if unknown else ():
        for peer in sorted(extra_held[eid] & unknown):
            unknown.discard(peer)
            known = prev_engines.get(peer)
            if (
                known is not None
                and known.pod in cannot_tell
                and known.state not in (EngineState.DRAINING, EngineState.EVICTED)
            ):
                continue  # the engine of a pod whose worker cannot be read: as above
            if known is not None and known.state == EngineState.EVICTED:
                since = min(parse_time(known.since), now) - grace  # evicted before: due now
            else:
                since = obs.memory.gone_since.get(peer, now)
            role = "decode" if e.pod.role == "prefill" else "prefill"
            gone[peer] = Gone(
                known.pod if known else "", role, known.endpoint if known else "", since
            )
    return gone


@dataclass(frozen=True)
class Evicting:
    """The evictions due now, and what is still waiting for its grace."""

    evictions: tuple[Eviction, ...]
    still_held: Mapping[str, int]  # gone engine id -> how many usable engines hold it
    due_in: tuple[float, ...]  # seconds until each waiting eviction falls due
    unpairing: Mapping[tuple[str, str], datetime]  # (holder, peer) no longer paired -> since


def evictions_due(
    live: Mapping[str, Usable],
    gone: Mapping[str, Gone],
    pairing: Pairing,
    memory: Memory,
    grace: timedelta,
    now: datetime,
) -> Evicting:
    """Policy: a gone engine is evicted from every holder once it has been gone for the
    grace; pairing is level-based both ways, so a connection between two usable engines
    that should no longer be paired (a pairing label or the spec's pairing changed, or they
    became incompatible) is evicted after the grace too."""
    evictions: list[Eviction] = []
    due_in: list[float] = []
    partners = pairing.partners()
    unpairing: dict[tuple[str, str], datetime] = {}
    for eid, e in live.items():
        # What it holds beyond its partners (a prefill holds a thousand peers, nearly all
        # partners: the pairing found these by set operations).
        held = pairing.extra_held.get(eid)
        if held is None:
            held = _extra_held(e.worker, partners.get(eid, _NO_PARTNERS))
        if not held:
            continue  # nearly every engine, every round
        for peer in sorted(held):
            if peer not in live:
                continue
            since = memory.unpairing_since.get((eid, peer), now)
            unpairing[(eid, peer)] = since
            if now - since >= grace:
                evictions.append(Eviction(e.pod.name, e.pod.endpoint, peer))
            else:
                due_in.append((since + grace - now).total_seconds())
    still_held: dict[str, int] = {}
    holders_of: dict[str, list[Usable]] = {}
    if gone:
        gone_ids = frozenset(gone)
        for eid, e in live.items():
            # A gone engine is nobody's partner: a holder holds it among what it holds
            # beyond its partners (the pairing's, nearly always nothing) or among what it
            # is evicting; a decode of a rollout is not asked about each gone decode.
            held = pairing.extra_held.get(eid)
            if held is None:
                held = e.worker.peers
            if e.worker.evicting:
                held = held.union(e.worker.evicting.intersection(e.worker.peers))
            if not held:
                continue
            for peer in held & gone_ids:
                holders_of.setdefault(peer, []).append(e)
    for eid, g in gone.items():
        holders = holders_of.get(eid, [])
        still_held[eid] = len(holders)
        if holders and now - g.since < grace:
            due_in.append((g.since + grace - now).total_seconds())
        if now - g.since >= grace:
            evictions.extend(
                Eviction(h.pod.name, h.pod.endpoint, eid)
                for h in holders
                if eid not in h.worker.evicting
            )
    return Evicting(tuple(sorted(evictions)), still_held, tuple(due_in), unpairing)


@dataclass(frozen=True)
class Tally:
    """The topology's failure totals after this round."""

    counts: Mapping[str, int]  # failure type -> total since the topology was created
    last: LastFailure | None
    seen_now: Mapping[str, Mapping[str, int]]  # engine id -> its counters as read now
    new: Mapping[str, int]  # failure type -> what this round added


def tally_failures(live: Mapping[str, Usable], previous: KVTopologyStatus, memory: Memory) -> Tally:
    """Policy: each usable worker's counters are added to the totals by their growth since
    they were last read (the baselines in memory, which outlive NotReady blips and the
    status's engine limit; else the status's). A counter that went down restarted: all of
    it is new. The newest failure of an engine whose counters grew becomes `last`."""
    prev_engines = {e.engine_id: e for e in previous.engines if e.engine_id}
    counts = dict(previous.failures.counts if memory.counts is None else memory.counts)
    last = previous.failures.last if memory.counts is None else memory.last
    newest: tuple[float, LastFailure] | None = None
    seen_now: dict[str, dict[str, int]] = {}
    new: dict[str, int] = {}
    for eid, e in live.items():
        if eid in memory.baselines:  # read before, also while it blipped NotReady
            prev_seen = memory.baselines[eid]  # only read here
        elif eid in prev_engines:
            prev_seen = prev_engines[eid].failures_seen
        elif memory.counts is None and previous.engines_omitted:
            # A fresh operator whose status could not list every engine: this one's
            # counters were counted before (its line was left out); count their growth.
            prev_seen = dict(e.worker.failures)
        else:
            prev_seen = {}
        seen_now[eid] = dict(e.worker.failures)
        grew = False
        for ftype, value in e.worker.failures.items():
            base = prev_seen.get(ftype, 0)
            delta = value - base if value >= base else value
            if delta > 0:
                counts[ftype] = min(counts.get(ftype, 0) + delta, MAX_COUNT)
                new[ftype] = new.get(ftype, 0) + delta
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
                    message=((f"peer {lf.engine_id}: " if lf.engine_id else "") + lf.message)[:512],
                ),
            )
    if newest is not None:
        last = newest[1]
    return Tally(counts, last, seen_now, new)


def engine_statuses(
    obs: Observed,
    engines: Engines,
    pairing: Pairing,
    gone: Mapping[str, Gone],
    evicting: Evicting,
    tally: Tally,
    now: datetime,
) -> tuple[list[EngineStatus], list[Event]]:
    """Policy: each engine's line in the status (usable ones by their pairs, unusable ones
    `Failed` with why, gone ones `Draining` then `Evicted`, recently evicted ones kept a
    while), all of them (`bounded_lines` cuts what the status carries), and the Events of
    their transitions."""
    grace_s = obs.spec.eviction.grace_seconds
    grace = timedelta(seconds=grace_s)
    prev_engines = {e.engine_id: e for e in obs.previous.engines if e.engine_id}
    statuses: list[EngineStatus] = []
    events: list[Event] = []
    pair_count = pairing.counts()
    for eid, e in sorted(engines.live.items(), key=lambda kv: kv[1].pod.name):
        was = prev_engines.get(eid)
        ok, total = pair_count.get(eid, (0, 0))
        if eid in pairing.incompatible:
            state, message = EngineState.INCOMPATIBLE, "; ".join(pairing.incompatible[eid])[:512]
            if was is None or was.state != EngineState.INCOMPATIBLE:
                events.append(Event("Warning", "Incompatible", message))
        elif total == 0:
            state, message = EngineState.PENDING, "no peer to pair with"
        elif ok == total:
            state, message = EngineState.CONNECTED, f"{ok}/{total} pairs connected"
        else:
            state, message = EngineState.HANDSHAKING, f"{ok}/{total} pairs connected"
        peers = len(e.worker.peers) - len(e.worker.peers & e.worker.evicting)
        seen = tally.seen_now.get(eid, {})
        if (
            was is not None
            and was.state == state
            and was.peers == peers
            and was.message == message
            and was.pod == e.pod.name
            and was.role == e.pod.role
            and was.endpoint == e.pod.endpoint
            and was.compat_hash == e.worker.compat_hash
            and was.failures_seen == seen
        ):
            # Unchanged: last round's line itself (lines are immutable). Most lines of a
            # large topology are, round after round; building each anew was a fifth of a
            # round at 2,000 engines.
            statuses.append(was)
            continue
        stamp = was.since if was is not None and was.state == state else precise(now)
        statuses.append(
            EngineStatus(
                pod=e.pod.name,
                role=e.pod.role,  # type: ignore[arg-type]
                engine_id=eid,
                endpoint=e.pod.endpoint,
                state=state,
                peers=peers,
                since=stamp,
                message=message,
                compat_hash=e.worker.compat_hash,
                failures_seen=dict(seen),
            )
        )
    prev_by_pod: dict[str, EngineStatus] = {}
    for x in obs.previous.engines:
        prev_by_pod.setdefault(x.pod, x)  # the first line of a pod, as a search would find
    for pod, message, why in sorted(engines.unusable.values(), key=lambda pr: pr[0].name):
        prev_for_pod = prev_by_pod.get(pod.name)
        told = prev_for_pod is not None and prev_for_pod.message == message[:512]
        # An unreachable worker is said in the status only (restarts make them common); one
        # that refuses the operator's key (401: its key file lacks the operator's key) is a
        # misconfiguration to act on, said once by an Event too.
        refused = why == Reason.WORKER_UNREACHABLE and "HTTP 401" in message
        if (why != Reason.WORKER_UNREACHABLE or refused) and not told:
            events.append(Event("Warning", why.value, f"{pod.name}: {message}"))
        statuses.append(
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
    for eid, g in sorted(gone.items()):
        if not g.pod:
            continue  # a stale peer no pod owns: counted (`stale_peers`), never a line
        was = prev_engines.get(eid)
        held_by = evicting.still_held[eid]
        if held_by == 0 and (now - g.since >= grace or not g.pod):
            state = EngineState.EVICTED
            if was is not None and was.state != EngineState.EVICTED:
                events.append(
                    Event(
                        "Normal", "EngineEvicted", f"engine {eid} ({g.pod}) evicted from every peer"
                    )
                )
            stamp = (
                was.since if was is not None and was.state == EngineState.EVICTED else precise(now)
            )
            message = "evicted from every peer"
        else:
            state = EngineState.DRAINING
            stamp = precise(g.since)
            message = f"gone; evicted from {held_by} peer(s) after {grace_s}s grace"
        statuses.append(
            EngineStatus(
                pod=g.pod,
                role=g.role,  # type: ignore[arg-type]
                engine_id=eid,
                endpoint=g.endpoint,
                state=state,
                peers=0,
                since=stamp,
                message=message,
            )
        )
    # Keep recently evicted engines a while, then let them go (a rollout leaves thousands:
    # last round's line itself where there is nothing to clear).
    kept_after = now - EVICTED_RETENTION
    for old in obs.previous.engines:
        if (
            old.state == EngineState.EVICTED
            and old.pod not in obs.claimed
            and old.engine_id not in gone
            and old.engine_id not in engines.live
            and parse_time(old.since) > kept_after
        ):
            statuses.append(
                old.model_copy(update={"failures_seen": {}}) if old.failures_seen else old
            )
    statuses.sort(key=lambda x: (x.state == EngineState.EVICTED, x.role, x.pod, x.engine_id))
    return statuses, events


# What the status's engine lines may take (bytes, estimated): with the rest of the status
# well under etcd's 1.5 MiB request limit, whatever the messages say.
STATUS_ENGINE_BYTES = 768 << 10


def _line_bytes(e: EngineStatus) -> int:
    """A generous estimate of an engine line's size in the status's JSON."""
    strings = len(e.pod) + len(e.engine_id) + len(e.endpoint) + len(e.message) + len(e.since)
    return 220 + strings + len(e.compat_hash) + sum(len(k) + 24 for k in e.failures_seen)


def bounded_lines(statuses: list[EngineStatus]) -> tuple[list[EngineStatus], int]:
    """The engine lines the status carries (in order, at most MAX_ENGINES_IN_STATUS and
    STATUS_ENGINE_BYTES) and how many are left out."""
    used = 0
    for i, e in enumerate(statuses[:MAX_ENGINES_IN_STATUS]):
        used += _line_bytes(e)
        if used > STATUS_ENGINE_BYTES:
            return statuses[:i], len(statuses) - i
    kept = statuses[:MAX_ENGINES_IN_STATUS]
    return kept, len(statuses) - len(kept)


def topology_events(obs: Observed, pairing: Pairing, tally: Tally) -> list[Event]:
    """Policy: the topology-wide Events, each said when it begins, not every round: new
    worker failures (`TransferFailures`), held peers their holders report unhealthy, which
    are re-handshaked (`PeerUnhealthy`), and pods an older topology owns (`Conflict`)."""
    events: list[Event] = []
    if tally.new:
        desc = ", ".join(f"{k}={v}" for k, v in sorted(tally.new.items()))
        events.append(
            Event("Warning", "TransferFailures", f"new failures reported by workers: {desc}")
        )
    fresh = sorted(k for k in pairing.unhealthy if k not in obs.memory.unhealthy)
    if fresh:
        told = "; ".join(
            f"{pairing.unhealthy[k][0]} reports {pairing.unhealthy[k][1]} (engine {k[1]}) "
            f"{pairing.unhealthy[k][2]}"
            for k in fresh[:5]
        )
        more = f" (and {len(fresh) - 5} more)" if len(fresh) > 5 else ""
        events.append(
            Event(
                "Warning",
                PEER_UNHEALTHY,
                f"re-handshaking {len(fresh)} peer(s) their holders report unhealthy: {told}{more}",
            )
        )
    claimed = tuple(sorted(obs.claimed.items()))
    was_conflict = next(
        (c for c in obs.previous.conditions if c.type == ConditionType.CONFLICT), None
    )
    if claimed and (was_conflict is None or was_conflict.status != "True"):
        events.append(Event("Warning", ConditionType.CONFLICT.value, conflict_of(claimed)[2]))
    return events


def idle_ttl_changes(spec: KVTopologySpec, live: Mapping[str, Usable]) -> tuple[SetIdleTTL, ...]:
    """Policy: `eviction.idleTTLSeconds` on every usable worker that reports another value
    (a worker that reports none predates the setting and is left alone)."""
    ttl = float(spec.eviction.idle_ttl_seconds)
    return tuple(
        sorted(
            SetIdleTTL(e.pod.name, e.pod.endpoint, ttl)
            for e in live.values()
            if e.worker.idle_ttl_s is not None and e.worker.idle_ttl_s != ttl
        )
    )


def evaluate(obs: Observed, now: datetime) -> Plan:
    """Gather -> **evaluate** -> act: everything the operator decides, as data. The chain
    of the policies above, over the pods this topology selects and owns."""
    spec = obs.spec
    pods = tuple(p for p in pods_of(spec, obs.pods) if p.name not in obs.claimed)
    grace = timedelta(seconds=spec.eviction.grace_seconds)
    engines = usable_engines(pods, obs.workers, obs.memory.cache, id_holders(obs.previous, pods))
    engines = refuse_strangers(engines, lambda: _known_ids(obs, engines))
    pairing = pair_engines(spec, engines.live, obs.memory.cache)
    gone = gone_engines(obs, engines, now, pairing.extra_held)
    evicting = evictions_due(engines.live, gone, pairing, obs.memory, grace, now)
    tally = tally_failures(engines.live, obs.previous, obs.memory)
    statuses, events = engine_statuses(obs, engines, pairing, gone, evicting, tally, now)
    lines, omitted = bounded_lines(statuses)
    events += topology_events(obs, pairing, tally)
    unknown, maybe = cannot_tell(engines, obs.previous)
    stale = sorted(eid for eid, g in gone.items() if not g.pod and evicting.still_held.get(eid, 0))
    partnered = pairing.partner_ids
    unpaired = tuple(
        sorted(
            e.pod.name
            for eid, e in engines.live.items()
            if eid not in pairing.incompatible and eid not in partnered
        )
    )
    progress = Progress(
        pairs_expected=pairing.n_expected,
        missing=pairing.missing,
        pair_counts=pairing.pair_counts,
        unpaired=unpaired,
        handshakes_left=len(pairing.handshakes),
        draining=sum(1 for e in statuses if e.state == EngineState.DRAINING),
        incompatible=len(pairing.incompatible),
        unreachable=tuple(sorted((name, why) for name, (_, _, why) in engines.unusable.items())),
        claimed=tuple(sorted(obs.claimed.items())),
        selected=(
            sum(1 for p in pods if p.role == "prefill"),
            sum(1 for p in pods if p.role == "decode"),
        ),
        live=tuple(sorted((e.pod.name, eid) for eid, e in engines.live.items())),
        live_roles={eid: e.pod.role for eid, e in engines.live.items()},
        cannot_tell=unknown,
        maybe_partners=maybe,
        min_partners=spec.readiness_gate.min_connected_partners,
        min_available=(
            spec.availability.min_available_prefill,
            spec.availability.min_available_decode,
        ),
    )
    status = KVTopologyStatus(
        observed_generation=obs.generation,
        conditions=conditions_of(progress, obs.previous.conditions, obs.generation, now),
        summary=summary_of(statuses, progress),
        engines=lines,
        engines_omitted=omitted,
        failures=Failures(counts=dict(tally.counts), last=tally.last),
        stale_peers=StalePeers(count=len(stale), engine_ids=stale[:STALE_PEER_EXAMPLES]),
    )
    memory = _remember(obs.memory, gone, tally, now)
    return Plan(
        handshakes=pairing.handshakes,
        evictions=evicting.evictions,
        status=status,
        events=tuple(events),
        pairs_expected=pairing.n_expected,
        pairs_connected=pairing.n_connected,
        progress=progress,
        memory=dataclasses.replace(
            memory,
            unpairing_since=dict(evicting.unpairing),
            unhealthy=frozenset(pairing.unhealthy),
        ),
        wake_in_s=min(evicting.due_in) if evicting.due_in else None,
        idle_ttls=idle_ttl_changes(spec, engines.live),
        unhealthy_peers=frozenset(pairing.unhealthy),
    )


def admissions(
    spec: KVTopologySpec,
    pods: Iterable[PodView],
    workers: Mapping[str, WorkerView | WorkerUnreachable],
    new: Collection[str],
    live: Mapping[str, str],
) -> tuple[Handshake, ...]:
    """Policy (late arrivals, and the fast pass between rounds): the handshakes that pair
    the engines of the `new` pods (come up since the round gathered, their workers just
    read) with their partners, by the rules of `evaluate` (`usable_engines`,
    `pair_engines`) applied to them and to the engines they pair with only: a decode's
    arrival costs its prefills, not the fleet. `pods`: the new pods and the pods of the
    engines they may pair with, the claim applied (`owned_pods`); `live`: engine id -> pod
    of the last round's usable engines.

    Anything else is the next round's: an engine that is not usable (unreachable, of
    another pod, duplicate: one whose engine id another pod's engine had at the last round
    keeps out, by the rule the round applies, `usable_engines`'s holders), a partner the
    last round did not find usable, every eviction, status line and Event."""
    selected = pods_of(spec, pods)
    fresh = usable_engines([p for p in selected if p.name in new], workers, holders=live).live
    if not fresh:
        return ()
    wanted = {"decode" if u.pod.role == "prefill" else "prefill" for u in fresh.values()}
    partners = usable_engines(
        [p for p in selected if p.name not in new and p.role in wanted], workers
    ).live
    engines = {eid: u for eid, u in partners.items() if live.get(eid) == u.pod.name}
    engines.update(fresh)
    return tuple(
        h
        for h in pair_engines(spec, engines, extra=False).handshakes
        if h.engine_id in fresh or h.peer_engine_id in fresh
    )


def _remember(memory: Memory, gone: Mapping[str, Gone], tally: Tally, now: datetime) -> Memory:
    """The memory after this round: gone engines' timers, baselines (kept EVICTED_RETENTION
    after an engine was last read, so a NotReady blip does not count its counters twice)."""
    baselines = dict(memory.baselines)
    seen_at = dict(memory.seen_at)
    baselines.update(tally.seen_now)  # each a dict of its own, never changed after
    seen_at.update(dict.fromkeys(tally.seen_now, now))
    forget_before = now - EVICTED_RETENTION
    for eid in [e for e, t in seen_at.items() if t < forget_before]:
        baselines.pop(eid, None)
        seen_at.pop(eid, None)
    return Memory(
        gone_since={eid: g.since for eid, g in gone.items()},
        baselines=baselines,
        seen_at=seen_at,
        counts=dict(tally.counts),
        last=tally.last,
        cache=memory.cache,
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
    n_exp, n_conn = progress.pairs_expected, progress.pairs_connected
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
    elif progress.min_available != (None, None):
        ready = _ready_by_minimum(progress, pairs)
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
        order = [
            Reason.DUPLICATE_ENGINE_ID,
            Reason.ENDPOINT_REFUSED,
            Reason.IDENTITY_MISMATCH,
            Reason.WORKER_ANSWER_REFUSED,
            Reason.WORKER_UNREACHABLE,
        ]
        worst = min((why for _, why in progress.unreachable), key=order.index)
        names = ", ".join(name for name, _ in progress.unreachable)
        label = {
            Reason.ENDPOINT_REFUSED: "engines with a refused endpoint or unreachable workers",
            Reason.IDENTITY_MISMATCH: "engines whose worker is not their pod's, or unreachable",
            Reason.DUPLICATE_ENGINE_ID: "engines whose id another pod's worker reports too",
            Reason.WORKER_ANSWER_REFUSED: "engines whose worker's answer is refused, or "
            "unreachable",
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
    elif ready[0] == "True" and (short := availability(progress)[1]):
        degraded = (
            "True",
            Reason.ENGINES_UNAVAILABLE,
            f"{len(short)} engine(s) not available (fewer partners connected than "
            f"{progress.min_partners}): {', '.join(short[:10])}"
            + (f" and {len(short) - 10} more" if len(short) > 10 else ""),
        )
    else:
        degraded = ("False", Reason.HEALTHY, "")
    return [
        _condition(prev, ConditionType.READY, *ready, generation, now),
        _condition(prev, ConditionType.PROGRESSING, *progressing, generation, now),
        _condition(prev, ConditionType.DEGRADED, *degraded, generation, now),
        _condition(prev, ConditionType.CONFLICT, *conflict_of(progress.claimed), generation, now),
    ]


def _ready_by_minimum(progress: Progress, pairs: str) -> tuple[str, Reason, str]:
    """Ready under `spec.availability`: enough available engines of each role (a minimum
    left unset is every selected engine of that role)."""
    done = availability(progress)[0]
    need = [
        n if n is not None else selected
        for n, selected in zip(progress.min_available, progress.selected, strict=True)
    ]
    said = (
        f"available: prefill {done['prefill']}/{progress.selected[0]} (at least {need[0]}), "
        f"decode {done['decode']}/{progress.selected[1]} (at least {need[1]}); {pairs}"
    )
    if done["prefill"] >= need[0] and done["decode"] >= need[1]:
        return ("True", Reason.ENGINES_AVAILABLE, said)
    return ("False", Reason.TOO_FEW_AVAILABLE, said)


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
    returns the progress after acting (what the readiness gate is decided from). `made`
    holds the plan's own handshake objects that were made."""
    # The plan's own handshakes, by identity (`made` holds those of them that were made):
    # hashing 16,000 handshakes field by field cost more than the rest of a round.
    made_ids = set(map(id, made))
    not_made: set[tuple[str, str]] = set()
    planned: set[tuple[str, str]] = set()
    left = 0
    for h in plan.handshakes:  # a surge's tens of thousands: `pair` inlined
        pair = (
            (h.engine_id, h.peer_engine_id)
            if h.peer_role == "decode"
            else (h.peer_engine_id, h.engine_id)
        )
        planned.add(pair)
        if id(h) not in made_ids:
            not_made.add(pair)
            left += 1
    now_connected = (planned - not_made) & plan.progress.missing
    per_engine = dict(plan.progress.pair_counts or {})
    for pair in now_connected:
        for eid in pair:
            ok, total = per_engine[eid]
            per_engine[eid] = (ok + 1, total)
    late = [
        f"{h.pod} adding {h.peer_role} {h.peer_engine_id}: {f.message}"[:300]
        for h, f in sorted(failing.items())
        if now - f.since >= deadline
    ]
    progress = dataclasses.replace(
        plan.progress,
        missing=plan.progress.missing - now_connected,
        handshakes_left=left,
        failing=tuple(late),
        pair_counts=per_engine,
    )
    engines = []
    prev_by_id: dict[str, EngineStatus] = {}
    for x in previous.engines:
        prev_by_id.setdefault(x.engine_id, x)
    for entry in plan.status.engines:
        ok, total = per_engine.get(entry.engine_id, (0, 0))
        settled = entry
        if entry.state in (EngineState.HANDSHAKING, EngineState.CONNECTED) and total:
            state = EngineState.CONNECTED if ok == total else EngineState.HANDSHAKING
            if state != entry.state:
                was = prev_by_id.get(entry.engine_id)
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


def is_available(ok: int, total: int, min_partners: int) -> bool:
    """An engine with `ok` of its `total` partners connected is available (as its readiness
    gate says: at least minConnectedPartners, all it has when fewer; 0: reached)."""
    if min_partners == 0:
        return True
    return total > 0 and ok >= min(min_partners, total)


def availability(progress: Progress) -> tuple[dict[str, int], list[str]]:
    """Available engines per role, and the pods of the usable engines that are not."""
    done = {"prefill": 0, "decode": 0}
    short: list[str] = []
    if progress.live_roles is None or progress.pair_counts is None:
        return done, short
    pod_of = {eid: name for name, eid in progress.live}
    for eid, role in progress.live_roles.items():
        ok, total = progress.pair_counts.get(eid, (0, 0))
        if is_available(ok, total, progress.min_partners):
            if role in done:
                done[role] += 1
        else:
            short.append(pod_of.get(eid, eid))
    return done, sorted(short)


def summary_of(engines: Iterable[EngineStatus], progress: Progress) -> Summary:
    """The printer columns: available engines (`is_available`) / pods selected, per role,
    and connected / expected pairs. Counted over every usable engine (`progress`), not
    over the status's engine lines, which stop at a bound."""
    done = {"prefill": 0, "decode": 0}
    if progress.live_roles is not None and progress.pair_counts is not None:
        done = availability(progress)[0]
    else:
        for e in engines:
            if e.state == EngineState.CONNECTED and e.role in done:
                done[e.role] += 1
    n_prefill, n_decode = progress.selected
    return Summary(
        prefill=f"{done['prefill']}/{n_prefill}",
        decode=f"{done['decode']}/{n_decode}",
        pairs=f"{progress.pairs_connected}/{progress.pairs_expected}",
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
        counts[ftype] = min(counts.get(ftype, 0) + 1, MAX_COUNT)
    return status.model_copy(update={"failures": Failures(counts=counts, last=items[-1][1])})
