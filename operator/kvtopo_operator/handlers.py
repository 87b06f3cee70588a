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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import kopf
from pydantic import ValidationError

from kvtopo_operator.api import (
    ENDPOINT_ANNOTATION,
    GROUP,
    PLURAL,
    ROLE_LABEL,
    VERSION,
    KVTopologySpec,
    read_tolerant,
)
from kvtopo_operator.kube import ClusterApi, KubeClient, LeaseClient
from kvtopo_operator.leader import LeaderElector
from kvtopo_operator.logic import PodView, TopologyView
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.endpoints import pod_endpoint

log = logging.getLogger(__name__)

_state: dict[str, Any] = {}


def _ready(status: dict[str, Any]) -> tuple[bool, float | None]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            ok = cond.get("status") == "True"
            since = cond.get("lastTransitionTime")
            ts = None
            if ok and since:
                ts = datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
            return ok, ts
    return False, None


@kopf.index("pods", labels={ROLE_LABEL: kopf.PRESENT})
def engine_pods(**kwargs: Any) -> dict[str, dict[str, Any]]:
    """Index: namespace -> the engine pods in it (what the reconciler needs of each)."""
    labels, annotations = kwargs["labels"], kwargs["annotations"]
    status, meta = kwargs["status"], kwargs["meta"]
    ready, since = _ready(status)
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
    out = []
    for rec in index[namespace]:
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
            )
        )
    return out


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


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    # The namespaces are fixed on the command line and the CRD exists before we start: no
    # cluster-wide discovery of namespaces and CRDs, which least-privilege RBAC refuses.
    settings.scanning.disabled = True
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


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
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
