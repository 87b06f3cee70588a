"""Thin kopf handlers: watches in, pokes out. No decisions are made here.

Owns the kopf registrations: the KVTopology index (each topology's name, creation time and
spec, grouped by namespace: what the claim of a pod by at most one topology needs, see
`logic.owned_pods`), the KVTopology event handler that starts, pokes and stops the
per-topology loops of `reconcile.Reconciler`, and start-up/clean-up. Engine pods do not go
through kopf: start-up starts the engine-pod watch (`podwatch.PodWatch`: a list and a watch
per watched namespace, into one `PodStore`) and waits for its first lists, as kopf fills its
index from its initial listing before any handler runs; a change to a namespace's engine
pods pokes that namespace's loops, which read the pods through `_pod_source`. The
operator's configuration arrives in kopf's `memo` (see `main`). Handlers never return values
(kopf would store them in `status.<handler>`) and add no finalizers.

With leader election (`memo.election`, see `leader`) kopf and the pod watch run on every
replica, so each one's pods and its set of known KVTopology keys (with generations) stay
current, but loops run only while this replica holds the Lease: gaining it starts a loop for
every known topology at once, losing it cancels every loop at once. Without it this replica
always acts.

The operator's own liveness: every `memo.relist_s` seconds the pod watch lists its scope
afresh, which drops the pods whose deletion a watch missed (one that restarts after "410
Gone" replays only the pods still present); such drops are counted. kopf's own API calls get
timeouts, as the operator's do (`kube.REQUEST_TIMEOUT_S`). A probe (`loops_probe`, served on
kopf's `--liveness` endpoint) reports each loop's time since its last successful round and
fails while a loop has not ended a round for `memo.stuck_after_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import kopf
from pydantic import ValidationError

from kvtopo_operator.api import (
    GROUP,
    PLURAL,
    VERSION,
    KVTopologySpec,
    read_tolerant,
)
from kvtopo_operator.fence import Fence
from kvtopo_operator.kube import (
    REQUEST_TIMEOUT_S,
    SERVER_CLOCK,
    ClusterApi,
    KubeClient,
    LeaseClient,
)
from kvtopo_operator.leader import LeaderElector
from kvtopo_operator.model import (
    PodView,
    TopologyView,
)
from kvtopo_operator.nodewatch import NodeApi, NodeStore, NodeWatch
from kvtopo_operator.podwatch import EnginePod, NotListedYet, PodApi, PodStore, PodWatch
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.stopping import StopCause
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.endpoints import pod_endpoint

log = logging.getLogger(__name__)

_state: dict[str, Any] = {}
LIST_WAIT_S = 30.0  # how long start-up waits for the first lists of the engine pods


def _pod_source(namespace: str, control_port: int) -> Iterable[PodView]:
    """The namespace's engine pods as the loops see them (from the pod watch's store). A
    pod's view is built once per version of it, control port and state of its node. With
    the Node watch (`--watch-nodes`), a pod on a node whose Ready is not True is not up,
    and lost since the node's transition (`nodewatch`), whatever the pod itself says."""
    store: PodStore | None = _state.get("pods")
    if store is None:
        raise NotListedYet("the engine-pod watch has not started")
    allow_host = bool(_state.get("allow_endpoint_host"))
    # namespace -> uid -> (pod, port, view); rebuilt each call from the pods there now,
    # so a deleted pod's view goes with it.
    views: dict[str, dict[str, tuple[EnginePod, int, PodView, float | None]]] = _state.setdefault(
        "views", {}
    )
    nodes: NodeStore | None = _state.get("nodes")
    cache = views.get(namespace, {})
    fresh: dict[str, tuple[EnginePod, int, PodView, float | None]] = {}
    out = []
    for pod in store.pods(namespace):
        node_lost = nodes.lost_since(pod.node) if nodes is not None and pod.node else None
        hit = cache.get(pod.uid)
        if hit is not None and hit[0] is pod and hit[1] == control_port and hit[3] == node_lost:
            fresh[pod.uid] = hit
            out.append(hit[2])
            continue
        endpoint, refused = pod_endpoint(
            pod.pod_ips, pod.endpoint, control_port, allow_host=allow_host
        )
        view = PodView(
            name=pod.name,
            role=pod.role,
            labels=pod.labels,
            ready=pod.ready,
            deleting=pod.deleting,
            endpoint=str(endpoint) if endpoint is not None else "",
            ready_since=pod.ready_since,
            uid=pod.uid,
            endpoint_error=refused,
            gated=pod.gated,
            gate=pod.gate,
            gate_reason=pod.gate_reason,
            lost_since=pod.lost_since,
        )
        if node_lost is not None and not pod.deleting:
            lost = node_lost if pod.lost_since is None else min(pod.lost_since, node_lost)
            view = dataclasses.replace(view, ready=False, ready_since=None, lost_since=lost)
        fresh[pod.uid] = (pod, control_port, view, node_lost)
        out.append(view)
    views[namespace] = fresh
    return out


