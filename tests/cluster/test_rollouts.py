"""Tier b: Deployments really roll out on kwok's fake nodes (controllers, scheduler, kwok)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from tests.cluster.kube import apply, condition, create_namespace, get_json, is_ready, pods

pytestmark = pytest.mark.cluster

APP = "web"
SELECTOR = f"app={APP}"
ROLLOUT_TIMEOUT = "90s"
WAIT_S = 90.0


def _deployment(namespace: str, replicas: int) -> dict[str, Any]:
    # An engine Deployment with no worker behind it: these tests exercise the control plane.
    return manifests.engine_deployment(
        APP, app=APP, role="decode", replicas=replicas, namespace=namespace, endpoint=None
    )


def _rollout_status(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl(
        "rollout",
        "status",
        f"deployment/{APP}",
        "-n",
        namespace,
        f"--timeout={ROLLOUT_TIMEOUT}",
        timeout=WAIT_S + 30,
    )


def _ready_pods(cluster: LocalCluster, namespace: str, count: int) -> list[dict[str, Any]]:
    """Wait until exactly ``count`` pods exist, all Running and Ready (none terminating)."""

    def settled() -> list[dict[str, Any]] | None:
        current = pods(cluster, namespace, SELECTOR)
        ok = len(current) == count and all(
            is_ready(p) and "deletionTimestamp" not in p["metadata"] for p in current
        )
        return current if ok else None

    return wait_until(settled, WAIT_S, f"{count} ready pods in {namespace}") or []


@pytest.fixture
def deployed(cluster_b: LocalCluster) -> str:
    """A namespace with the 3-replica Deployment rolled out; returns the namespace."""
    namespace = create_namespace(cluster_b, "rollout", wait_for_sa=True)
    apply(cluster_b, _deployment(namespace, 3))
    _rollout_status(cluster_b, namespace)
    return namespace


def test_deployment_becomes_available_on_fake_nodes(cluster_b: LocalCluster, deployed: str) -> None:
    deployment = get_json(cluster_b, "deployment", APP, "-n", deployed)
    available = condition(deployment, "Available")
    assert available is not None
    assert available["status"] == "True"
    assert deployment["status"]["availableReplicas"] == 3
    running = _ready_pods(cluster_b, deployed, 3)
    assert {p["spec"]["nodeName"] for p in running} <= set(cluster_b.fake_node_names)


def test_rollout_restart_replaces_every_pod(cluster_b: LocalCluster, deployed: str) -> None:
    before = _ready_pods(cluster_b, deployed, 3)
    old_uids = {p["metadata"]["uid"] for p in before}
    old_names = {p["metadata"]["name"] for p in before}
    cluster_b.kubectl("rollout", "restart", f"deployment/{APP}", "-n", deployed)
    _rollout_status(cluster_b, deployed)

    def replaced() -> list[dict[str, Any]] | None:
        current = pods(cluster_b, deployed, SELECTOR)
        uids = {p["metadata"]["uid"] for p in current}
        fresh = len(current) == 3 and not uids & old_uids and all(map(is_ready, current))
        return current if fresh else None

    after = wait_until(replaced, WAIT_S, "every old pod replaced and gone")
    assert after is not None
    assert not {p["metadata"]["name"] for p in after} & old_names
    assert not {p["metadata"]["uid"] for p in after} & old_uids


def test_scale_to_zero_and_back(cluster_b: LocalCluster, deployed: str) -> None:
    cluster_b.kubectl("scale", f"deployment/{APP}", "-n", deployed, "--replicas=0")
    wait_until(
        lambda: not pods(cluster_b, deployed, SELECTOR),
        WAIT_S,
        "every pod deleted (not left Terminating)",
    )
    assert get_json(cluster_b, "deployment", APP, "-n", deployed)["spec"]["replicas"] == 0
    cluster_b.kubectl("scale", f"deployment/{APP}", "-n", deployed, "--replicas=3")
    _rollout_status(cluster_b, deployed)
    assert len(_ready_pods(cluster_b, deployed, 3)) == 3


def test_deleted_pod_disappears_and_is_replaced(cluster_b: LocalCluster, deployed: str) -> None:
    victim = _ready_pods(cluster_b, deployed, 3)[0]["metadata"]
    cluster_b.kubectl("delete", "pod", victim["name"], "-n", deployed, "--wait=false")

    def gone() -> bool:
        found = cluster_b.kubectl("get", "pod", victim["name"], "-n", deployed, check=False)
        return found.returncode != 0 and "NotFound" in found.stderr

    wait_until(gone, 30, f"pod {victim['name']} to disappear instead of hanging in Terminating")
    replacement = _ready_pods(cluster_b, deployed, 3)
    assert victim["uid"] not in {p["metadata"]["uid"] for p in replacement}
