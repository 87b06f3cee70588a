"""kwok's vendored stages and the fake Node contract."""

from __future__ import annotations

from typing import Any

import yaml

from kvtopo.cluster.fake_nodes import (
    FAKE_NODE_PLACEMENT,
    fake_node_manifest,
    kwok_stages_yaml,
    node_is_schedulable,
)


def test_vendored_stages_hold_the_fast_set_including_pod_delete() -> None:
    stages = [doc for doc in yaml.safe_load_all(kwok_stages_yaml()) if doc]
    assert {doc["kind"] for doc in stages} == {"Stage"}
    names = {doc["metadata"]["name"] for doc in stages}
    assert names == {
        "node-initialize",
        "node-heartbeat-with-lease",
        "pod-ready",
        "pod-gates-ready",  # ours: kwok honours readiness gates (test_readiness_gates.py)
        "pod-gates-unready",
        "pod-complete",
        "pod-delete",
    }
    delete = next(doc for doc in stages if doc["metadata"]["name"] == "pod-delete")
    assert delete["spec"]["next"]["delete"] is True


def test_fake_node_is_annotated_labelled_tainted_and_sized() -> None:
    node = fake_node_manifest("kwok-node-0")
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert node["metadata"]["labels"]["type"] == "kwok"
    assert node["spec"]["taints"] == [
        {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
    ]
    assert node["status"]["capacity"] == {"cpu": "32", "memory": "256Gi", "pods": "110"}


def test_placement_tolerates_the_fake_node_taint() -> None:
    taint = fake_node_manifest("n")["spec"]["taints"][0]
    toleration = FAKE_NODE_PLACEMENT["tolerations"][0]
    assert (toleration["key"], toleration["value"], toleration["effect"]) == (
        taint["key"],
        taint["value"],
        taint["effect"],
    )
    assert FAKE_NODE_PLACEMENT["nodeSelector"] == {"type": "kwok"}


def _node(ready: str, taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "spec": {"taints": taints or []},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


def test_node_is_schedulable_once_ready_and_lifecycle_taints_are_gone() -> None:
    kwok_taint = {"key": "kwok.x-k8s.io/node", "effect": "NoSchedule"}
    not_ready = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
    assert node_is_schedulable(_node("True", [kwok_taint]))
    assert not node_is_schedulable(_node("False", [kwok_taint]))
    assert not node_is_schedulable(_node("True", [kwok_taint, not_ready]))
    assert not node_is_schedulable({"spec": {}, "status": {}})
