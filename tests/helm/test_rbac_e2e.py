"""RBAC proven both ways, not assumed: the chart grants exactly the verbs the operator uses.

On the tier-a API server (`--authorization-mode=Node,RBAC`) the chart is installed with its
default values (namespace scope, leader election). A token for the chart's ServiceAccount is
minted through the TokenRequest API (`kubectl create token`), and `kvtopo-operator` runs as a
local process with a kubeconfig holding only that token and exactly the arguments of the
chart's Deployment (`--leader-elect` included; local paths and loopback ports swapped in),
signing with the private key of the chart's generated Secret, and its workers verifying
with the public key of the chart's ConfigMap.

Every verb used is granted: the operator creates the Lease again (the release's, deleted)
and renews it, two engine pods backed by real `kvtopo-worker` processes get connected
(Ready=True, pairs 1/1), and deleting one is evicted and reported by an Event the operator
creates, with no refusal in its log nor in the API server's audit log. Every verb granted is
used: the (resource, verb) pairs of the requests the ServiceAccount made over the operator's
whole life, read from tier a's audit log (which records ServiceAccounts' requests), equal
the pairs the chart's rendered Role rules grant it. `kubectl auth can-i` (impersonating the
ServiceAccount) shows the grants and the denials that must hold.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo import launch
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from kvtopo.localkeys import OPERATOR_KEY, OPERATOR_PUBLIC, Credentials
from kvtopo.ports import free_port
from tests.cluster.kube import apply, create_namespace, get_json
from tests.e2e.harness import OperatorHarness
from tests.helm.chart import CHART, Helm, binary, can_i, parse, rules_set
from tests.worker.workers import WorkerProcess, start_worker, stop_operator_and_workers

pytestmark = pytest.mark.nixl

RELEASE = "kvtopo"
SERVICE_ACCOUNT = "kvtopo"  # the chart's default: the full name, "kvtopo" for this release
TOKEN_SECRET = "kvtopo-operator-key"  # the operator's private key (Secret); the public key
# is the ConfigMap of the same name
GRACE = 1
# The operator turns kopf's cluster-wide scanning of namespaces and CRDs off, so with the
# chart's grants it meets no refusal at all.
READY_TIMEOUT_S = 60
AUDIT_TIMEOUT_S = 30
# The test's own requests as the ServiceAccount (whoami, the refused Secret read) are made
# with kubectl; the operator's come from kopf and the kubernetes client.
TEST_USER_AGENT = "kubectl/"

Grant = tuple[str, str, str, str]  # (apiGroup, resource[/subresource], resourceName or *, verb)


@dataclass
class Installed(OperatorHarness):
    helm: Helm

    def kubectl_as_sa(self, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(binary("kubectl")),
                f"--kubeconfig={kubeconfig}",
                f"--cache-dir={self.tmp / 'kubectl-cache'}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def service_account_kubeconfig(self) -> Path:
        """A kubeconfig whose only credential is a fresh token of the chart's
        ServiceAccount (TokenRequest API), for the admin kubeconfig's cluster."""
        token = self.cluster.kubectl(
            "create", "token", SERVICE_ACCOUNT, "-n", self.namespace, "--duration=1h"
        ).stdout.strip()
        admin = yaml.safe_load(self.cluster.kubeconfig.read_text())
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": admin["clusters"],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [
                {
                    "name": "operator",
                    "context": {
                        "cluster": admin["clusters"][0]["name"],
                        "user": "operator",
                        "namespace": self.namespace,
                    },
                }
            ],
            "current-context": "operator",
        }
        path = self.tmp / "operator-kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def chart_credentials(self) -> Credentials:
        """The chart's key pair as files: the Secret's private key (for the operator) and
        the ConfigMap's public key (for the workers), beside a client token."""
        secret = get_json(self.cluster, "secret", TOKEN_SECRET, "-n", self.namespace)
        public = get_json(self.cluster, "configmap", TOKEN_SECRET, "-n", self.namespace)
        folder = self.tmp / "chart-keys"
        folder.mkdir(exist_ok=True)
        (folder / OPERATOR_KEY).write_bytes(base64.b64decode(secret["data"]["operator.key"]))
        (folder / OPERATOR_PUBLIC).write_text(public["data"]["operator.pem"])
        return Credentials.beside(folder / "token")  # keeps the two files written above

    def manifest(self) -> list[dict[str, Any]]:
        return parse(self.helm.run("get", "manifest", RELEASE, "-n", self.namespace).stdout)

    def deployment_args(self) -> list[str]:
        deploy = next(d for d in self.manifest() if d["kind"] == "Deployment")
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["kvtopo-operator"]
        args: list[str] = c["args"]
        return args

    def granted(self) -> set[Grant]:
        """What the release grants its ServiceAccount: the rules of every Role and ClusterRole
        of the release that a binding of the release binds to it, flattened."""
        docs = self.manifest()
        roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"].endswith("Role")}
        out: set[Grant] = set()
        for binding in docs:
            if not binding["kind"].endswith("RoleBinding"):
                continue
            subject = {
                "kind": "ServiceAccount",
                "name": SERVICE_ACCOUNT,
                "namespace": self.namespace,
            }
            if subject not in binding["subjects"]:
                continue
            ref = binding["roleRef"]
            out |= rules_set(roles[(ref["kind"], ref["name"])]["rules"])
        return out


