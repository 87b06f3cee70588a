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

import asyncio
from collections.abc import Iterator

import pytest

from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from kvtopo.drill.manifests import Role
from kvtopo_operator import handlers
from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import ClusterApi
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import TopologyView
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

    def poke_pods(self, namespace: str, pods: object) -> None:
        """A change of some pods pokes the loops whose selectors match them (here: noted by
        namespace, as `poke_namespace`)."""
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


@pytest.mark.asyncio
async def test_a_topology_deleted_or_replaced_while_the_watch_was_away_is_found_by_the_relist(
    cluster_a: LocalCluster, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf's relist after "410 Gone" sends no DELETED: the operator kept running the loop
    of a topology deleted in the gap (its pods connected, its status PATCHed at ~4.7/s
    answered 404, a new topology reporting Conflict with it). The periodic list of the
    KVTopologies (metadata only) finds it: one missing is forgotten as on a deletion, one
    under another uid (deleted and created again) restarts afresh; each is counted, and a
    topology forgotten so no longer claims pods (`_topology_source`), though kopf's index
    still has it."""
    metrics = OperatorMetrics()

    class Loops:
        def __init__(self) -> None:
            self.forgotten: list[tuple[str, str]] = []
            self.again: list[tuple[str, str]] = []

        def forget(self, key: tuple[str, str]) -> None:
            self.forgotten.append(key)

        def replaced(self, key: tuple[str, str]) -> None:
            self.again.append(key)

    loops = Loops()
    api = ClusterApi(cluster_a.kubeconfig)
    api.apply_crd(crd_manifest())
    await until("the CRD", lambda: api.crd_established("kvtopologies.kvtopo.dev"), UNTIL_S)
    for name in ("kept", "deleted", "again"):
        api.create_topology(ns, manifests.topology(name, app=name, namespace=ns))
    listed = api.list_topology_uids(ns)
    assert sorted(listed) == [(ns, "again"), (ns, "deleted"), (ns, "kept")]
    # What the watch delivered before its gap.
    index = {ns: [TopologyView(n, "", None) for n in ("kept", "deleted", "again")]}
    monkeypatch.setattr(
        handlers,
        "_state",
        {
            "metrics": metrics,
            "reconciler": loops,
            "leading": True,
            "kv_topologies": index,
            "known": {(ns, n): 1 for n in ("kept", "deleted", "again")},
            "uids": dict(listed),
            "bodies": {(ns, "deleted"): {"stale": True}},
        },
    )
    # The gap: one deleted, one deleted and created again.
    cluster_a.kubectl("delete", "kvtopology", "deleted", "again", "-n", ns, "--wait=true")
    api.create_topology(ns, manifests.topology("again", app="again", namespace=ns))

    task = asyncio.create_task(handlers.relist_topologies(api, [ns], 0.05))
    try:
        total = "kvtopo_operator_stale_topologies_dropped_total"
        await until("the relist", lambda: metrics.registry.get_sample_value(total), UNTIL_S)
    finally:
        task.cancel()
    assert loops.forgotten == [(ns, "deleted")]
    assert loops.again == [(ns, "again")]
    assert metrics.registry.get_sample_value(total) == 2.0
    state = handlers._state
    assert sorted(state["known"]) == [(ns, "again"), (ns, "kept")]
    assert state["uids"][(ns, "again")] == api.list_topology_uids(ns)[(ns, "again")]
    assert (ns, "deleted") not in state["bodies"]
    assert [t.name for t in handlers._topology_source(ns)] == ["kept", "again"]
    # One topology read by a list of its name (the operator may list, not get).
    assert api.read_topology(ns, "kept")["metadata"]["uid"] == listed[(ns, "kept")]  # type: ignore[index]
    assert api.read_topology(ns, "deleted") is None
