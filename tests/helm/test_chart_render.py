"""The kvtopo Helm chart without a cluster: lint, rendering and values validation.

Covers `helm lint` (default values and a values file that sets every option), the chart's
CRD being the checked-in `crds/kvtopology.yaml`, what the templates render for each option
(least-privilege RBAC in both scopes, the leader-election Role on one Lease, the hardened
operator Deployment of two replicas with leader election (or one, Recreate, without) whose
arguments the real `kvtopo-operator` parser accepts, the operator key pair, the engines'
NetworkPolicy, the operator's NetworkPolicy that admits /metrics only from the monitoring
namespace, metrics and peering objects), and that bad values are refused with a message
naming the offending value (values.schema.json, plus template checks for rules that span
several values).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo_operator.main import parse_args
from tests.helm.chart import (
    CHART,
    FULL_VALUES,
    KUBE_VERSION,
    ROOT,
    Helm,
    container,
    objects,
    one,
    render,
    rules_set,
    values_args,
)

# These run the helm binary from the control-plane toolchain (`make toolchain`), as the
# `cluster` marker says; they start no cluster.
pytestmark = pytest.mark.cluster

# Exactly the verbs the operator calls (tests/helm/test_rbac_e2e.py checks them against the
# API server's audit log of a real run).
OPERATOR_RULES = {
    ("", "pods", "*", "list"),
    ("", "pods", "*", "watch"),
    ("", "pods/status", "*", "patch"),
    ("kvtopo.dev", "kvtopologies", "*", "list"),
    ("kvtopo.dev", "kvtopologies", "*", "watch"),
    ("kvtopo.dev", "kvtopologies/status", "*", "patch"),
    ("", "events", "*", "create"),
}


def lease_rules(name: str) -> set[tuple[str, str, str, str]]:
    """create any Lease (RBAC cannot limit create by name); get/update only the one."""
    return {
        ("coordination.k8s.io", "leases", "*", "create"),
        ("coordination.k8s.io", "leases", name, "get"),
        ("coordination.k8s.io", "leases", name, "update"),
    }


NO_LEADER_ELECTION = {"leaderElection": {"enabled": False}, "replicaCount": 1}


def peering_rules(resource: str, name: str) -> set[tuple[str, str, str, str]]:
    return {
        ("kopf.dev", resource, "*", "list"),
        ("kopf.dev", resource, "*", "watch"),
        ("kopf.dev", resource, name, "get"),
        ("kopf.dev", resource, name, "patch"),
    }


def worker_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The one engines' NetworkPolicy (`<full>-worker-control`) of a single-namespace render."""
    found = [d for d in policies(docs) if d["metadata"]["name"].endswith("-worker-control")]
    assert len(found) == 1, [d["metadata"]["name"] for d in policies(docs)]
    return found[0]


def operator_policy(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The operator pods' NetworkPolicy (`<full>-operator`), None when not rendered."""
    found = [d for d in policies(docs) if d["metadata"]["name"].endswith("-operator")]
    assert len(found) <= 1
    return found[0] if found else None


def policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return objects(docs, "NetworkPolicy")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def default_docs(helm: Helm) -> list[dict[str, Any]]:
    return render(helm, namespace="llm")


@pytest.fixture(scope="module")
def full_docs(helm: Helm) -> list[dict[str, Any]]:
    return render(helm, None, FULL_VALUES, release="r", namespace="ops")


# --- lint and the CRD ----------------------------------------------------------------------


@pytest.mark.parametrize("files", [(), (FULL_VALUES,)], ids=["default", "full"])
def test_helm_lint_is_clean(helm: Helm, files: tuple[Path, ...]) -> None:
    result = helm.run(
        "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, *values_args(None, *files)
    )
    out = result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_chart_crd_is_the_checked_in_crd() -> None:
    chart_crd = CHART / "crds" / "kvtopology.yaml"
    checked_in = ROOT / "crds" / "kvtopology.yaml"
    assert chart_crd.read_bytes() == checked_in.read_bytes(), (
        "helm/kvtopo/crds/kvtopology.yaml differs from crds/kvtopology.yaml; "
        "regenerate both: make crds"
    )
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["kvtopology.yaml"]


def test_crds_are_rendered_only_with_include_crds(helm: Helm) -> None:
    assert not objects(render(helm), "CustomResourceDefinition")
    text = helm.run(
        "template", "kvtopo", str(CHART), "--include-crds", "--kube-version", KUBE_VERSION
    ).stdout
    crds = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "CustomResourceDefinition"]
    assert [c["metadata"]["name"] for c in crds] == ["kvtopologies.kvtopo.dev"]


