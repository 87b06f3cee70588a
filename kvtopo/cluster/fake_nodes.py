"""kwok's fake nodes: their manifests, the Stage file, and what pods need to land on them.

Owns the contract between the local control plane and kwok: a Node carrying the
``kwok.x-k8s.io/node: fake`` annotation is managed by kwok, which marks it Ready and moves
pods bound to it to Running/Ready (and finishes their deletion) per the vendored Stage
objects in ``kwok-stages.yaml``. The nodes are tainted, so only pods that tolerate the taint
and select ``type=kwok`` (:data:`FAKE_NODE_PLACEMENT`) run there. The pod IPs kwok writes
are fake: never connect to them.

Called by :mod:`kvtopo.cluster.local_cluster`; drills and tests use
:data:`FAKE_NODE_PLACEMENT` in their pod templates.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_VALUE = "fake"  # the annotation's value kwok manages (a node without it is not)
FAKE_NODE_LABEL = ("type", "kwok")
FAKE_NODE_TAINT: dict[str, str] = {
    "key": "kwok.x-k8s.io/node",
    "value": "fake",
    "effect": "NoSchedule",
}
DEFAULT_FAKE_NODES = 3
DEFAULT_CAPACITY: dict[str, str] = {"cpu": "32", "memory": "256Gi", "pods": "110"}

# Merge into a pod spec to schedule it onto the fake nodes (and only there).
FAKE_NODE_PLACEMENT: dict[str, Any] = {
    "nodeSelector": {FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1]},
    "tolerations": [{**FAKE_NODE_TAINT, "operator": "Equal"}],
}


def fake_node_name(index: int) -> str:
    return f"kwok-node-{index}"


def fake_node_manifest(name: str, capacity: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node for kwok to manage; the node-initialize stage keeps the given capacity."""
    resources_ = dict(capacity or DEFAULT_CAPACITY)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                FAKE_NODE_ANNOTATION: FAKE_NODE_VALUE,
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1],
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
            },
        },
        "spec": {"taints": [dict(FAKE_NODE_TAINT)]},
        "status": {"allocatable": dict(resources_), "capacity": dict(resources_)},
    }


def node_is_schedulable(node: dict[str, Any]) -> bool:
    """Ready, and the lifecycle controller has lifted its not-ready/unreachable taints."""
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints") or []
    lingering = [t for t in taints if t.get("key", "").startswith("node.kubernetes.io/")]
    return ready and not lingering and not node.get("spec", {}).get("unschedulable", False)


def kwok_stages_yaml() -> str:
    """The vendored Stage objects (kwok v0.8.0's default "fast" set)."""
    return resources.files("kvtopo.cluster").joinpath("kwok-stages.yaml").read_text()
