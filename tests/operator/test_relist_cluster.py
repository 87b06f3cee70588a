"""The periodic relist against the real kube-apiserver (tier a): a stale pod-index entry is
dropped.

kopf's gap is reproduced as kopf would leave it: the engine-pod index is filled by the real
index function (`handlers.engine_pods`) from the pods as the API server has them, then pods
are deleted on the server without the index hearing of it (a watch that restarted after
"410 Gone" replays only the pods still present). One pod is deleted and created again under
the same name, the watch having seen only the new one, so the index holds both (the double
count of a reused name or IP). `handlers.relist` lists the engine pods from the API server
(metadata only, per namespace or cluster-wide) and the loops' view of the pods
(`handlers._pod_source`) then holds exactly the live ones; the drops are counted once and the
namespace's loops are poked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill.manifests import Role
from kvtopo_operator import handlers
from kvtopo_operator.kube import ClusterApi
from kvtopo_operator.metrics import OperatorMetrics
from tests.cluster.kube import create_engine_pod, create_namespace, get_json

# kopf's decorator types the index function as kopf's callback; called here directly.
index_pod = cast(Callable[..., dict[str, Any]], handlers.engine_pods)


@pytest.fixture
def ns(cluster_a: LocalCluster) -> Iterator[str]:
    name = create_namespace(cluster_a, "kvt-relist", wait_for_sa=False)
    yield name
    cluster_a.kubectl("delete", "namespace", name, "--wait=false", check=False)


def indexed(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    """The pod's engine-pod index record, made by kopf's index function from the pod as the
    API server has it."""
    pod = get_json(cluster, "pod", name, "-n", namespace)
    meta = pod["metadata"]
    (rec,) = index_pod(
        namespace=namespace,
        name=name,
        uid=meta["uid"],
        labels=meta.get("labels", {}),
        annotations=meta.get("annotations", {}),
        meta=meta,
        spec=pod.get("spec", {}),
        status=pod.get("status", {}),
        body=pod,
    ).values()
    assert isinstance(rec, dict)
    return rec


def delete(cluster: LocalCluster, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", "--grace-period=0")


class Pokes:
    def __init__(self) -> None:
        self.namespaces: list[str] = []

    def poke_namespace(self, namespace: str) -> None:
        self.namespaces.append(namespace)


@pytest.mark.asyncio
@pytest.mark.parametrize("scope", ["namespaced", "cluster-wide"])
async def test_relist_drops_the_pods_deleted_while_the_watch_was_away(
    cluster_a: LocalCluster, ns: str, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods: list[tuple[str, Role]] = [("keep", "prefill"), ("gone", "decode"), ("again", "decode")]
    for name, role in pods:
        create_engine_pod(cluster_a, ns, name, role)
    index: dict[str, list[dict[str, Any]]] = {
        ns: [indexed(cluster_a, ns, n) for n in ("keep", "gone", "again")]
    }
    # The gap: "gone" is deleted, "again" deleted and created anew; the watch came back
    # with only the new "again".
    delete(cluster_a, ns, "gone")
    delete(cluster_a, ns, "again")
    new_uid = create_engine_pod(cluster_a, ns, "again", "decode")
    index[ns].append(indexed(cluster_a, ns, "again"))

    metrics, pokes = OperatorMetrics(), Pokes()
    monkeypatch.setattr(
        handlers,
        "_state",
        {
            "engine_pods": index,
            "metrics": metrics,
            "reconciler": pokes,
            "allow_endpoint_host": False,
        },
    )

    def seen() -> list[tuple[str, str]]:
        return sorted((p.name, p.uid) for p in handlers._pod_source(ns, 8975))

    assert len(seen()) == 4, "without a relist the loops see the deleted pods"

    api = ClusterApi(cluster_a.kubeconfig)
    namespaces = [ns] if scope == "namespaced" else None
    dropped = await handlers.relist(api, namespaces)
    assert {k: sorted(v) for k, v in dropped.items()} == {ns: ["again", "gone"]}
    keep_uid = get_json(cluster_a, "pod", "keep", "-n", ns)["metadata"]["uid"]
    assert seen() == [("again", new_uid), ("keep", keep_uid)]
    assert pokes.namespaces == [ns]
    total = "kvtopo_operator_stale_pods_dropped_total"
    assert metrics.registry.get_sample_value(total) == 2.0

    # Counted once: the next relist drops nothing new.
    assert await handlers.relist(api, namespaces) == {}
    assert metrics.registry.get_sample_value(total) == 2.0 and pokes.namespaces == [ns]
    assert seen() == [("again", new_uid), ("keep", keep_uid)]