def _departed_source(namespace: str) -> list[tuple[str, str]]:
    """(name, uid) of the namespace's pods that left the engine-pod watch with their gate
    True (`PodStore.departed`)."""
    store: PodStore | None = _state.get("pods")
    return [] if store is None else [(p.name, p.uid) for p in store.departed(namespace)]


def _departed_settled(namespace: str, uid: str) -> None:
    store: PodStore | None = _state.get("pods")
    if store is not None:
        store.settle(namespace, uid)


def _node_changed(node: str) -> None:
    """A node's readiness changed: the loops of the namespaces with pods on it are poked."""
    store: PodStore | None = _state.get("pods")
    reconciler: Reconciler | None = _state.get("reconciler")
    if store is None or reconciler is None:
        return
    for namespace in store.namespaces():
        if any(p.node == node for p in store.pods(namespace)):
            reconciler.poke_namespace(namespace)


def start_node_watch(api: NodeApi) -> NodeWatch:
    """Starts the Node watch (`--watch-nodes`) into the store `_pod_source` reads."""
    store = _state["nodes"] = NodeStore()
    watch = NodeWatch(api, store, on_change=_node_changed)
    watch.start()
    _state["node_watch"] = watch
    return watch


def _pods_touched(namespace: str, pods: list[EnginePod]) -> None:
    """Pods of the namespace changed (each as it was and as it is): the loops whose
    selectors match them are poked; a relabelled pod pokes them all (it may have left
    every selector: its gate is the oldest topology's to turn False)."""
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is None:
        return
    labels: dict[str, Mapping[str, str]] = {}
    for pod in pods:
        was = labels.setdefault(pod.uid, pod.labels)
        if was != pod.labels:
            reconciler.poke_namespace(namespace)
            return
    reconciler.poke_pods(namespace, [(p.role, p.labels) for p in pods])


def _pods_version(namespace: str) -> object | None:
    """What the namespace's pods' views are made from changes with this (its pods, the
    nodes' readiness); None before the pod watch started."""
    store: PodStore | None = _state.get("pods")
    if store is None or not store.listed(namespace):
        return None
    nodes: NodeStore | None = _state.get("nodes")
    return (store.version(namespace), nodes.version if nodes is not None else 0)


def _pods_changed(namespace: str) -> None:
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is not None:
        reconciler.poke_namespace(namespace)


def _pods_dropped(pods: list[EnginePod]) -> None:
    """A list dropped pods whose deletion the watch never reported (a relist after "410
    Gone", or the periodic relist): counted and logged; the loops were poked already."""
    metrics = _state.get("metrics")
    if metrics is not None:
        metrics.stale_pods_dropped.inc(len(pods))
    names = sorted(f"{p.namespace}/{p.name}" for p in pods)
    log.warning(
        "dropping %d engine pods whose deletion the watch missed: %s",
        len(names),
        ", ".join(names[:20]),
    )


def _watch_failed(scope: str | None, exc: Exception) -> None:
    metrics = _state.get("metrics")
    if metrics is not None:
        metrics.relist_failures.inc()


def _pod_malformed() -> None:
    metrics = _state.get("metrics")
    if metrics is not None:
        metrics.pod_watch_malformed.inc()


def start_pod_watch(
    api: PodApi,
    namespaces: Sequence[str] | None,
    relist_s: float,
    store: PodStore | None = None,
) -> PodWatch:
    """Starts the engine-pod watch of `namespaces` (None: the whole cluster) into the store
    the loops read (`_pod_source`): a new one, or `store` (what an earlier watch left)."""
    store = store if store is not None else PodStore()
    _state["pods"] = store
    _state.setdefault("views", {})
    watch = PodWatch(
        api,
        [None] if namespaces is None else list(namespaces),
        store,
        on_change=_pods_changed,
        on_pods=_pods_touched,
        dropped=_pods_dropped,
        failed=_watch_failed,
        malformed=_pod_malformed,
        relist_s=relist_s,
    )
    watch.start()
    _state["pod_watch"] = watch
    return watch


