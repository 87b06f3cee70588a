"""Small kubectl helpers for the control-plane tests (JSON reads, waits on real state)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def apply(cluster: LocalCluster, manifest: dict[str, Any] | str) -> str:
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return cluster.kubectl("apply", "-f", "-", input=text).stdout


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def create_namespace(cluster: LocalCluster, prefix: str, *, wait_for_sa: bool) -> str:
    """A fresh namespace; on tier b wait for its `default` ServiceAccount, without which
    the ServiceAccount admission plugin refuses every pod in it."""
    name = unique_name(prefix)
    cluster.kubectl("create", "namespace", name)
    if wait_for_sa:
        wait_until(
            lambda: (
                cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0
            ),
            30,
            f"ServiceAccount default in {name}",
        )
    return name


def pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l", selector)[
        "items"
    ]
    return items


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return pod.get("status", {}).get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for item in obj.get("status", {}).get("conditions", []):
        if item.get("type") == kind:
            result: dict[str, Any] = item
            return result
    return None


def ready_engine_pod(
    cluster: LocalCluster,
    namespace: str,
    name: str,
    role: manifests.Role,
    endpoint: str,
    labels: dict[str, str] | None = None,
) -> None:
    """An engine pod of app `llama` on tier a (no kubelet): created with its worker's control
    endpoint in the `kvtopo.dev/control-endpoint` annotation, then marked Running and Ready
    through the status subresource."""
    pod = manifests.engine_pod(
        name, app="llama", role=role, endpoint=endpoint, namespace=namespace, labels=labels
    )
    apply(cluster, pod)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {
        "status": {
            "phase": "Running",
            "podIP": "10.9.9.9",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }
    }
    cluster.kubectl(
        "patch",
        "pod",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