# --- what the defaults render ---------------------------------------------------------------


def test_default_objects(default_docs: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in default_docs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
            "NetworkPolicy",
            "NetworkPolicy",
            "Secret",
            "ConfigMap",
            "Lease",
            "ClusterRole",  # the Node watch's, read-only (nodes.watch)
            "ClusterRoleBinding",
        ]
    )
    namespaced = [d for d in default_docs if not d["kind"].startswith("Cluster")]
    assert {d["metadata"]["namespace"] for d in namespaced} == {"llm"}
    for d in default_docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "kvtopo"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    # The names the examples and docs use for release "kvtopo".
    assert {s["metadata"]["name"] for s in objects(default_docs, "Secret")} == {
        "kvtopo-operator-key"
    }
    assert {c["metadata"]["name"] for c in objects(default_docs, "ConfigMap")} == {
        "kvtopo-operator-key"
    }
    assert one(default_docs, "Deployment")["metadata"]["name"] == "kvtopo-operator"


def test_examples_use_the_default_public_key_and_control_port(
    default_docs: list[dict[str, Any]],
) -> None:
    [public] = objects(default_docs, "ConfigMap")
    policy = worker_policy(default_docs)
    port = policy["spec"]["ingress"][0]["ports"][0]["port"]
    for name in ("prefill-deployment.yaml", "decode-deployment.yaml"):
        pod = yaml.safe_load((ROOT / "examples" / name).read_text())["spec"]["template"]["spec"]
        assert not [v for v in pod["volumes"] if "secret" in v], f"{name}: engines hold no Secret"
        maps = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
        assert maps == [public["metadata"]["name"]], name
        ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
        assert ports["kvtopo-control"] == port, name


def test_deployment_is_hardened_with_a_hot_standby(default_docs: list[dict[str, Any]]) -> None:
    deploy = one(default_docs, "Deployment")
    spec = deploy["spec"]
    # Two replicas, one acting (leader election); a rollout never leaves none ready.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(default_docs, "ServiceAccount")["metadata"]["name"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(default_docs)
    assert c["image"] == "ghcr.io/kvtopo/operator:0.1.0"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # The probes hit the port kopf's liveness endpoint listens on.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    liveness = next(a for a in c["args"] if a.startswith("--liveness="))
    assert liveness == f"--liveness=http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    # The metrics Service reaches the metrics port the operator binds.
    assert f"--metrics-port={ports['metrics']}" in c["args"]
    assert "--metrics-host=0.0.0.0" in c["args"]
    service = one(default_docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"].items() <= pod_labels(deploy).items()
    # The key file the operator reads is the mounted Secret's key.
    key_arg = next(a for a in c["args"] if a.startswith("--worker-key-file="))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "operator-key")
    assert mount["readOnly"] is True
    assert key_arg == f"--worker-key-file={mount['mountPath']}/operator.key"
    volume = next(v for v in pod["volumes"] if v["name"] == "operator-key")
    assert (
        volume["secret"]["secretName"]
        == named(default_docs, "Secret", "kvtopo-operator-key")["metadata"]["name"]
    )
    # A read-only root filesystem still needs a writable /tmp.
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
    # Leader election on the release namespace's Lease, the pod's name and namespace from
    # the downward API.
    args = parse_args(c["args"])
    assert args.leader_elect and args.peering is None
    assert (args.leader_elect_namespace, args.leader_elect_lease_name) == ("llm", "kvtopo-operator")
    assert (
        args.leader_elect_lease_seconds,
        args.leader_elect_renew_seconds,
        args.leader_elect_retry_seconds,
    ) == (15, 10.0, 2.0)
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"