@pytest.fixture
def installed(cluster_a: LocalCluster, tmp_path: Path) -> Iterator[Installed]:
    namespace = create_namespace(cluster_a, "kvt-rbac", wait_for_sa=False)
    helm = Helm(tmp_path / "helm", cluster_a.kubeconfig)
    helm.run("install", RELEASE, str(CHART), "--namespace", namespace)
    env = Installed(cluster_a, namespace, tmp_path, helm)
    try:
        yield env
    finally:
        stop_operator_and_workers(env.operator, 15, env.workers.values())
        helm.run("uninstall", RELEASE, "--namespace", namespace, check=False)
        cluster_a.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def peers(w: WorkerProcess) -> set[str]:
    return {p["engine_id"] for p in w.state()["peers"]}


def ready(st: dict[str, Any]) -> str:
    return next((c["status"] for c in st.get("conditions", []) if c["type"] == "Ready"), "")


def audited(event: dict[str, Any]) -> Grant:
    """An audit event as the grant it needed: watch, list and get are the verbs the API
    server records for watch, collection and single-object reads; PUT is update."""
    ref = event["objectRef"]
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return (ref.get("apiGroup", ""), resource, ref.get("name", "*"), event["verb"])


def operator_requests(cluster: LocalCluster, user: str) -> list[dict[str, Any]]:
    """The audit events of `user`'s resource requests but the test's own (kubectl)."""
    return [
        e
        for e in cluster.audit_events(user)
        if "objectRef" in e and not e.get("userAgent", "").startswith(TEST_USER_AGENT)
    ]


def without_names(grants: set[Grant]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for group, resource, _, verb in grants}


def refusals(log: str) -> set[str]:
    """What the API server refused the operator, one entry per logged refusal: the resource
    when the line names it, else the line itself."""
    out = set()
    for line in log.splitlines():
        # Not a log timestamp's milliseconds (",403"): a status or the API server's word.
        if not re.search(r"(?<![,.])\b403\b|forbidden", line, re.IGNORECASE):
            continue
        named = re.search(r'cannot \w+ resource \\?"([\w./-]+)\\?"', line)
        out.add(named.group(1) if named else line.strip()[:300])
    return out


