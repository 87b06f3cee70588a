"""Manifests of engine workloads and KVTopologies, for the drill, the benchmarks and the tests.

Owns the one way kvtopo's own tooling spells an engine Deployment, an engine Pod and a
KVTopology, a rollout restart's patch, and when a Deployment counts as rolled out. Label,
annotation and API names come from `kvtopo_operator.api`; a KVTopology's spec is validated
by the API models before it is sent, so a tool can never create an object that the CRD
would refuse or read differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from kvtopo.cluster.fake_nodes import FAKE_NODE_PLACEMENT
from kvtopo_operator.api import (
    ENDPOINT_ANNOTATION,
    GROUP,
    KIND,
    KV_CONNECTED_GATE,
    ROLE_LABEL,
    VERSION,
    KVTopologySpec,
)

Role = Literal["prefill", "decode"]

VERSION_LABEL = "app.kubernetes.io/version"
"""The label a rollout's revisions differ in; topologies pair engines on it."""

ENGINE_IMAGE = "ghcr.io/kvtopo/worker:0.1.0"
"""kwok never pulls or runs it: on fake nodes the name only has to be valid."""

ENDPOINT_PENDING = "pending"
"""The endpoint annotation's value until a worker serves the pod; the drill and the bench then
write the worker's port into it (the worker listens at the pod IP)."""


READINESS_GATES: dict[str, Any] = {"readinessGates": [{"conditionType": KV_CONNECTED_GATE}]}
"""What an engine pod spec lists to be Ready only once its engine moves KV to its partners."""


def engine_labels(app: str, role: Role) -> dict[str, str]:
    """The labels that select one role of one application's engines."""
    return {"app": app, ROLE_LABEL: role}


def engine_deployment(
    name: str,
    *,
    app: str,
    role: Role,
    replicas: int,
    version: str | None = "v1",
    min_ready_seconds: int = 0,
    max_surge: int | str = 1,
    max_unavailable: int | str = 0,
    termination_grace_seconds: int = 5,
    endpoint: str | None = ENDPOINT_PENDING,
    namespace: str | None = None,
    kv_gate: bool = False,
    pod_spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A Deployment of engine pods on kwok's fake nodes (`pod_spec` None), or, with the
    `pod_spec` of real engine containers, on a real node (kvtopo.drill.podfleet).

    `version` sets the pod template's `app.kubernetes.io/version` label (None: no label);
    `endpoint` the control-endpoint annotation (None: none, the operator would use podIP);
    `kv_gate` lists the readiness gate kvtopo.dev/kv-connected (a pod is Ready only once its
    engine is connected to its partners).
    """
    labels = engine_labels(app, role)
    template_labels = dict(labels) if version is None else {**labels, VERSION_LABEL: version}
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if namespace is not None:
        metadata["namespace"] = namespace
    template_meta: dict[str, Any] = {"labels": template_labels}
    if endpoint is not None:
        template_meta["annotations"] = {ENDPOINT_ANNOTATION: endpoint}
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": labels},
        "strategy": {"rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": max_unavailable}},
        "template": {
            "metadata": template_meta,
            "spec": {
                **(
                    {
                        **FAKE_NODE_PLACEMENT,
                        "terminationGracePeriodSeconds": termination_grace_seconds,
                        "containers": [{"name": "engine", "image": ENGINE_IMAGE}],
                    }
                    if pod_spec is None
                    else dict(pod_spec)
                ),
                **(READINESS_GATES if kv_gate else {}),
            },
        },
    }
    if min_ready_seconds:
        spec["minReadySeconds"] = min_ready_seconds
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec}


def engine_pod(
    name: str,
    *,
    app: str,
    role: Role,
    endpoint: str | None = None,
    namespace: str | None = None,
    labels: Mapping[str, str] | None = None,
    kv_gate: bool = False,
) -> dict[str, Any]:
    """A bare engine Pod; `endpoint` is its control-endpoint annotation (None: none, its
    worker is reached at the pod IP on the control port); `kv_gate`: it lists the readiness
    gate kvtopo.dev/kv-connected."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {**engine_labels(app, role), **(labels or {})},
    }
    if endpoint is not None:
        metadata["annotations"] = {ENDPOINT_ANNOTATION: endpoint}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "containers": [{"name": "engine", "image": ENGINE_IMAGE}],
            **(READINESS_GATES if kv_gate else {}),
        },
    }


def topology(
    name: str,
    *,
    app: str,
    namespace: str | None = None,
    pair_on: tuple[str, ...] = (),
    **spec: Any,
) -> dict[str, Any]:
    """A KVTopology selecting `app`'s prefill and decode engines.

    `pair_on` lists label keys that paired pods must share (`pairing.matchLabels`); further
    spec fields are given in their wire form (e.g. ``eviction={"graceSeconds": 1}``). The spec
    is validated by `KVTopologySpec` and written without the fields left at their defaults.
    """
    wire: dict[str, Any] = {
        "prefill": {"selector": {"matchLabels": engine_labels(app, "prefill")}},
        "decode": {"selector": {"matchLabels": engine_labels(app, "decode")}},
        **spec,
    }
    if pair_on:
        wire["pairing"] = {"matchLabels": list(pair_on)}
    model = KVTopologySpec.model_validate(wire)
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": model.model_dump(
            by_alias=True, exclude_none=True, exclude_defaults=True, mode="json"
        ),
    }


def rollout_restart_patch(at: datetime) -> dict[str, Any]:
    """The patch `kubectl rollout restart` sends a Deployment: a new template annotation."""
    stamp = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "spec": {
            "template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": stamp}}}
        }
    }


def rolled_out(deployment: Any) -> tuple[bool, int]:
    """(whether a Deployment's rollout is complete, the replicas it wants), read from a
    Deployment object as the Kubernetes client returns it: the controller has seen the
    latest spec and every wanted replica is updated, available and alone."""
    st, want = deployment.status, deployment.spec.replicas
    done = (
        (st.observed_generation or 0) >= deployment.metadata.generation
        and (st.updated_replicas or 0) == want
        and (st.available_replicas or 0) == want
        and (st.replicas or 0) == want
    )
    return done, want
