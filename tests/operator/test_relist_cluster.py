"""The engine-pod watch against the real kube-apiserver (tier a): it follows the server, and
a list after a gap drops the pods whose deletion the watch missed.

- The real `PodWatch` (`handlers.start_pod_watch`, the operator's `ClusterApi`) lists and
  then watches: pods created, made Ready and deleted on the server reach the loops' view
  (`handlers._pod_source`), and each change pokes the namespace.
- The gap, as a watch restarted after "410 Gone" leaves it: a watch is stopped, pods are
  deleted on the server (one deleted and created again under the same name: the double count
  of a reused name or IP), and a new watch starts on the store the first one left. Its list
  replaces the namespace's pods: the loops' view then holds exactly the live ones, and the
  drops are counted once (`stale_pods_dropped`) and the namespace's loops are poked. Per
  namespace and cluster-wide.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill.manifests import Role
from kvtopo_operator import handlers
from kvtopo_operator.kube import ClusterApi
from kvtopo_operator.metrics import OperatorMetrics
from tests.cluster.kube import create_engine_pod, create_namespace, mark_pod_ready
from tests.operator.polling import until


@pytest.fixture
def ns(cluster_a: LocalCluster) -> Iterator[str]:
    name = create_namespace(cluster_a, "kvt-relist", wait_for_sa=False)
    yield name
    cluster_a.kubectl("delete", "namespace", name, "--wait=false", check=False)


def delete(cluster: LocalCluster, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true", "--grace-period=0")


class Pokes:
    def __init__(self) -> None:
        self.namespaces: list[str] = []

    def poke_namespace(self, namespace: str) -> None:
        self.namespaces.append(namespace)


UNTIL_S = 30.0  # the real API server, on a loaded machine


@pytest.mark.asyncio
@pytest.mark.parametrize("scope", ["namespaced", "cluster-wide"])
async def test_a_list_after_a_gap_drops_the_pods_deleted_while_the_watch_was_away(
    cluster_a: LocalCluster, ns: str, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics, pokes = OperatorMetrics(), Pokes()
    monkeypatch.setattr(
        handlers,
        "_state",
        {"metrics": metrics, "reconciler": pokes, "allow_endpoint_host": False},
    )
    api = ClusterApi(cluster_a.kubeconfig)
    namespaces = [ns] if scope == "namespaced" else None

    def seen() -> list[tuple[str, str]]:
        return sorted((p.name, p.uid) for p in handlers._pod_source(ns, 8975))

    first = handlers.start_pod_watch(api, namespaces, relist_s=0)
    try:
        assert await first.wait_listed(30)
        pods: list[tuple[str, Role]] = [
            ("keep", "prefill"),
            ("gone", "decode"),
            ("again", "decode"),
        ]
        uids = {name: create_engine_pod(cluster_a, ns, name, role) for name, role in pods}
        await until("the watch to see the three pods", lambda: len(seen()) == 3, UNTIL_S)
        assert ns in pokes.namespaces
        mark_pod_ready(cluster_a, ns, "keep", ["10.9.0.1"])
        await until(
            "the watch to see keep Ready",
            lambda: [p.ready for p in handlers._pod_source(ns, 8975) if p.name == "keep"] == [True],
            UNTIL_S,
        )
    finally:
        first.stop()
    store = handlers._state["pods"]

    # The gap: "gone" is deleted, "again" deleted and created anew; no watch runs.
    delete(cluster_a, ns, "gone")
    delete(cluster_a, ns, "again")
    new_uid = create_engine_pod(cluster_a, ns, "again", "decode")
    assert seen() == sorted((n, u) for n, u in uids.items()), "the store still has them"

    pokes.namespaces.clear()
    total = "kvtopo_operator_stale_pods_dropped_total"
    second = handlers.start_pod_watch(api, namespaces, relist_s=0, store=store)
    try:
        await until(
            "the list to drop the deleted pods",
            lambda: metrics.registry.get_sample_value(total),
            UNTIL_S,
        )
        assert seen() == sorted([("again", new_uid), ("keep", uids["keep"])])
        assert metrics.registry.get_sample_value(total) == 2.0
        assert ns in pokes.namespaces
        # Counted once: what the watch sees next is followed, not dropped again.
        delete(cluster_a, ns, "keep")
        await until(
            "the watch to see keep deleted", lambda: seen() == [("again", new_uid)], UNTIL_S
        )
        assert metrics.registry.get_sample_value(total) == 2.0
    finally:
        second.stop()