def pod_labels(deploy: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deploy["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "scope": "cluster",
            "peering": {"enabled": True},
            "metrics": {"enabled": False},
            **NO_LEADER_ELECTION,
        },
        {"engineNamespaces": ["a", "b"], "operator": {"verbose": True}},
    ],
    ids=["default", "cluster-peering-no-metrics", "two-namespaces"],
)
def test_operator_accepts_the_rendered_arguments(helm: Helm, values: dict[str, Any]) -> None:
    c = container(render(helm, values))
    assert c["command"] == ["kvtopo-operator"]
    args = parse_args(c["args"])
    if values.get("scope") == "cluster":
        assert args.all_namespaces and not args.namespace
        assert args.peering == "kvtopo" and args.metrics_port == 0
        assert not args.leader_elect
    else:
        assert args.namespace == values.get("engineNamespaces", ["kvtopo-system"])
        assert args.peering is None and args.metrics_port == 8080
        # The Lease is in the release namespace, not the first engine namespace.
        assert args.leader_elect and args.leader_elect_namespace == "kvtopo-system"
    assert args.verbose == bool(values.get("operator", {}).get("verbose"))
    assert str(args.worker_key_file) == "/var/run/kvtopo/operator.key"
    assert args.resync_seconds == 2.0 and args.state_reads_per_second == 100.0


