"""Small kubectl helpers for the control-plane tests (JSON reads, waits on real state)."""

from __future__ import annotations

import json
import os
import socket
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


CONTROL_PORT = 8975
"""The KVTopology's default controlPort: where each test worker listens at its pod IP."""

_next_ip = [0]


def loopback_pod_ip() -> str:
    """A loopback address of 127.200.0.0/16 that no process listens on at the control port:
    a tier-a engine pod's IP (tier a has no kwok to hand pod IPs out). All of 127.0.0.0/8 is
    loopback, so each pod has an address of its own, as in a real cluster."""
    base = (os.getpid() * 7919) % 60000
    for _ in range(65000):
        _next_ip[0] += 1
        n = (base + _next_ip[0]) % 65000 + 1
        ip = f"127.200.{n // 256}.{n % 256}"
        with socket.socket() as probe:
            try:
                probe.bind((ip, CONTROL_PORT))
            except OSError:
                continue
        return ip
    raise RuntimeError("no free loopback address in 127.200.0.0/16")


def identity_args(namespace: str, name: str, uid: str, ip: str) -> list[str]:
    """What the downward API tells an engine in a pod: its IP to bind, its pod identity."""
    return [
        "--host",
        ip,
        "--port",
        str(CONTROL_PORT),
        "--pod-namespace",
        namespace,
        "--pod-name",
        name,
        "--pod-uid",
        uid,
    ]


def create_engine_pod(
    cluster: LocalCluster,
    namespace: str,
    name: str,
    role: manifests.Role,
    labels: dict[str, str] | None = None,
    annotation: str | None = None,
    kv_gate: bool = False,
    node: str | None = None,
) -> str:
    """An engine pod of app `llama` (not Ready yet); its uid. `annotation`: the value of its
    control-endpoint annotation (None: none, the worker is at podIP:controlPort)."""
    pod = manifests.engine_pod(
        name,
        app="llama",
        role=role,
        endpoint=annotation,
        namespace=namespace,
        labels=labels,
        kv_gate=kv_gate,
    )
    if node is not None:  # bound to that node at creation, as the scheduler would
        pod["spec"]["nodeName"] = node
    apply(cluster, pod)
    uid: str = get_json(cluster, "pod", name, "-n", namespace)["metadata"]["uid"]
    return uid


def mark_pod_ready(
    cluster: LocalCluster, namespace: str, name: str, ips: list[str], *, kv_gate: bool = False
) -> None:
    """Tier a has no kubelet: the pod is marked Running, its containers ready and the pod
    Ready, with `ips` as its pod IPs, through the status subresource. A pod that lists the
    kv-connected readiness gate (`kv_gate`) is left not Ready, as the kubelet leaves it
    until the gate's condition is True (nothing flips it later in tier a)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = "False" if kv_gate else "True"
    status = {
        "status": {
            "phase": "Running",
            "podIP": ips[0],
            "podIPs": [{"ip": ip} for ip in ips],
            "conditions": [
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                {
                    "type": "Ready",
                    "status": ready,
                    "lastTransitionTime": now,
                    # The kubelet always says why a pod is not Ready.
                    **({"reason": "ReadinessGatesNotReady"} if kv_gate else {}),
                },
            ],
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
