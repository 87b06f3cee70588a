"""Tier b: kwok honours readiness gates as the kubelet does (see kwok-stages.yaml): a pod
that lists one comes up with ContainersReady=True and Ready=False, becomes Ready once the
gate's condition is True (written through pods/status, as the operator writes it), and not
Ready again when the condition turns False; a Deployment counts it available only then."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from kvtopo_operator.api import KV_CONNECTED_GATE
from tests.cluster.kube import apply, condition, create_namespace, get_json, pods

pytestmark = pytest.mark.cluster

APP = "gated"
WAIT_S = 60.0


def _set_gate(cluster: LocalCluster, namespace: str, pod: str, status: str) -> None:
    patch = {"status": {"conditions": [{"type": KV_CONNECTED_GATE, "status": status}]}}
    cluster.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "-p", json.dumps(patch)
    )


def _conditions(pod: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}


def test_kwok_makes_a_gated_pod_ready_only_with_its_gate(cluster_b: LocalCluster) -> None:
    namespace = create_namespace(cluster_b, "gates", wait_for_sa=True)
    apply(
        cluster_b,
        manifests.engine_deployment(
            APP,
            app=APP,
            role="decode",
            replicas=1,
            namespace=namespace,
            endpoint=None,
            kv_gate=True,
        ),
    )

    def running() -> dict[str, Any] | None:
        found = pods(cluster_b, namespace, f"app={APP}")
        up = [p for p in found if _conditions(p).get("ContainersReady") == "True"]
        return up[0] if up else None

    pod = wait_until(running, WAIT_S, "the gated pod's containers ready")
    assert pod is not None
    name = pod["metadata"]["name"]
    assert _conditions(pod)["Ready"] == "False", pod["status"]
    assert KV_CONNECTED_GATE not in _conditions(pod), "kwok must not set the gate itself"
    deployment = get_json(cluster_b, "deployment", APP, "-n", namespace)
    assert not deployment["status"].get("availableReplicas"), deployment["status"]

    def ready_is(value: str) -> bool:
        return _conditions(get_json(cluster_b, "pod", name, "-n", namespace)).get("Ready") == value

    _set_gate(cluster_b, namespace, name, "True")
    wait_until(lambda: ready_is("True"), WAIT_S, "Ready=True once the gate is True")
    wait_until(
        lambda: (
            get_json(cluster_b, "deployment", APP, "-n", namespace)["status"].get(
                "availableReplicas"
            )
            == 1
        ),
        WAIT_S,
        "the Deployment counting the pod available",
    )
    _set_gate(cluster_b, namespace, name, "False")
    wait_until(lambda: ready_is("False"), WAIT_S, "Ready=False once the gate is False")
    ready = condition(get_json(cluster_b, "pod", name, "-n", namespace), "Ready")
    assert ready is not None and ready.get("reason") == "ReadinessGatesNotReady", ready