def test_the_full_values_render_every_option(full_docs: list[dict[str, Any]]) -> None:
    deploy = one(full_docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = container(full_docs)
    assert c["image"] == (
        "registry.example.com/kvtopo/operator@sha256:"
        "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    assert c["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "kvt-operator-sa"
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["nodeSelector"] == {"type": "kwok"}
    assert pod["tolerations"][0]["key"] == "kwok.x-k8s.io/node"
    assert "nodeAffinity" in pod["affinity"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        10001,
        10001,
    )
    assert deploy["spec"]["template"]["metadata"]["annotations"] == {"example.com/scrape": "false"}
    assert pod_labels(deploy)["tier"] == "control"
    assert all(d["metadata"]["labels"]["team"] == "inference" for d in full_docs)
    assert c["resources"]["limits"] == {"cpu": "1", "memory": "256Mi"}
    assert {"name": "KVTOPO_EXTRA", "value": "1"} in c["env"]
    args = parse_args(c["args"])
    assert args.namespace == ["llm-a", "llm-b"]
    assert args.peering == "kvt-peering" and args.verbose and args.resync_seconds == 5
    assert args.state_reads_per_second == 40
    # Peering instead of leader election: one replica, Recreate, no Lease and no grant on one.
    assert not args.leader_elect
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert all(
        r["metadata"]["name"] != "kvt-full-leader-election" for r in objects(full_docs, "Role")
    )
    assert str(args.worker_key_file) == "/var/run/kvtopo/signing.key"
    assert (args.metrics_port, c["ports"][1]["containerPort"]) == (9090, 9091)
    sm = one(full_docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0] == {
        "port": "metrics",
        "path": "/metrics",
        "interval": "15s",
        "scrapeTimeout": "5s",
    }
    service = one(full_docs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    sa = one(full_docs, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"example.com/owner": "inference"}
    assert {p["metadata"]["namespace"] for p in objects(full_docs, "KopfPeering")} == {
        "llm-a",
        "llm-b",
    }
    metrics_policy = operator_policy(full_docs)
    assert metrics_policy is not None
    assert metrics_policy["spec"]["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "observability"}
                    },
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            "ports": [{"protocol": "TCP", "port": 9090}],
        },
        {"ports": [{"protocol": "TCP", "port": 9091}]},
    ]
    workers = [p for p in policies(full_docs) if p is not metrics_policy]
    assert {p["metadata"]["namespace"] for p in workers} == {"llm-a", "llm-b"}
    for policy in workers:
        ingress = policy["spec"]["ingress"]
        assert len(ingress) == 1  # allowOtherPorts: false
        assert ingress[0]["ports"] == [
            {"protocol": "TCP", "port": 9000},
            {"protocol": "TCP", "port": 9001},
        ]
        assert {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        } in (ingress[0]["from"])


def leaf_paths(tree: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every key of the chart's values (free-form maps count as leaves)."""
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= leaf_paths(value, path + ".")
        else:
            out.add(path)
    return out


def test_the_full_values_file_sets_every_option() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    full = yaml.safe_load(FULL_VALUES.read_text())
    missing = {p for p in leaf_paths(defaults) if not _has_path(full, p.split("."))}
    assert not missing, f"{FULL_VALUES.name} does not set: {sorted(missing)}"
    # It turns the optional objects on, so the server-side dry run covers their templates.
    assert full["engineNamespaces"] and full["peering"]["enabled"] is True
    assert full["metrics"]["serviceMonitor"]["enabled"] is True
    assert full["networkPolicy"]["enabled"] is True and full["rbac"]["create"] is True


def _has_path(tree: Any, keys: list[str]) -> bool:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


# --- RBAC ------------------------------------------------------------------------------------


def test_namespace_scope_grants_roles_only_in_engine_namespaces(helm: Helm) -> None:
    docs = render(helm, {"engineNamespaces": ["llm-a", "llm-b"]}, namespace="ops")
    # Cluster-wide only the Node watch's read of nodes (`test_the_node_watch_reads_nodes_only`).
    assert [r["metadata"]["name"] for r in objects(docs, "ClusterRole")] == ["ops-kvtopo-nodes"]
    roles = [r for r in objects(docs, "Role") if r["metadata"]["name"] == "kvtopo-operator"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm-a", "llm-b"]
    for role in roles:
        assert rules_set(role["rules"]) == OPERATOR_RULES
    bindings = [
        b for b in objects(docs, "RoleBinding") if b["metadata"]["name"] == "kvtopo-operator"
    ]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "kvtopo-operator",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kvtopo", "namespace": "ops"}
        ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm-a", "llm-b"]
    # The only other grant: the Lease, in the release namespace.
    others = [r for r in objects(docs, "Role") if r not in roles]
    assert [(r["metadata"]["name"], r["metadata"]["namespace"]) for r in others] == [
        ("kvtopo-leader-election", "ops")
    ]
    assert rules_set(others[0]["rules"]) == lease_rules("kvtopo-operator")


def test_the_node_watch_reads_nodes_only_and_can_be_turned_off(helm: Helm) -> None:
    for scope in ("namespace", "cluster"):
        docs = render(helm, {"scope": scope})
        role = next(
            r for r in objects(docs, "ClusterRole") if r["metadata"]["name"].endswith("-nodes")
        )
        assert rules_set(role["rules"]) == {("", "nodes", "*", v) for v in ("list", "watch")}
        binding = next(
            b
            for b in objects(docs, "ClusterRoleBinding")
            if b["roleRef"]["name"] == role["metadata"]["name"]
        )
        assert binding["subjects"][0]["name"] == "kvtopo"
        assert "--watch-nodes" in container(docs)["args"]
    # Cluster-scoped names carry the release namespace: one release name in two namespaces
    # (a drill's and a user's) do not collide.
    names = {
        ns: {
            o["metadata"]["name"]
            for o in render(helm, {}, namespace=ns)
            if o and o["kind"].startswith("Cluster")
        }
        for ns in ("kvtopo-system", "kvtopo-drill")
    }
    assert names["kvtopo-system"] and not names["kvtopo-system"] & names["kvtopo-drill"]
    off = render(helm, {"nodes": {"watch": False}})
    assert not objects(off, "ClusterRole") and "--watch-nodes" not in container(off)["args"]


def test_cluster_scope_grants_one_cluster_role(helm: Helm) -> None:
    docs = render(helm, {"scope": "cluster", "nodes": {"watch": False}})
    # No namespaced grants but the Lease's, in the release namespace.
    lease_role = one(docs, "Role")
    assert lease_role["metadata"]["name"] == "kvtopo-leader-election"
    assert lease_role["metadata"]["namespace"] == "kvtopo-system"
    assert rules_set(lease_role["rules"]) == lease_rules("kvtopo-operator")
    assert one(docs, "RoleBinding")["roleRef"]["name"] == "kvtopo-leader-election"
    role = one(docs, "ClusterRole")
    assert rules_set(role["rules"]) == OPERATOR_RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvtopo", "namespace": "kvtopo-system"}
    ]
    assert "--all-namespaces" in container(docs)["args"]


WRITES = {
    ("kvtopologies/status", "patch"),
    ("pods/status", "patch"),
    ("leases", "update"),
    ("kopfpeerings", "patch"),
    ("clusterkopfpeerings", "patch"),
}


def test_no_rule_reaches_secrets_nodes_or_writes_pods_but_the_gate(helm: Helm) -> None:
    for values in ({}, {"scope": "cluster", "peering": {"enabled": True}, **NO_LEADER_ELECTION}):
        docs = render(helm, values)
        for role in objects(docs, "Role") + objects(docs, "ClusterRole"):
            for group, resource, _, verb in rules_set(role["rules"]):
                assert "*" not in (group, resource, verb), role["rules"]
                assert resource not in ("secrets", "configmaps", "serviceaccounts")
                if resource == "nodes":  # the Node watch's own role: read only
                    assert role["metadata"]["name"].endswith("-nodes") and verb in (
                        "get",
                        "list",
                        "watch",
                    )
                if resource == "pods":
                    assert verb in ("list", "watch")
                # Writes of existing objects: the status, the Lease and kopf's peering only.
                if verb in ("patch", "update"):
                    assert (resource, verb) in WRITES, role["rules"]


@pytest.mark.parametrize("scope", ["namespace", "cluster"])
def test_peering_objects_and_rules(helm: Helm, scope: str) -> None:
    docs = render(
        helm,
        {
            "scope": scope,
            "peering": {"enabled": True, "name": "guard"},
            "nodes": {"watch": False},
            **NO_LEADER_ELECTION,
        },
    )
    assert "--peering=guard" in container(docs)["args"]
    if scope == "cluster":
        peering = one(docs, "ClusterKopfPeering")
        rules = rules_set(one(docs, "ClusterRole")["rules"])
        expected = OPERATOR_RULES | peering_rules("clusterkopfpeerings", "guard")
        assert "namespace" not in peering["metadata"]
    else:
        peering = one(docs, "KopfPeering")
        rules = rules_set(one(docs, "Role")["rules"])
        expected = OPERATOR_RULES | peering_rules("kopfpeerings", "guard")
        assert peering["metadata"]["namespace"] == "kvtopo-system"
    assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "guard"
    assert rules == expected


def test_leader_election_grants_one_lease_and_binds_it_to_the_operator(helm: Helm) -> None:
    docs = render(
        helm,
        {
            "leaderElection": {"leaseName": "kvt-lock", "leaseSeconds": 30},
            "replicaCount": 3,
            "serviceAccount": {"name": "op-sa"},
        },
        namespace="ops",
    )
    role = next(r for r in objects(docs, "Role") if r["metadata"]["name"].endswith("-election"))
    assert role["metadata"]["namespace"] == "ops"
    assert rules_set(role["rules"]) == lease_rules("kvt-lock")
    binding = next(
        b for b in objects(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    )
    assert binding["metadata"]["namespace"] == "ops"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "op-sa", "namespace": "ops"}]
    assert one(docs, "Deployment")["spec"]["replicas"] == 3
    args = parse_args(container(docs)["args"])
    assert (args.leader_elect_lease_name, args.leader_elect_lease_seconds) == ("kvt-lock", 30)
    assert args.leader_elect_namespace == "ops"
    # The release owns the Lease (empty: the replicas write its spec), so uninstall deletes it.
    lease = one(docs, "Lease")
    assert (lease["metadata"]["name"], lease["metadata"]["namespace"]) == ("kvt-lock", "ops")
    assert "spec" not in lease


def test_without_leader_election_one_replica_is_recreated(helm: Helm) -> None:
    docs = render(helm, NO_LEADER_ELECTION)
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert not parse_args(container(docs)["args"]).leader_elect
    assert [r["metadata"]["name"] for r in objects(docs, "Role")] == ["kvtopo-operator"]
    for role in objects(docs, "Role"):
        assert not any(g == "coordination.k8s.io" for g, *_ in rules_set(role["rules"]))
    assert objects(docs, "Lease") == []


def test_rbac_and_service_account_can_be_left_to_the_user(helm: Helm) -> None:
    docs = render(
        helm, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops-sa"}}
    )
    kinds = {d["kind"] for d in docs}
    assert not kinds & {
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
    }
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-sa"


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in objects(docs, kind) if d["metadata"]["name"] == name]
    return found