def test_operator_as_the_chart_service_account_reconciles_end_to_end(
    installed: Installed,
) -> None:
    env = installed
    cluster = env.cluster
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=60s"
    )

    kubeconfig = env.service_account_kubeconfig()
    whoami = env.kubectl_as_sa(kubeconfig, "auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    user = json.loads(whoami.stdout)["status"]["userInfo"]["username"]
    assert user == f"system:serviceaccount:{env.namespace}:{SERVICE_ACCOUNT}"
    # The identity really is limited: no Secrets through the API.
    denied = env.kubectl_as_sa(kubeconfig, "get", "secret", TOKEN_SECRET, "-n", env.namespace)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

    # Exactly the chart's arguments, with local paths and loopback ports swapped in.
    chart_args = env.deployment_args()
    liveness_port = free_port()
    creds = env.chart_credentials()
    token_file = creds.client_token
    swapped = {
        "--worker-key-file": str(creds.operator_key),
        "--liveness": f"http://127.0.0.1:{liveness_port}/healthz",
        "--metrics-port": "0",
    }
    args = []
    for arg in chart_args:
        key = arg.split("=", 1)[0]
        if key == "--metrics-host":
            continue
        args.append(f"{key}={swapped[key]}" if key in swapped else arg)
    assert f"--namespace={env.namespace}" in args
    assert not any(a.startswith("--all-namespaces") for a in args)
    assert "--leader-elect" in args and f"--leader-elect-namespace={env.namespace}" in args
    lease = next(a.split("=", 1)[1] for a in args if a.startswith("--leader-elect-lease-name="))
    args.append(f"--kubeconfig={kubeconfig}")
    # The release's Lease, created empty (so `helm uninstall` deletes it). Deleted here, as a
    # user might: the operator must create it again (its one use of `create`), then renew it.
    chart_lease = get_json(cluster, "lease", lease, "-n", env.namespace)
    assert not (chart_lease.get("spec") or {}).get("holderIdentity"), chart_lease
    cluster.kubectl("delete", "lease", lease, "-n", env.namespace)
    check_can_i(cluster, user, env.namespace, lease)

    for name, role in (("p0", "prefill"), ("d0", "decode")):
        env.pod(
            name,
            role,  # type: ignore[arg-type]
            lambda identity, role=role: start_worker(
                role, token_file, env.tmp, "--num-blocks", "16", *identity
            ),
            kv_gate=True,  # the operator writes their kv-connected condition (pods/status)
        )
    apply(
        cluster,
        manifests.topology(
            "llama", app="llama", namespace=env.namespace, eviction={"graceSeconds": GRACE}
        ),
    )
    env.start_operator(args)

    # The chart's probes hit kopf's liveness endpoint: it must answer.
    def alive() -> bool:
        assert env.operator is not None and env.operator.poll() is None, env.operator_tail()
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{liveness_port}/healthz", timeout=2
            ) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    env.wait("the operator's liveness endpoint", alive, timeout=60)

    st = env.wait(
        "Ready=True with pairs 1/1",
        lambda: (s := env.status()) and ready(s) == "True" and s["summary"]["pairs"] == "1/1" and s,
        timeout=READY_TIMEOUT_S,
    )
    assert st["summary"] == {"prefill": "1/1", "decode": "1/1", "pairs": "1/1"}
    assert st["observedGeneration"] >= 1
    p0, d0 = env.workers["p0"], env.workers["d0"]
    assert peers(p0) == {d0.engine_id} and peers(d0) == {p0.engine_id}

    # A deleted decode pod: seen through the pod watch, evicted, and reported by an Event
    # the operator creates as its ServiceAccount.
    cluster.kubectl("delete", "pod", "d0", "-n", env.namespace, "--wait=true")
    env.wait("d0 evicted from p0", lambda: d0.engine_id not in peers(p0), timeout=GRACE + 30)

    def evicted_event() -> dict[str, Any] | None:
        events = get_json(
            cluster,
            "events",
            "-n",
            env.namespace,
            "--field-selector",
            "involvedObject.name=llama,reason=EngineEvicted",
        )["items"]
        return events[0] if events else None

    event = env.wait("an EngineEvicted Event", evicted_event, timeout=30)
    assert event["source"]["component"] == "kvtopo-operator"
    assert event["involvedObject"]["kind"] == "KVTopology"

    # Leader election: the operator holds the Lease it created.
    held = get_json(cluster, "lease", lease, "-n", env.namespace)["spec"]
    assert held["holderIdentity"] and held["leaseDurationSeconds"] == 15, held

    # Every granted verb gets used: wait until the audit log shows each (the Lease's update
    # comes with the first renewal, a retry period after its creation), then stop the
    # operator, so that the log holds everything it did in its life.
    granted = env.granted()

    def unused() -> list[tuple[str, str, str]]:
        seen = without_names({audited(e) for e in operator_requests(cluster, user)})
        return sorted(without_names(granted) - seen)

    wait_until(
        lambda: not unused(),
        AUDIT_TIMEOUT_S,
        "the audit log to show every granted verb used",
        interval_s=0.5,
        describe_last=lambda: f"not used yet: {unused()}\n{env.operator_tail(40)}",
    )
    assert env.operator is not None
    assert launch.stop_process(env.operator, 15) == 0, env.operator_tail(40)
    # An answered request's audit line is written as its handler returns, which may be a
    # moment after the client saw the answer.
    time.sleep(0.5)
    events = operator_requests(cluster, user)
    used = {audited(e) for e in events}
    print_grants(granted, used)
    others = [e for e in cluster.audit_events(user) if e not in events]
    own = sorted({audited(e) for e in others if "objectRef" in e})
    discovery = sum("objectRef" not in e for e in others)
    print(f"not counted: the test's own kubectl requests {own}, {discovery} discovery GETs")
    print("the operator's user agents:", sorted({e.get("userAgent", "") for e in events}))

    # Every used verb was granted: no refusal, neither in the audit log nor in its own log.
    denied_requests = sorted(
        {audited(e) for e in events if e.get("responseStatus", {}).get("code") == 403}
    )
    assert not denied_requests, f"the API server refused the operator {denied_requests}"
    log = env.operator_log.read_text(errors="replace") if env.operator_log else ""
    refused = refusals(log)
    assert not refused, (
        f"the operator was refused {sorted(refused)}: the chart's RBAC misses "
        f"something it needs\n{env.operator_tail(60)}"
    )
    assert "Traceback" not in log, env.operator_tail(80)
    # ... and every granted verb was used: the same (resource, verb) pairs both ways, and
    # each rule limited to one object name (the Lease's get/update) was used on that object.
    assert without_names(used) == without_names(granted), (
        f"granted but never used: {sorted(without_names(granted) - without_names(used))}; "
        f"used but not granted: {sorted(without_names(used) - without_names(granted))}"
    )
    for group, resource, name, verb in granted:
        if name != "*":
            names = {n for g, r, n, v in used if (g, r, v) == (group, resource, verb)}
            assert names == {name}, (group, resource, verb, names)
    assert {v for _, r, _, v in used if r == "leases"} == {"get", "create", "update"}


