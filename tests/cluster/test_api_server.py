"""Tier a against the real kube-apiserver: version, a CRD's schema and CEL rules, and the
audit log of ServiceAccounts' requests."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

from kvtopo.cluster.binaries import K8S_VERSION
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from tests.cluster.kube import apply, condition, create_namespace, get_json

pytestmark = pytest.mark.cluster

GROUP = "test.kvtopo.dev"
CRD_NAME = f"widgets.{GROUP}"
CRD = f"""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {CRD_NAME}
spec:
  group: {GROUP}
  scope: Namespaced
  names: {{plural: widgets, singular: widget, kind: Widget}}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {{status: {{}}}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [role, replicas]
            properties:
              role: {{type: string, enum: [prefill, decode]}}
              replicas: {{type: integer, minimum: 1}}
              maxReplicas: {{type: integer}}
            x-kubernetes-validations:
            - rule: "!has(self.maxReplicas) || self.replicas <= self.maxReplicas"
              message: replicas must not exceed maxReplicas
              fieldPath: .replicas
"""


def test_client_and_server_report_the_pinned_version(cluster_a: LocalCluster) -> None:
    version = json.loads(cluster_a.kubectl("version", "-o", "json").stdout)
    assert version["clientVersion"]["gitVersion"] == K8S_VERSION
    assert version["serverVersion"]["gitVersion"] == K8S_VERSION
    assert cluster_a.server_url.startswith("https://127.0.0.1:")


def _widget(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


@pytest.fixture(scope="module")
def widget_crd(cluster_a: LocalCluster) -> str:
    """The test CRD, Established and served (discovery included)."""
    apply(cluster_a, CRD)
    cluster_a.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    wait_until(
        lambda: cluster_a.kubectl("get", "widgets", "-A", check=False).returncode == 0,
        30,
        "widgets to be served",
    )
    return CRD_NAME


def test_crd_becomes_established(cluster_a: LocalCluster, widget_crd: str) -> None:
    crd = get_json(cluster_a, "crd", widget_crd)
    established = condition(crd, "Established")
    assert established is not None
    assert established["status"] == "True"
    names_accepted = condition(crd, "NamesAccepted")
    assert names_accepted is not None
    assert names_accepted["status"] == "True"


def test_valid_custom_resource_is_accepted(cluster_a: LocalCluster, widget_crd: str) -> None:
    namespace = create_namespace(cluster_a, "crd-valid", wait_for_sa=False)
    apply(cluster_a, _widget(namespace, "ok", {"role": "decode", "replicas": 2, "maxReplicas": 4}))
    stored = get_json(cluster_a, "widget", "ok", "-n", namespace)
    assert stored["spec"] == {"role": "decode", "replicas": 2, "maxReplicas": 4}


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"role": "router", "replicas": 1}, "spec.role", 'Unsupported value: "router"'),
        ({"role": "prefill", "replicas": 0}, "spec.replicas", "greater than or equal to 1"),
        (
            {"role": "prefill", "replicas": 5, "maxReplicas": 2},
            "spec.replicas",
            "replicas must not exceed maxReplicas",
        ),
        ({"role": "prefill"}, "spec.replicas", "Required value"),
    ],
    ids=["enum", "minimum", "cel-rule", "required"],
)
def test_invalid_custom_resource_is_refused_naming_the_field(
    cluster_a: LocalCluster, widget_crd: str, spec: dict[str, Any], field: str, reason: str
) -> None:
    namespace = create_namespace(cluster_a, "crd-invalid", wait_for_sa=False)
    refused = cluster_a.kubectl(
        "create", "-f", "-", input=yaml.safe_dump(_widget(namespace, "bad", spec)), check=False
    )
    assert refused.returncode != 0
    assert "is invalid" in refused.stderr
    assert field in refused.stderr
    assert reason in refused.stderr
    missing = cluster_a.kubectl("get", "widget", "bad", "-n", namespace, check=False)
    assert missing.returncode != 0
    assert "NotFound" in missing.stderr


def test_audit_log_records_service_account_requests_only(cluster_a: LocalCluster) -> None:
    """A ServiceAccount's request is logged at Metadata level (verb, resource, response code,
    no bodies); the admin's requests are not logged at all."""
    namespace = create_namespace(cluster_a, "audit", wait_for_sa=False)
    cluster_a.kubectl("create", "serviceaccount", "auditee", "-n", namespace)
    token = cluster_a.kubectl(
        "create", "token", "auditee", "-n", namespace, "--duration=10m"
    ).stdout.strip()
    cluster_a.kubectl("get", "configmaps", "-n", namespace)  # the admin: not logged
    request = urllib.request.Request(
        f"{cluster_a.server_url}/api/v1/namespaces/{namespace}/configmaps?limit=1",
        headers={"Authorization": f"Bearer {token}"},
    )
    context = ssl.create_default_context(cafile=str(cluster_a.pki.ca_cert))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10, context=context)
    assert refused.value.code == 403  # no grants at all
    user = f"system:serviceaccount:{namespace}:auditee"

    def logged() -> list[dict[str, Any]] | None:
        events = [
            e
            for e in cluster_a.audit_events(user)
            if e.get("objectRef", {}).get("namespace") == namespace
        ]
        return events or None

    events = wait_until(logged, 15, f"the audit log to record {user}'s request")
    assert events is not None
    (event,) = events
    assert event["level"] == "Metadata" and event["stage"] == "ResponseComplete"
    assert event["verb"] == "list"
    assert event["objectRef"]["resource"] == "configmaps"
    assert event["responseStatus"]["code"] == 403
    assert "system:serviceaccounts" in event["user"]["groups"]
    assert "requestObject" not in event and "responseObject" not in event
    everyone = cluster_a.audit_events()
    assert all("system:serviceaccounts" in e["user"].get("groups", []) for e in everyone)
    assert all(e["stage"] != "RequestReceived" for e in everyone)