# --- the operator's key pair --------------------------------------------------------------------


def test_the_key_pair_is_generated_the_private_half_only_where_the_operator_is(
    helm: Helm, tmp_path: Path
) -> None:
    from kvtopo_worker.signing import key_id, load_private_keys, load_public_keys

    docs = render(helm, {"engineNamespaces": ["llm-a", "llm-b"]}, namespace="ops")
    [secret] = objects(docs, "Secret")
    maps = objects(docs, "ConfigMap")
    # The private key in the release namespace only; the public key where engines are.
    assert secret["metadata"]["namespace"] == "ops"
    assert sorted(m["metadata"]["namespace"] for m in maps) == ["llm-a", "llm-b"]
    key_file = tmp_path / "operator.key"
    key_file.write_bytes(base64.b64decode(secret["data"]["operator.key"]))
    [private] = load_private_keys(key_file)
    for m in maps:
        assert "PRIVATE" not in m["data"]["operator.pem"]
        pem = tmp_path / f"{m['metadata']['namespace']}.pem"
        pem.write_text(m["data"]["operator.pem"])
        [public] = load_public_keys(pem)
        assert key_id(public) == key_id(private.public_key()), "the ConfigMap is the key's"
    # No cluster to look the Secret up in: `helm template` shows a fresh key every time
    # (documented); installs and upgrades keep the first one (tests/helm/test_chart_cluster).
    again = objects(render(helm, {"engineNamespaces": ["llm-a"]}, namespace="ops"), "Secret")
    assert again[0]["data"]["operator.key"] != secret["data"]["operator.key"]


