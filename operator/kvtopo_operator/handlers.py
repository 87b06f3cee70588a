"""Thin kopf handlers: watches in, pokes out. No decisions are made here.

Owns the kopf registrations: the engine-pod index (pods filtered server-side on the
`kvtopo.dev/role` label, grouped by namespace), the pod and KVTopology event handlers that
poke the per-topology loops of `reconcile.Reconciler`, and start-up/clean-up. The operator's
configuration arrives in kopf's `memo` (see `main`). Handlers never return values (kopf
would store them in `status.<handler>`) and add no finalizers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import kopf

from kvtopo_operator.api import ENDPOINT_ANNOTATION, GROUP, PLURAL, ROLE_LABEL, VERSION
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import PodView
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient

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
            "pod_ip": status.get("podIP") or "",
            "endpoint": annotations.get(ENDPOINT_ANNOTATION, ""),
        }
    }


def _endpoint(annotation: str, pod_ip: str, control_port: int) -> str:
    """host:port of the pod's worker, or "" while it has none (an annotation that is not
    host:port, e.g. "pending", means the engine is not serving yet)."""
    if annotation:
        host, sep, port = annotation.rpartition(":")
        return annotation if sep and host and port.isdigit() else ""
    return f"{pod_ip}:{control_port}" if pod_ip else ""


def _pod_source(namespace: str, control_port: int) -> Iterable[PodView]:
    index = _state.get("engine_pods")
    if index is None or namespace not in index:
        return []
    out = []
    for rec in index[namespace]:
        endpoint = _endpoint(rec["endpoint"], rec["pod_ip"], control_port)
        out.append(
            PodView(
                name=rec["name"],
                role=rec["role"],
                labels=rec["labels"],
                ready=rec["ready"],
                deleting=rec["deleting"],
                endpoint=endpoint,
                ready_since=rec["ready_since"],
            )
        )
    return out


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    # The namespaces are fixed on the command line and the CRD exists before we start: no
    # cluster-wide discovery of namespaces and CRDs, which least-privilege RBAC refuses.
    settings.scanning.disabled = True
    _state["reconciler"] = Reconciler(
        kube=KubeClient(memo.get("kubeconfig")),
        workers=WorkerClient(memo.get("token_file"), memo.get("token")),
        pods=_pod_source,
        metrics=memo["metrics"],
        settings=Settings(resync_s=memo.get("resync_s", 2.0)),
    )


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    reconciler = _state.pop("reconciler", None)
    if reconciler is not None:
        await reconciler.stop()


@kopf.on.event("pods", labels={ROLE_LABEL: kopf.PRESENT})
async def pod_changed(**kwargs: Any) -> None:
    _state["engine_pods"] = kwargs["engine_pods"]
    reconciler = _state.get("reconciler")
    if reconciler is not None:
        reconciler.poke_namespace(kwargs["namespace"])


@kopf.on.event(GROUP, VERSION, PLURAL)
async def topology_changed(**kwargs: Any) -> None:
    _state["engine_pods"] = kwargs["engine_pods"]
    reconciler: Reconciler | None = _state.get("reconciler")
    if reconciler is None:
        return
    key = (kwargs["namespace"], kwargs["name"])
    if kwargs["type"] == "DELETED":
        reconciler.forget(key)
    else:
        reconciler.ensure(key, int(kwargs["meta"].get("generation", 0)))
