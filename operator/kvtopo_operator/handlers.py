"""Thin kopf handlers: watches in, pokes out. No decisions are made here.

Owns the kopf registrations: the engine-pod index (pods filtered server-side on the
`kvtopo.dev/role` label, grouped by namespace), the KVTopology index (each topology's name,
creation time and spec, grouped by namespace: what the claim of a pod by at most one
topology needs, see `logic.owned_pods`), the pod and KVTopology event handlers that poke the
per-topology loops of `reconcile.Reconciler`, and start-up/clean-up. kopf fills every index
from its initial listing before any handler runs, so no loop starts before it knows the
other topologies of its namespace. The operator's configuration arrives in kopf's `memo`
(see `main`). Handlers never return values (kopf would store them in `status.<handler>`)
and add no finalizers.

With leader election (`memo.election`, see `leader`) kopf runs on every replica, so each one's
pod index and its set of known KVTopology keys (with generations) stay current, but loops run
only while this replica holds the Lease: gaining it starts a loop for every known topology at
once, losing it cancels every loop at once. Without it this replica always acts.

The operator's own liveness: every `memo.relist_s` seconds the engine pods are listed afresh
(`relist`), and an indexed pod whose UID that list no longer has is hidden from the loops
(`LiveUids`): a watch that restarts after "410 Gone" replays only the pods still present,
so kopf never hears of the deletions in the gap. kopf's own API calls get timeouts, as the
operator's do (`kube.REQUEST_TIMEOUT_S`). A probe (`loops_probe`, served on kopf's
`--liveness` endpoint) reports each loop's time since its last successful round and fails
while a loop has not ended a round for `memo.stuck_after_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kvtopo_operator.api import (
    ENDPOINT_ANNOTATION,
    GROUP,
    KV_CONNECTED_GATE,
    PLURAL,
    ROLE_LABEL,
    VERSION,
    KVTopologySpec,
    read_tolerant,
)
from kvtopo_operator.kube import REQUEST_TIMEOUT_S, ClusterApi, KubeClient, LeaseClient
from kvtopo_operator.leader import LeaderElector
from kvtopo_operator.model import (
    PodView,
    TopologyView,
)
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.endpoints import pod_endpoint

log = logging.getLogger(__name__)

_state: dict[str, Any] = {}


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == kind:
            return cond
    return None


def _engine_up(status: dict[str, Any]) -> tuple[bool, float | None]:
    """Whether the pod's engine is up, and since when: ContainersReady (the pod's Ready may
    wait for the kv-connected readiness gate, which waits for the operator); a pod whose
    status has no ContainersReady (written by a tool, not a kubelet) is judged by Ready."""
    cond = _condition(status, "ContainersReady") or _condition(status, "Ready")
    if cond is None:
        return False, None
    ok = cond.get("status") == "True"
    since = cond.get("lastTransitionTime")
    ts = None
    if ok and since:
        ts = datetime.fromisoformat(str(since).replace("Z", "+00:00")).timestamp()
    return ok, ts


@kopf.index("pods", labels={ROLE_LABEL: kopf.PRESENT})
def engine_pods(**kwargs: Any) -> dict[str, dict[str, Any]]:
    """Index: namespace -> the engine pods in it (what the reconciler needs of each)."""
    labels, annotations = kwargs["labels"], kwargs["annotations"]
    status, meta, spec = kwargs["status"], kwargs["meta"], kwargs["spec"]
    ready, since = _engine_up(status)
    gates = spec.get("readinessGates") or []
    gate = _condition(status, KV_CONNECTED_GATE) or {}
    return {
        kwargs["namespace"]: {
            "name": kwargs["name"],
            "role": labels.get(ROLE_LABEL, ""),
            "labels": dict(labels),
            "ready": ready,
            "ready_since": since,
            "deleting": meta.get("deletionTimestamp") is not None,
            "uid": meta.get("uid") or "",
            "pod_ips": _pod_ips(status),
            "endpoint": str(annotations.get(ENDPOINT_ANNOTATION, ""))[:256],
            "indexed_at": time.monotonic(),  # see LiveUids
            "gated": any(
                isinstance(g, dict) and g.get("conditionType") == KV_CONNECTED_GATE for g in gates
            ),
            "gate": str(gate.get("status") or ""),
        }
    }


def _pod_ips(status: dict[str, Any]) -> list[str]:
    """The pod's IPs, primary first (`status.podIPs`, else `status.podIP`)."""
    ips = [str(x.get("ip", "")) for x in status.get("podIPs") or [] if isinstance(x, dict)]
    ips = [ip for ip in ips if ip]
    if not ips and status.get("podIP"):
        ips = [str(status["podIP"])]
    return ips