def test_an_existing_key_pair_is_mounted_not_created(helm: Helm) -> None:
    docs = render(
        helm,
        {
            "operatorKey": {
                "existingSecret": "my-key",
                "existingConfigMap": "my-public-key",
                "key": "k",
            },
        },
    )
    assert not objects(docs, "Secret") and not objects(docs, "ConfigMap")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "operator-key")
    assert volume["secret"]["secretName"] == "my-key"
    assert volume["secret"]["items"] == [{"key": "k", "path": "k"}]
    assert "--worker-key-file=/var/run/kvtopo/k" in container(docs)["args"]


def test_an_existing_secret_without_its_configmap_is_refused(helm: Helm) -> None:
    result = helm.run(
        "template",
        "kvtopo",
        str(CHART),
        "--kube-version",
        "1.36.0",
        "--set",
        "operatorKey.existingSecret=my-key",
        check=False,
    )
    assert result.returncode != 0 and "go together" in result.stderr, result.stderr


# --- the NetworkPolicy -------------------------------------------------------------------------


def test_network_policy_guards_only_the_control_port(default_docs: list[dict[str, Any]]) -> None:
    policy = worker_policy(default_docs)["spec"]
    engines = {
        "matchExpressions": [
            {"key": "kvtopo.dev/role", "operator": "In", "values": ["prefill", "decode"]}
        ]
    }
    assert policy["podSelector"] == engines
    assert policy["policyTypes"] == ["Ingress"]
    control, others = policy["ingress"]
    selector = one(default_docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert control["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}},
            "podSelector": {"matchLabels": selector},
        },
        {"podSelector": engines},
    ]
    assert control["ports"] == [{"protocol": "TCP", "port": 8975}]
    assert "from" not in others
    assert others["ports"] == [
        {"protocol": "TCP", "port": 1, "endPort": 8974},
        {"protocol": "TCP", "port": 8976, "endPort": 65535},
        {"protocol": "UDP"},
        {"protocol": "SCTP"},
    ]


@pytest.mark.parametrize(
    ("port", "tcp_ranges"),
    [
        (1, [(2, 65535)]),
        (2, [(1, None), (3, 65535)]),
        (65534, [(1, 65533), (65535, None)]),
        (65535, [(1, 65534)]),
    ],
)
def test_network_policy_port_ranges_at_the_edges(
    helm: Helm, port: int, tcp_ranges: list[tuple[int, int | None]]
) -> None:
    policy = worker_policy(render(helm, {"workers": {"controlPort": port}}))["spec"]
    tcp = [p for p in policy["ingress"][1]["ports"] if p["protocol"] == "TCP"]
    assert [(p["port"], p.get("endPort")) for p in tcp] == tcp_ranges


