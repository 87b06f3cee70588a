"""The kvtopo Helm chart on the tier-b control plane (kube-controller-manager, scheduler, kwok).

Covers: both renders (default values, and the values file that sets every option) pass a
server-side dry run; `helm install` makes the operator Deployment Available on kwok's fake
nodes (two replicas, leader election) and prints NOTES that tell the user what to do next;
`kubectl auth can-i` as the chart's ServiceAccount shows exactly the granted permissions,
namespace-scoped (nothing on Secrets, pod writes or other namespaces; the one Lease; nodes
listed and watched only) and, after `helm upgrade` to cluster scope with peering (one
replica, no leader election) and other changed values, cluster-wide reads of pods and
KVTopologies but still no Secrets; the upgrade rolls the Deployment and keeps the generated
operator key; and `helm uninstall` leaves nothing behind but the CRD that Helm's CRD policy keeps.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from tests.cluster.kube import condition, create_namespace, get_json
from tests.helm.chart import (
    CHART,
    FULL_VALUES,
    KWOK_PLACEMENT,
    Helm,
    can_i,
    render_text,
    values_args,
)

HERE = Path(__file__).resolve().parent
SERVICE_MONITOR_CRD = HERE / "values" / "servicemonitor-crd.yaml"
PEERING_CRDS = CHART / "files" / "kopf-peering-crds.yaml"
ROLLOUT_TIMEOUT_S = 90

# Everything a release might create, namespaced and cluster-wide, for the leftovers check.
NAMESPACED_KINDS = (
    "deployments,replicasets,pods,services,serviceaccounts,secrets,configmaps,roles,"
    "rolebindings,networkpolicies,kopfpeerings.kopf.dev,servicemonitors.monitoring.coreos.com"
)
CLUSTER_KINDS = "clusterroles,clusterrolebindings,clusterkopfpeerings.kopf.dev"


@pytest.fixture(scope="module")
def cluster(cluster_b: LocalCluster) -> Iterator[LocalCluster]:
    """Tier b with the CRDs the full values need: kopf's peering CRDs (shipped with the
    chart) and a minimal ServiceMonitor CRD standing in for prometheus-operator's."""
    cluster_b.kubectl("apply", "-f", str(PEERING_CRDS), "-f", str(SERVICE_MONITOR_CRD))
    cluster_b.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/kopfpeerings.kopf.dev",
        "crd/clusterkopfpeerings.kopf.dev",
        "crd/servicemonitors.monitoring.coreos.com",
        "--timeout=60s",
    )
    yield cluster_b
    cluster_b.kubectl(
        "delete",
        "-f",
        str(SERVICE_MONITOR_CRD),
        "-f",
        str(PEERING_CRDS),
        "--wait=false",
        check=False,
    )


@pytest.fixture
def helm(cluster: LocalCluster, tmp_path: Path) -> Helm:
    return Helm(tmp_path / "helm", cluster.kubeconfig)


def server_dry_run(cluster: LocalCluster, manifests: str) -> str:
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=manifests, check=False
    )
    assert result.returncode == 0, f"server-side dry run refused:\n{result.stderr}"
    return result.stdout


def test_default_and_full_renders_pass_a_server_side_dry_run(
    cluster: LocalCluster, helm: Helm
) -> None:
    ops = create_namespace(cluster, "kvt-ops", wait_for_sa=False)
    engines = [create_namespace(cluster, "kvt-llm", wait_for_sa=False) for _ in range(2)]
    try:
        default = render_text(helm, namespace=ops)
        out = server_dry_run(cluster, default)
        assert out.count("(server dry run)") == len(
            [line for line in default.splitlines() if line.startswith("kind: ")]
        )
        assert "deployment.apps/kvtopo-operator created (server dry run)" in out

        full = render_text(
            helm, {"engineNamespaces": engines}, FULL_VALUES, release="r", namespace=ops
        )
        out = server_dry_run(cluster, full)
        for what in (
            "servicemonitor.monitoring.coreos.com/kvt-full-operator",
            "kopfpeering.kopf.dev/kvt-peering",
            "deployment.apps/kvt-full-operator",
            "networkpolicy.networking.k8s.io/kvt-full-worker-control",
            "networkpolicy.networking.k8s.io/kvt-full-operator",
        ):
            assert f"{what} created (server dry run)" in out, out
        assert out.count("role.rbac.authorization.k8s.io/kvt-full-operator created") == 2
        assert out.count("secret/kvt-full-operator-key created") == 1  # the operator's only
        assert out.count("configmap/kvt-full-operator-key created") == len(engines)
        # A dry run creates nothing.
        assert not get_json(cluster, "deployments", "-n", ops)["items"]
    finally:
        for ns in (ops, *engines):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- helpers for a real release ---------------------------------------------------------------