def _pod_source(namespace: str, control_port: int) -> Iterable[PodView]:
    index = _state.get("engine_pods")
    if index is None or namespace not in index:
        return []
    allow_host = bool(_state.get("allow_endpoint_host"))
    live: LiveUids | None = _state.get("live")
    out = []
    for rec in index[namespace]:
        if live is not None and live.gone(namespace, rec):
            continue  # deleted while the watch was away (see `relist`)
        endpoint, refused = pod_endpoint(
            rec["pod_ips"], rec["endpoint"], control_port, allow_host=allow_host
        )
        out.append(
            PodView(
                name=rec["name"],
                role=rec["role"],
                labels=rec["labels"],
                ready=rec["ready"],
                deleting=rec["deleting"],
                endpoint=str(endpoint) if endpoint is not None else "",
                ready_since=rec["ready_since"],
                uid=rec["uid"],
                endpoint_error=refused,
                gated=rec.get("gated", False),
                gate=rec.get("gate", ""),
            )
        )
    return out


class LiveUids:
    """What the latest relist of each scope (a namespace; None: the whole cluster) found:
    when it started (monotonic) and the UIDs of the engine pods it listed.

    An engine-pod index record is gone when the latest relist covering its namespace
    started after the record was indexed (its `indexed_at`) and did not list its UID: the
    pod was deleted, or lost its role label, and the watch never said so. A record indexed
    after the list started (a pod created or changed meanwhile) is kept whatever the list
    found, and so is one of a namespace no relist has covered yet.
    """

    def __init__(self) -> None:
        self._seen: dict[str | None, tuple[float, frozenset[str]]] = {}
        self._gone: set[str] = set()  # the UIDs gone at the last sweep

    def observe(self, scope: str | None, started: float, uids: Iterable[str]) -> None:
        """A list of `scope` that started at `started` found `uids`."""
        self._seen[scope] = (started, frozenset(uids))

    def gone(self, namespace: str, rec: Mapping[str, Any]) -> bool:
        seen = self._seen.get(namespace) or self._seen.get(None)
        if seen is None:
            return False
        started, uids = seen
        return rec.get("uid") not in uids and float(rec.get("indexed_at", math.inf)) < started

    def sweep(self, index: Mapping[str, Iterable[Mapping[str, Any]]]) -> dict[str, list[str]]:
        """The records of `index` gone now that were not at the last sweep: their names, by
        namespace (each one is counted once)."""
        gone: set[str] = set()
        new: dict[str, list[str]] = {}
        for namespace in index:
            for rec in index[namespace]:
                if self.gone(namespace, rec):
                    gone.add(rec["uid"])
                    if rec["uid"] not in self._gone:
                        new.setdefault(namespace, []).append(rec["name"])
        self._gone = gone
        return new


async def relist(api: ClusterApi, namespaces: Sequence[str] | None) -> dict[str, list[str]]:
    """Lists the engine pods of each watched namespace afresh (`namespaces`; None: the whole
    cluster, in one list; metadata only) and hides from the loops every indexed pod whose
    UID the list did not find (`LiveUids`); pokes the loops of each namespace that lost a
    pod. Returns the pods dropped now, by namespace. A namespace whose list fails keeps
    what the last list of it found."""
    live: LiveUids = _state.setdefault("live", LiveUids())
    metrics = _state["metrics"]
    for scope in [None] if namespaces is None else namespaces:
        started = time.monotonic()
        try:
            items = await asyncio.to_thread(api.list_pods, scope, ROLE_LABEL, metadata_only=True)
        except Exception as exc:  # 403, a timeout: the next relist tries again
            metrics.relist_failures.inc()
            log.warning("relisting the engine pods of %s: %s", scope or "all namespaces", exc)
            continue
        live.observe(scope, started, (str(i["metadata"].get("uid") or "") for i in items))
    dropped = live.sweep(_state.get("engine_pods") or {})
    reconciler: Reconciler | None = _state.get("reconciler")
    for namespace, names in dropped.items():
        metrics.stale_pods_dropped.inc(len(names))
        log.warning(
            "%s: dropping %d engine pods whose deletion the watch missed: %s",
            namespace,
            len(names),
            ", ".join(sorted(names)[:20]),
        )
        if reconciler is not None:
            reconciler.poke_namespace(namespace)
    return dropped