def test_network_policy_can_be_turned_off(helm: Helm) -> None:
    docs = render(helm, {"networkPolicy": {"enabled": False}})
    # Only the engines' policy goes; the operator's own is metrics.networkPolicy's.
    assert [p["metadata"]["name"] for p in policies(docs)] == ["kvtopo-operator"]
    docs = render(
        helm,
        {"networkPolicy": {"enabled": False}, "metrics": {"networkPolicy": {"enabled": False}}},
    )
    assert not policies(docs)


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_off_means_no_service_and_no_port(helm: Helm) -> None:
    docs = render(helm, {"metrics": {"enabled": False}})
    assert not objects(docs, "Service") and not objects(docs, "ServiceMonitor")
    c = container(docs)
    assert "--metrics-port=0" in c["args"]
    assert [p["name"] for p in c["ports"]] == ["health"]
    # The operator pods' policy stays, admitting the health port alone.
    policy = operator_policy(docs)
    assert policy is not None
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8081}]}]


def test_metrics_port_admits_only_the_monitoring_namespace(
    default_docs: list[dict[str, Any]],
) -> None:
    """/metrics has no authentication: the operator pods admit the metrics port only from the
    namespace "monitoring", the health port (kubelet probes) from anyone, nothing else."""
    policy = operator_policy(default_docs)
    assert policy is not None
    assert policy["metadata"]["namespace"] == "llm"
    assert policy["metadata"]["name"] == "kvtopo-operator"
    spec = policy["spec"]
    deploy = one(default_docs, "Deployment")
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert spec["podSelector"] == {"matchLabels": selector}
    assert selector.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"], "egress (API server, workers) is not restricted"
    metrics, health = spec["ingress"]
    assert metrics == {
        "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    assert health == {"ports": [{"protocol": "TCP", "port": 8081}]}
    # The ports the policy names are the container's: the metrics Service's target and the
    # probes' port.
    ports = {p["name"]: p["containerPort"] for p in container(default_docs)["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    service = one(default_docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"] == selector


def test_metrics_sources_and_ports_follow_the_values(helm: Helm) -> None:
    prometheus = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    scraper = {"ipBlock": {"cidr": "10.1.0.0/16"}}
    docs = render(
        helm,
        {
            "metrics": {"port": 9100, "networkPolicy": {"from": [prometheus, scraper]}},
            "health": {"port": 9101},
        },
        release="obs",
        namespace="ops",
    )
    policy = operator_policy(docs)
    assert policy is not None and policy["metadata"]["name"] == "obs-kvtopo-operator"
    assert policy["spec"]["ingress"] == [
        {"from": [prometheus, scraper], "ports": [{"protocol": "TCP", "port": 9100}]},
        {"ports": [{"protocol": "TCP", "port": 9101}]},
    ]
    assert operator_policy(render(helm, {"metrics": {"networkPolicy": {"enabled": False}}})) is None


# --- bad values ---------------------------------------------------------------------------

BAD_VALUES = [
    ({"scope": "everything"}, "at '/scope': value must be one of 'namespace', 'cluster'"),
    (
        {"engineNamespaces": ["Bad_NS"]},
        "at '/engineNamespaces/0': 'Bad_NS' does not match pattern",
    ),
    ({"engineNamespaces": ["a", "a"]}, "at '/engineNamespaces'"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    (
        {"image": {"pullPolicy": "Sometimes"}},
        "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    ({"image": {"repository": ""}}, "at '/image/repository'"),
    ({"image": {"digest": "latest"}}, "at '/image/digest': 'latest' does not match pattern"),
    ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum: got 70,000, want 65,535"),
    ({"workers": {"controlPort": "8975"}}, "at '/workers/controlPort': got string, want integer"),
    ({"securityContext": {"runAsUser": 0}}, "at '/securityContext/runAsUser': minimum: got 0"),
    (
        {"securityContext": {"privileged": True}},
        "at '/securityContext': additional properties 'privileged' not allowed",
    ),
    ({"operator": {"resyncSeconds": 0}}, "at '/operator/resyncSeconds': minimum: got 0"),
    ({"replicaCount": 0}, "at '/replicaCount': minimum: got 0, want 1"),
    ({"leaderElection": {"leaseSeconds": 0}}, "at '/leaderElection/leaseSeconds': minimum"),
    ({"leaderElection": {"retryPeriodSeconds": 0}}, "at '/leaderElection/retryPeriodSeconds'"),
    ({"leaderElection": {"leaseName": "Bad Name"}}, "at '/leaderElection/leaseName'"),
    ({"operator": {"extraArgs": ["-v"]}}, "at '/operator/extraArgs/0'"),
    ({"operatorKey": {"key": "a/b"}}, "at '/operatorKey/key'"),
    ({"operatorKey": {"existingSecret": "Not A Name"}}, "at '/operatorKey/existingSecret'"),
    ({"workerToken": {"key": "token"}}, "additional properties 'workerToken' not allowed"),
    (
        {"metrics": {"serviceMonitor": {"interval": "soon"}}},
        "at '/metrics/serviceMonitor/interval'",
    ),
    ({"podLabels": {"app.kubernetes.io/name": "x"}}, "at '/podLabels/app.kubernetes.io~1name'"),
    ({"resources": {"limits": {"memory": "lots"}}}, "at '/resources/limits/memory'"),
    (
        {"networkPolicy": {"extraControlPortFrom": [{}]}},
        "at '/networkPolicy/extraControlPortFrom/0'",
    ),
    (
        {"metrics": {"networkPolicy": {"from": []}}},
        "at '/metrics/networkPolicy/from': minItems: got 0, want 1",
    ),
    ({"metrics": {"networkPolicy": {"from": [{}]}}}, "at '/metrics/networkPolicy/from/0'"),
    (
        {"metrics": {"networkPolicy": {"from": [{"namespace": "monitoring"}]}}},
        "at '/metrics/networkPolicy/from/0': additional properties 'namespace' not allowed",
    ),
    (
        {"metrics": {"networkPolicy": {"open": True}}},
        "at '/metrics/networkPolicy': additional properties 'open' not allowed",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_schema_refuses_bad_values(helm: Helm, values: dict[str, Any], message: str) -> None:
    result = helm.run(
        "template",
        "kvtopo",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *values_args(values),
        check=False,
    )
    assert result.returncode != 0, f"{values} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


CROSS_FIELD = [
    (
        {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
        "metrics.serviceMonitor.enabled=true needs metrics.enabled=true",
    ),
    ({"health": {"port": 8080}}, "metrics.port and health.port must differ (both are 8080)"),
    (
        {"serviceAccount": {"create": False}},
        "serviceAccount.create=false needs serviceAccount.name",
    ),
    (
        {"leaderElection": {"enabled": False}},
        "replicaCount=2 needs leaderElection.enabled=true",
    ),
    (
        {"peering": {"enabled": True}},
        "peering.enabled=true needs leaderElection.enabled=false and replicaCount=1",
    ),
    (
        {"leaderElection": {"leaseSeconds": 10}},
        "leaderElection.renewDeadlineSeconds (10) must be below leaderElection.leaseSeconds (10)",
    ),
    (
        {"leaderElection": {"retryPeriodSeconds": 10}},
        "leaderElection.retryPeriodSeconds (10) must be below "
        "leaderElection.renewDeadlineSeconds (10)",
    ),
    (
        # null removes the default list, which the schema cannot see: no rule may admit all.
        {"metrics": {"networkPolicy": {"from": None}}},
        "metrics.networkPolicy.from needs at least one NetworkPolicyPeer",
    ),
]


@pytest.mark.parametrize(("values", "message"), CROSS_FIELD, ids=[m for _, m in CROSS_FIELD])
def test_rules_across_values_are_refused_by_the_templates(
    helm: Helm, values: dict[str, Any], message: str
) -> None:
    result = helm.run(
        "template",
        "kvtopo",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *values_args(values),
        check=False,
    )
    assert result.returncode != 0, f"{values} was accepted"
    assert message in result.stderr, result.stderr


def test_too_old_kubernetes_is_refused(helm: Helm) -> None:
    result = helm.run("template", "kvtopo", str(CHART), "--kube-version", "1.27.0", check=False)
    assert result.returncode != 0
    assert "chart requires kubeVersion: >=1.29.0-0" in result.stderr


def test_install_doc_covers_every_option_and_the_opt_in_contract() -> None:
    doc = (ROOT / "docs" / "install.md").read_text()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = [key for key in defaults if f"`{key}" not in doc]
    assert not undocumented, f"docs/install.md does not describe: {undocumented}"
    for contract in (
        "kvtopo.dev/role: prefill",
        "kvtopo.dev/control-endpoint",
        "kvtopo-control",
        "--operator-key-file",
        "## Upgrade",
        "## Uninstall",
        "kubectl delete crd kvtopologies.kvtopo.dev",
        "--kube-version",
    ):
        assert contract in doc, contract