def deployment_available(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        deploy: dict[str, Any] = get_json(cluster, "deployment", name, "-n", namespace)
        status = deploy.get("status", {})
        available = condition(deploy, "Available")
        want = deploy["spec"]["replicas"]
        if (
            status.get("observedGeneration") == deploy["metadata"]["generation"]
            and status.get("updatedReplicas") == want
            and status.get("availableReplicas") == want
            and status.get("replicas") == want
            and available is not None
            and available["status"] == "True"
        ):
            return deploy
        return None

    result: dict[str, Any] | None = wait_until(
        probe,
        ROLLOUT_TIMEOUT_S,
        f"deployment {namespace}/{name} Available with its latest template",
        interval_s=0.25,
        describe_last=lambda: cluster.kubectl(
            "describe", "deployment", name, "-n", namespace, check=False
        ).stdout[-2500:],
    )
    assert result is not None
    return result


def granted_resources(cluster: LocalCluster, sa: str, namespace: str) -> dict[str, set[str]]:
    """`kubectl auth can-i --list` as the ServiceAccount: resource -> verbs, leaving out what
    every authenticated user may do (self reviews, discovery URLs)."""
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={sa}", "-n", namespace).stdout
    granted: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        if not line or line.startswith(" "):
            continue  # non-resource URLs
        resource = line.split()[0]
        if resource.startswith("selfsubject"):
            continue
        verbs = line[line.rindex("[") + 1 : line.rindex("]")].split()
        names = line.split("]")[1].strip()  # the Resource Names column, "[]" when any
        key = resource if names == "[" else f"{resource} {names}]"
        granted.setdefault(key, set()).update(verbs)
    return granted


# Exactly the verbs the operator calls (test_rbac_e2e checks them against an audit log).
NAMESPACED_GRANTS = {
    "pods": {"list", "watch"},
    "pods/status": {"patch"},  # the readiness gate's one condition
    "kvtopologies.kvtopo.dev": {"list", "watch"},
    "kvtopologies.kvtopo.dev/status": {"patch"},
    "events": {"create"},
}
# The Node watch (nodes.watch, on by default): cluster-scoped, read-only, seen from anywhere.
NODE_GRANTS = {"nodes": {"list", "watch"}}
# Leader election, in the release namespace: create any Lease, read and write only its own.
LEASE_GRANTS = {
    "leases.coordination.k8s.io": {"create"},
    "leases.coordination.k8s.io [kvt-kvtopo-operator]": {"get", "update"},
}


@pytest.fixture
def release(cluster: LocalCluster, helm: Helm) -> Iterator[tuple[str, str]]:
    """A fresh namespace for a release named "kvt" (helm uninstall and namespace deletion
    at the end, whatever the test did)."""
    namespace = create_namespace(cluster, "kvt-helm", wait_for_sa=True)
    try:
        yield "kvt", namespace
    finally:
        helm.run("uninstall", "kvt", "-n", namespace, "--wait", "--timeout=60s", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_install_grants_exactly_the_namespaced_permissions(
    cluster: LocalCluster, helm: Helm, release: tuple[str, str]
) -> None:
    name, ns = release
    other = create_namespace(cluster, "kvt-other", wait_for_sa=False)
    try:
        result = helm.run("install", name, str(CHART), "-n", ns, *values_args(KWOK_PLACEMENT))
        notes = result.stdout
        assert "NOTES:" in notes
        for hint in (
            f"only in: {ns}",
            f"kubectl -n {ns} rollout status deployment/kvt-kvtopo-operator",
            "kvtopo.dev/role: prefill",
            'ConfigMap "kvt-kvtopo-operator-key"',
            "kvtopo.dev/control-endpoint",
            "port 8975",
            "get kvt",
            "Helm never deletes CRDs",
        ):
            assert hint in notes, f"NOTES lack {hint!r}:\n{notes}"
        deploy = deployment_available(cluster, ns, "kvt-kvtopo-operator")
        assert deploy["spec"]["replicas"] == 2
        assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
        assert 'Lease "kvt-kvtopo-operator"' in notes

        sa = f"system:serviceaccount:{ns}:kvt-kvtopo"
        assert granted_resources(cluster, sa, ns) == NAMESPACED_GRANTS | LEASE_GRANTS | NODE_GRANTS
        assert granted_resources(cluster, sa, other) == NODE_GRANTS, "nothing in another namespace"
        n = ["-n", ns]
        for verb in ("list", "watch"):
            assert can_i(cluster, sa, verb, "pods", *n)
        for verb in ("list", "watch"):
            assert can_i(cluster, sa, verb, "kvtopologies.kvtopo.dev", *n)
        assert can_i(cluster, sa, "patch", "kvtopologies.kvtopo.dev", *n, subresource="status")
        assert can_i(cluster, sa, "patch", "pods", *n, subresource="status")
        assert can_i(cluster, sa, "create", "events", *n)
        assert can_i(cluster, sa, "create", "leases.coordination.k8s.io", *n)
        for verb in ("get", "update"):
            assert can_i(cluster, sa, verb, "leases.coordination.k8s.io/kvt-kvtopo-operator", *n)
            assert not can_i(cluster, sa, verb, "leases.coordination.k8s.io/someone-else", *n)
        # Denied: Secrets anywhere, single pod reads and pod writes, KVTopology writes but the
        # status patch, Event patches, nodes, anything in another namespace or cluster-wide.
        denied = [
            ("get", "secrets", *n),
            ("list", "secrets", *n),
            ("get", f"secret/{name}-kvtopo-operator-key", *n),
            ("list", "secrets", "-A"),
            ("create", "pods", *n),
            ("delete", "pods", *n),
            ("patch", "pods", *n),
            ("get", "pods", *n),
            ("patch", "kvtopologies.kvtopo.dev", *n),
            ("patch", "events", *n),
            ("create", "kvtopologies.kvtopo.dev", *n),
            ("delete", "kvtopologies.kvtopo.dev", *n),
            ("update", "kvtopologies.kvtopo.dev", *n),
            ("list", "pods", "-n", other),
            ("list", "kvtopologies.kvtopo.dev", "-n", other),
            ("create", "events", "-n", other),
            ("list", "pods", "-A"),
            ("list", "kvtopologies.kvtopo.dev", "-A"),
            ("get", "nodes"),
            ("patch", "nodes"),
            ("delete", "nodes"),
            ("list", "namespaces"),
            ("list", "customresourcedefinitions"),
            ("get", "configmaps", *n),
            ("list", "leases.coordination.k8s.io", *n),
            ("delete", "leases.coordination.k8s.io/kvt-kvtopo-operator", *n),
            ("patch", "leases.coordination.k8s.io/kvt-kvtopo-operator", *n),
            ("create", "leases.coordination.k8s.io", "-n", other),
            ("*", "*", *n),
        ]
        for verb, resource, *where in denied:
            assert not can_i(cluster, sa, verb, resource, *where), (verb, resource, *where)
        assert not can_i(cluster, sa, "create", "pods", *n, subresource="exec")
        assert not can_i(cluster, sa, "create", "serviceaccounts", *n, subresource="token")
        assert not can_i(
            cluster, sa, "update", "kvtopologies.kvtopo.dev", "-n", other, subresource="status"
        )
        for verb in ("get", "update"):
            assert not can_i(cluster, sa, verb, "kvtopologies.kvtopo.dev", *n, subresource="status")
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def public_key_id(config_map: dict[str, Any]) -> str:
    """The id of the public key a ConfigMap's certificate carries (a re-rendered certificate
    differs in its dates and serial, not in its key)."""
    from cryptography import x509

    from kvtopo_worker.signing import key_id

    cert = x509.load_pem_x509_certificate(config_map["data"]["operator.pem"].encode())
    return key_id(cert.public_key())  # type: ignore[arg-type]


def test_upgrade_and_uninstall(cluster: LocalCluster, helm: Helm, release: tuple[str, str]) -> None:
    name, ns = release
    fullname = f"{name}-kvtopo"
    helm.run("install", name, str(CHART), "-n", ns, *values_args(KWOK_PLACEMENT))
    before = deployment_available(cluster, ns, f"{fullname}-operator")
    secret = get_json(cluster, "secret", f"{fullname}-operator-key", "-n", ns)
    key = base64.b64decode(secret["data"]["operator.key"]).decode()
    assert "BEGIN EC PRIVATE KEY" in key
    public = get_json(cluster, "configmap", f"{fullname}-operator-key", "-n", ns)

    # Changed values: cluster scope, peering (so one replica, no leader election), a
    # different resync period and resources.
    changed = {
        **KWOK_PLACEMENT,
        "scope": "cluster",
        "peering": {"enabled": True},
        "leaderElection": {"enabled": False},
        "replicaCount": 1,
        "operator": {"resyncSeconds": 5},
        "resources": {"requests": {"cpu": "200m", "memory": "192Mi"}},
        "podAnnotations": {"example.com/upgraded": "yes"},
    }
    helm.run("upgrade", name, str(CHART), "-n", ns, *values_args(changed))
    after = deployment_available(cluster, ns, f"{fullname}-operator")
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    (c,) = after["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" in c["args"] and f"--peering={fullname}" in c["args"]
    assert "--leader-elect" not in c["args"]
    assert after["spec"]["replicas"] == 1 and after["spec"]["strategy"]["type"] == "Recreate"
    assert "--resync-seconds=5" in c["args"]
    assert c["resources"]["requests"] == {"cpu": "200m", "memory": "192Mi"}
    pods = get_json(cluster, "pods", "-n", ns, "-l", "app.kubernetes.io/instance=kvt")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert [p["metadata"]["annotations"]["example.com/upgraded"] for p in live] == ["yes"]
    # The key survives the upgrade (looked up, not regenerated), and the public key the
    # engines hold with it.
    secret = get_json(cluster, "secret", f"{fullname}-operator-key", "-n", ns)
    assert base64.b64decode(secret["data"]["operator.key"]).decode() == key
    again = get_json(cluster, "configmap", f"{fullname}-operator-key", "-n", ns)
    assert public_key_id(again) == public_key_id(public)
    # The Role became a ClusterRole; the peering object exists.
    assert not get_json(cluster, "roles", "-n", ns)["items"]
    get_json(cluster, "clusterrole", f"{fullname}-operator")
    get_json(cluster, "clusterkopfpeering", fullname)

    sa = f"system:serviceaccount:{ns}:{fullname}"
    for verb in ("list", "watch"):
        assert can_i(cluster, sa, verb, "pods", "-A")
        assert can_i(cluster, sa, verb, "kvtopologies.kvtopo.dev", "-A")
        assert can_i(cluster, sa, verb, "clusterkopfpeerings.kopf.dev")
    assert can_i(cluster, sa, "patch", f"clusterkopfpeerings.kopf.dev/{fullname}")
    assert not can_i(cluster, sa, "patch", "clusterkopfpeerings.kopf.dev/someone-else")
    assert can_i(cluster, sa, "patch", "kvtopologies.kvtopo.dev", "-A", subresource="status")
    assert not can_i(cluster, sa, "get", "kvtopologies.kvtopo.dev", "-A")
    assert can_i(cluster, sa, "create", "events", "-A")
    assert not can_i(cluster, sa, "patch", "kvtopologies.kvtopo.dev", "-A")
    assert not can_i(cluster, sa, "patch", "events", "-A")
    assert not can_i(cluster, sa, "get", "pods", "-A")
    assert not can_i(cluster, sa, "list", "secrets", "-A")
    assert not can_i(cluster, sa, "get", "secrets", "-n", ns)
    assert not can_i(cluster, sa, "create", "pods", "-A")
    assert can_i(cluster, sa, "list", "nodes")  # the Node watch (nodes.watch)
    assert not can_i(cluster, sa, "get", "nodes")
    assert not can_i(cluster, sa, "patch", "nodes")
    assert "revision: 2" in helm.run("status", name, "-n", ns).stdout.lower()

    selector = f"app.kubernetes.io/instance={name}"

    def leftovers() -> list[str]:
        items = get_json(cluster, NAMESPACED_KINDS, "-n", ns, "-l", selector)["items"]
        items += get_json(cluster, CLUSTER_KINDS, "-l", selector)["items"]
        items += [
            s
            for s in get_json(cluster, "secrets", "-n", ns)["items"]
            if s["metadata"]["name"].startswith(f"sh.helm.release.v1.{name}.")
        ]
        return sorted(f"{i['kind']}/{i['metadata']['name']}" for i in items)

    # The check sees what the release made (so an empty answer later means something).
    present = leftovers()
    for kind in ("Deployment", "Pod", "Secret", "ClusterRole", "ClusterKopfPeering", "Service"):
        assert any(item.startswith(f"{kind}/") for item in present), (kind, present)

    # Uninstall: nothing of the release is left but the CRD (Helm never deletes CRDs).
    helm.run("uninstall", name, "-n", ns, "--wait", "--timeout=60s")
    wait_until(
        lambda: not leftovers(),
        60,
        "every object of the release gone",
        interval_s=0.25,
        describe_last=lambda: f"left: {leftovers()}",
    )
    crd = get_json(cluster, "crd", "kvtopologies.kvtopo.dev")
    assert crd["metadata"]["name"] == "kvtopologies.kvtopo.dev"
    assert helm.run("status", name, "-n", ns, check=False).returncode != 0