@kopf.index(GROUP, VERSION, PLURAL)
def kv_topologies(**kwargs: Any) -> dict[str, TopologyView]:
    """Index: namespace -> the KVTopologies in it, as the claim sees them (name, creation
    time, spec; a spec this operator cannot read claims nothing)."""
    try:
        spec: KVTopologySpec | None = read_tolerant(
            KVTopologySpec, dict(kwargs["spec"]), ".spec", drop_invalid=False
        )[0]
    except ValidationError:
        spec = None
    created = str(kwargs["meta"].get("creationTimestamp") or "")
    return {kwargs["namespace"]: TopologyView(kwargs["name"], created, spec)}


def _topology_source(namespace: str) -> Iterable[TopologyView]:
    index = _state.get("kv_topologies")
    if index is None:  # never so once a loop runs: kopf fills its indexes before handlers
        raise RuntimeError("the KVTopology index is not filled yet")
    if namespace not in index:
        return []
    # kopf's index keeps a topology whose deletion its watch missed: one the relist found
    # gone (`_topologies_listed`) claims nothing.
    gone: set[tuple[str, str]] = _state.get("gone", set())
    return [t for t in index[namespace] if (namespace, t.name) not in gone]


def _topologies_listed(listed: Mapping[tuple[str, str], str], scopes: Sequence[str | None]) -> None:
    """A fresh list of the KVTopologies of `scopes` (namespaces; None: all): (namespace,
    name) -> uid. A topology known here that the list lacks was deleted while the watch was
    away (a relist after "410 Gone" sends no DELETED): it is forgotten as on a deletion (its
    loop stops, its gauges go, the pods only it selected are ungated). One the list has
    under another uid was deleted and created again: its loop starts afresh."""
    known: dict[tuple[str, str], int] = _state.setdefault("known", {})
    uids: dict[tuple[str, str], str] = _state.setdefault("uids", {})
    bodies: dict[tuple[str, str], Any] = _state.setdefault("bodies", {})
    reconciler: Reconciler | None = _state.get("reconciler")
    leading = bool(_state.get("leading"))
    metrics = _state.get("metrics")
    for key in list(known):
        if None not in scopes and key[0] not in scopes:
            continue
        uid = listed.get(key)
        if uid is not None and (not uids.get(key) or uid == uids[key]):
            continue
        if metrics is not None:
            metrics.stale_topologies_dropped.inc()
        bodies.pop(key, None)
        if uid is None:
            log.warning("%s/%s: gone from the API server (the watch missed it); forgotten", *key)
            known.pop(key, None)
            uids.pop(key, None)
            _state.setdefault("gone", set()).add(key)
            if reconciler is not None and leading:
                reconciler.forget(key)
        else:
            log.warning(
                "%s/%s: another object now (uid %s -> %s); starting afresh", *key, uids[key], uid
            )
            uids[key] = uid
            if reconciler is not None and leading:
                reconciler.replaced(key)


def _topology_gone(key: tuple[str, str]) -> None:
    """A loop found topology `key` gone from the API server (it claimed pods): forgotten as
    a relist that lacks it would (`_topologies_listed`)."""
    listed = {k: v for k, v in _state.get("uids", {}).items() if k[0] == key[0] and k != key}
    _topologies_listed(listed, [key[0]])


async def relist_topologies(api: ClusterApi, scopes: Sequence[str | None], period_s: float) -> None:
    """Lists the KVTopologies of `scopes` afresh every `period_s` (`_topologies_listed`);
    a list that fails is counted and tried again next period."""
    while True:
        await asyncio.sleep(period_s)
        listed: dict[tuple[str, str], str] = {}
        try:
            for scope in scopes:
                listed.update(await asyncio.to_thread(api.list_topology_uids, scope))
        except Exception as exc:
            log.warning("listing the KVTopologies failed (next try in %gs): %s", period_s, exc)
            metrics = _state.get("metrics")
            if metrics is not None:
                metrics.relist_failures.inc()
            continue
        _topologies_listed(listed, scopes)