def print_grants(granted: set[Grant], used: set[Grant]) -> None:
    """Both sets in the test's output (shown with -s or on failure)."""
    for title, grants in (("granted", granted), ("used (audit log)", used)):
        rows = [f"  {g or 'core'} {r} {n} {v}" for g, r, n, v in sorted(grants)]
        print(f"{title}:", *rows, sep="\n")


def check_can_i(cluster: LocalCluster, sa: str, namespace: str, lease: str) -> None:
    """`kubectl auth can-i` as the ServiceAccount: the trimmed grants, and what stays denied."""
    n = ("-n", namespace)
    own_lease = f"leases.coordination.k8s.io/{lease}"
    allowed: list[tuple[str, ...]] = [
        ("list", "pods", *n),
        ("watch", "pods", *n),
        ("list", "kvtopologies.kvtopo.dev", *n),
        ("watch", "kvtopologies.kvtopo.dev", *n),
        ("create", "events", *n),
        ("create", "leases.coordination.k8s.io", *n),
        ("get", own_lease, *n),
        ("update", own_lease, *n),
    ]
    for verb, resource, *where in allowed:
        assert can_i(cluster, sa, verb, resource, *where), (verb, resource)
    assert can_i(cluster, sa, "patch", "kvtopologies.kvtopo.dev", *n, subresource="status")
    assert can_i(cluster, sa, "patch", "pods", *n, subresource="status")
    denied: list[tuple[str, ...]] = [
        ("get", "secrets", *n),
        ("list", "secrets", *n),
        ("get", "pods", *n),
        ("create", "pods", *n),
        ("patch", "pods", *n),
        ("delete", "pods", *n),
        ("get", "kvtopologies.kvtopo.dev", *n),  # each round reads it from the watch
        ("patch", "kvtopologies.kvtopo.dev", *n),
        ("update", "kvtopologies.kvtopo.dev", *n),
        ("delete", "kvtopologies.kvtopo.dev", *n),
        ("patch", "events", *n),
        ("list", "leases.coordination.k8s.io", *n),
        ("patch", own_lease, *n),
        ("delete", own_lease, *n),
        ("get", "leases.coordination.k8s.io/another-lease", *n),
    ]
    for verb, resource, *where in denied:
        assert not can_i(cluster, sa, verb, resource, *where), (verb, resource)
    for verb in ("get", "update"):
        assert not can_i(cluster, sa, verb, "kvtopologies.kvtopo.dev", *n, subresource="status")