async def _relist_every(api: ClusterApi, namespaces: Sequence[str] | None, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)  # the period itself, not a wait for something
        try:
            await relist(api, namespaces)
        except Exception:
            log.exception("relisting the engine pods failed")


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
    return list(index[namespace]) if namespace in index else []


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
    # kopf's own API calls (and its watches' connects) give up as the operator's do.
    settings.networking.connect_timeout = REQUEST_TIMEOUT_S
    settings.networking.request_timeout = 3 * REQUEST_TIMEOUT_S
    # The namespaces are fixed on the command line and the CRD exists before we start: no
    # cluster-wide discovery of namespaces and CRDs, which least-privilege RBAC refuses.
    settings.scanning.disabled = True
    settings.persistence.diffbase_storage = _NoDiffBase()
    _state["allow_endpoint_host"] = bool(memo.get("allow_endpoint_host"))
    _state["reconciler"] = Reconciler(
        kube=KubeClient(memo.get("kubeconfig")),
        workers=WorkerClient(memo.get("token_file"), memo.get("token")),
        pods=_pod_source,
        topologies=_topology_source,
        metrics=memo["metrics"],
        settings=Settings(resync_s=memo.get("resync_s", 2.0)),
    )
    _state["metrics"] = memo["metrics"]
    _state.setdefault("known", {})
    resync_s = float(memo.get("resync_s", 2.0))
    _state["stuck_after_s"] = float(memo.get("stuck_after_s") or max(120.0, 10 * resync_s))
    relist_s = float(memo.get("relist_s") or 0)
    if relist_s > 0:
        _state["relister"] = asyncio.create_task(
            _relist_every(
                ClusterApi(memo.get("kubeconfig")), memo.get("watch_namespaces"), relist_s
            ),
            name="kvtopo-relist",
        )
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
        log.info("not leading: cancelling %d loops", reconciler.running)
        reconciler.cancel_all()


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
    relister: asyncio.Task[None] | None = _state.pop("relister", None)
    if relister is not None:
        relister.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relister
    elector: LeaderElector | None = _state.pop("elector", None)
    if elector is not None:  # stops the loops first, then releases the Lease
        await elector.stop()
    reconciler = _state.pop("reconciler", None)
    if reconciler is not None:
        await reconciler.stop()


@kopf.on.event("pods", labels={ROLE_LABEL: kopf.PRESENT})
async def pod_changed(**kwargs: Any) -> None:
    _state["engine_pods"] = kwargs["engine_pods"]
    _state["kv_topologies"] = kwargs["kv_topologies"]
    reconciler = _state.get("reconciler")
    if reconciler is not None:
        reconciler.poke_namespace(kwargs["namespace"])


@kopf.on.event(GROUP, VERSION, PLURAL)
async def topology_changed(**kwargs: Any) -> None:
    _state["engine_pods"] = kwargs["engine_pods"]
    _state["kv_topologies"] = kwargs["kv_topologies"]
    key = (kwargs["namespace"], kwargs["name"])
    known: dict[tuple[str, str], int] = _state.setdefault("known", {})
    generation = int(kwargs["meta"].get("generation", 0))
    # A topology that comes, goes or changes its spec may change which pods the others of
    # its namespace own (a status write changes nothing of it).
    claim_changed = kwargs["type"] == "DELETED" or known.get(key) != generation
    if kwargs["type"] == "DELETED":
        known.pop(key, None)
    else:  # remembered as a standby too: a new leader starts its loop at once
        known[key] = generation
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