class _NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base for change-detecting handlers (on.create/update), which this
    operator has none of: kopf would otherwise deep-copy every event's whole body (a
    KVTopology's status lists up to 2,048 engines) to compute a diff nobody reads. Nothing
    is built, fetched or stored (kopf stores a diff base only after such handlers ran)."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    # Longer than the client timeout, so a stream always ends by that one: kopf's own
    # inactivity timer (70 s by default) can fire just as a late event arrives after the
    # API server stalled, and kopf 1.45 then fails its watcher (and the operator) with
    # "Cannot change state of expiring Timeout" (seen in a drill under load).
    settings.watching.inactivity_timeout = 120
    # kopf's own API calls (and its watches' connects) give up as the operator's do.
    settings.networking.connect_timeout = REQUEST_TIMEOUT_S
    settings.networking.request_timeout = 3 * REQUEST_TIMEOUT_S
    # The namespaces are fixed on the command line and the CRD exists before we start: no
    # cluster-wide discovery of namespaces and CRDs, which least-privilege RBAC refuses.
    settings.scanning.disabled = True
    settings.persistence.diffbase_storage = _NoDiffBase()
    _state["allow_endpoint_host"] = bool(memo.get("allow_endpoint_host"))
    # Every write passes this fence (`fence`): under leader election it is shut until this
    # replica holds the Lease, and follows the lease's freshness from then on.
    fence = _state["fence"] = Fence()
    fence.follow_clock(SERVER_CLOCK.doubt)
    if memo.get("election") is not None:
        fence.follow(lambda: float("-inf"))
    _state["reconciler"] = Reconciler(
        kube=KubeClient(memo.get("kubeconfig")),
        workers=WorkerClient(memo.get("key_file")),
        pods=_pod_source,
        topologies=_topology_source,
        bodies=lambda key: _state.get("bodies", {}).get(key),
        departed=_departed_source,
        settled=_departed_settled,
        topology_gone=_topology_gone,
        pods_version=_pods_version,
        metrics=memo["metrics"],
        fence=fence,
        # Times written (engines' `since`, conditions) are the API server's: what every
        # replica reads them against, whatever this node's clock says.
        clock=SERVER_CLOCK.now,
        settings=Settings(
            resync_s=memo.get("resync_s", 2.0),
            state_reads_per_s=memo.get("state_reads_per_s", Settings.state_reads_per_s),
            guarded_ports=frozenset(memo.get("guarded_ports") or ()),
        ),
    )
    _state["metrics"] = memo["metrics"]
    _state.setdefault("known", {})
    resync_s = float(memo.get("resync_s", 2.0))
    _state["stuck_after_s"] = float(memo.get("stuck_after_s") or max(120.0, 10 * resync_s))
    watch = start_pod_watch(
        ClusterApi(memo.get("kubeconfig")),
        memo.get("watch_namespaces"),
        float(memo.get("relist_s") or 0),
    )
    if memo.get("watch_nodes"):
        start_node_watch(ClusterApi(memo.get("kubeconfig")))
    relist_s = float(memo.get("relist_s") or 0)
    if relist_s > 0:
        namespaces = memo.get("watch_namespaces")
        scopes: list[str | None] = [None] if namespaces is None else list(namespaces)
        _state["topology_relist"] = asyncio.create_task(
            relist_topologies(ClusterApi(memo.get("kubeconfig")), scopes, relist_s),
            name="kvtopo-topology-relist",
        )
    # Like kopf's indexes: no loop starts before it knows the pods (a loop asking earlier
    # gets NotListedYet, and its round fails and is retried).
    if not await watch.wait_listed(LIST_WAIT_S):
        log.warning("engine pods not listed after %gs; the loops wait for them", LIST_WAIT_S)
    election = memo.get("election")
    if election is None:  # standalone: this replica always acts
        _set_leading(True)
        return
    _set_leading(False)
    namespace, name = memo["lease_namespace"], memo["lease_name"]
    elector = LeaderElector(
        LeaseClient(
            ClusterApi(memo.get("kubeconfig")),
            namespace,
            name,
            timeout_s=max(1.0, election.retry_period_s),
        ),
        on_started_leading=_start_leading,
        on_stopped_leading=_stop_leading,
        identity=memo.get("lease_identity"),
        config=election,
        name=f"{namespace}/{name}",
    )
    _state["elector"] = elector
    fence.follow(elector.lease_left)
    elector.start()


def _set_leading(leading: bool) -> None:
    _state["leading"] = leading
    _state["metrics"].leader.set(1 if leading else 0)


def _start_leading() -> None:
    """This replica holds the Lease now: a loop for every topology known so far."""
    _set_leading(True)
    reconciler: Reconciler | None = _state.get("reconciler")
    known: dict[tuple[str, str], int] = _state["known"]
    log.info("leading: starting the loops of %d known topologies", len(known))
    if reconciler is not None:
        for key, generation in list(known.items()):
            reconciler.ensure(key, generation)


def _stop_leading() -> None:
    """The Lease is lost (or being released): every loop stops at once."""
    _set_leading(False)
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is not None:
        log.info(
            "not leading: cancelling %d loops (nothing they control changes)", reconciler.running
        )
        reconciler.cancel_all(StopCause.LEASE_LOST)


@kopf.on.probe(id="loops")
async def loops_probe(**_: Any) -> dict[str, Any]:
    """On kopf's liveness endpoint (`--liveness`): whether this replica leads and each
    running loop's seconds since its last successful round (null: none yet). Fails (kopf
    answers HTTP 500) while a loop has not ended a round for `stuck_after_s`: it is wedged,
    and the kubelet's liveness probe restarts the operator. A loop whose rounds fail is not
    stuck (each failed round ends), nor is a standby (it runs no loops)."""
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is None:
        return {"leading": False, "since_success_s": {}}
    bound = float(_state.get("stuck_after_s", 120.0))
    stuck = reconciler.stuck(bound)
    if stuck:
        names = ", ".join(f"{ns}/{name}" for ns, name in stuck[:20])
        raise kopf.PermanentError(
            f"{len(stuck)} topology loops have not ended a round for over {bound:g}s: {names}"
        )
    return {
        "leading": bool(_state.get("leading")),
        "since_success_s": {
            f"{ns}/{name}": None if age is None else round(age, 1)
            for (ns, name), age in sorted(reconciler.since_success().items())
        },
    }


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    """The process stops (SIGTERM): the fence closes before anything else, so nothing this
    replica controls changes from here on (`stopping`); then the watches, the election
    (releasing a Lease held, so a standby takes over at once) and the loops stop."""
    fence: Fence | None = _state.get("fence")
    if fence is not None:
        fence.stop()
    watch: PodWatch | None = _state.pop("pod_watch", None)
    if watch is not None:
        watch.stop()
    nodes: NodeWatch | None = _state.pop("node_watch", None)
    if nodes is not None:
        nodes.stop()
    relist: asyncio.Task[None] | None = _state.pop("topology_relist", None)
    if relist is not None:
        relist.cancel()
    elector: LeaderElector | None = _state.pop("elector", None)
    if elector is not None:  # stops the loops first, then releases the Lease
        await elector.stop()
    reconciler = _state.pop("reconciler", None)
    if reconciler is not None:
        await reconciler.stop()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def topology_changed(**kwargs: Any) -> None:
    _state["kv_topologies"] = kwargs["kv_topologies"]
    key = (kwargs["namespace"], kwargs["name"])
    # The latest body: each round reads its spec from here, not from the API server.
    bodies: dict[tuple[str, str], Any] = _state.setdefault("bodies", {})
    if kwargs["type"] == "DELETED":
        bodies.pop(key, None)
    elif kwargs.get("body") is not None:
        bodies[key] = kwargs["body"]
    known: dict[tuple[str, str], int] = _state.setdefault("known", {})
    uids: dict[tuple[str, str], str] = _state.setdefault("uids", {})
    generation = int(kwargs["meta"].get("generation", 0))
    # A topology that comes, goes or changes its spec may change which pods the others of
    # its namespace own (a status write changes nothing of it).
    claim_changed = kwargs["type"] == "DELETED" or known.get(key) != generation
    if kwargs["type"] == "DELETED":
        known.pop(key, None)
        uids.pop(key, None)
    else:  # remembered as a standby too: a new leader starts its loop at once
        known[key] = generation
        uids[key] = str(kwargs["meta"].get("uid") or "")
    _state.get("gone", set()).discard(key)  # the watch speaks of it again
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is None or not _state.get("leading"):
        return
    if kwargs["type"] == "DELETED":
        # Deleting a KVTopology stops its management; its engines keep their connections
        # (docs/install.md, "Deleting a KVTopology").
        reconciler.forget(key)
        log.info("%s/%s: deleted; its engines are left as they are", *key)
    else:
        reconciler.ensure(key, generation)
    if claim_changed:
        reconciler.poke_namespace(kwargs["namespace"])
