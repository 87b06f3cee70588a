"""The user's install path, run for real on the real node (tier c).

`helm install` of the chart with its defaults (2 operator replicas with leader election,
probes, NetworkPolicies) running the operator image built from docker/; the examples' prefill
and decode Deployments of the emulated engine (the worker image) and the KVTopology, applied
with `kubectl apply`. Shown, in order (the tests share one installation):

1. both operator pods Ready on the real node, one holding the Lease;
2. the readiness gate honoured by the real kubelet: decode pods Running with their
   containers ready stay not Ready while no prefill engine exists, and turn Ready only after
   the operator connected them;
3. the engines reach each other at their pod IPs on the bridge, and requests move verified
   KV over NIXL between pods;
4. `kubectl rollout restart` of the decode Deployment under a request stream: 0 lost, 0
   failed;
5. `helm upgrade` with a changed operator value under a request stream: the operator pods
   roll, and no gate turns False, no engine pod leaves Ready, no request fails;
6. deleting the leader pod moves the Lease to the other replica;
7. `helm uninstall` leaves nothing of the operator behind.

The last test of the session (`test_cluster_down_puts_the_machine_back`, ordered last by
tests/node/conftest.py) stops the cluster and compares the machine with its snapshot.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.host_state import HostSnapshot
from kvtopo.cluster.images import published_names
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.real_node import NODE_NAME, POD_SUBNET
from kvtopo.drill.gates import GateWatch
from kvtopo_operator.kube import ClusterApi
from tests.helm.chart import CHART, Helm
from tests.node.podtraffic import PodRouter, RequestStream, pod_ready

pytestmark = pytest.mark.node

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "kvtopo-system"
RELEASE = "kvtopo"
TOPOLOGY = "llama-pd"
TOKEN_SECRET = "llama-client-token"
TOKEN_DIR = "/var/run/kvtopo/client"
GATE = "kvtopo.dev/kv-connected"
LEASE = "kvtopo-operator"
INSTALL_TIMEOUT_S = 240.0


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in pod.get("status", {}).get("conditions") or []}


def engine_deployment(name: str, image: str, replicas: int) -> dict[str, Any]:
    """examples/<name>-deployment.yaml with the image built here (never pulled), fewer
    replicas (2 cores), and the client token mounted for the traffic routes."""
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["image"] = image
    container["imagePullPolicy"] = "Never"
    container["args"] += ["--token-file", f"{TOKEN_DIR}/token"]
    container["volumeMounts"].append({"name": "client-token", "mountPath": TOKEN_DIR})
    pod["volumes"].append({"name": "client-token", "secret": {"secretName": TOKEN_SECRET}})
    return manifest


class Install:
    """What the tests of this module share: the cluster, the token, the router."""

    def __init__(self, cluster: LocalCluster, helm: Helm) -> None:
        self.cluster = cluster
        self.helm = helm
        self.token = secrets.token_urlsafe(24)
        self.router = PodRouter(
            lambda *args: get_json(cluster, *args), NAMESPACE, TOPOLOGY, self.token
        )

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(
            self.cluster, "pods", "-n", NAMESPACE, "-l", selector
        )["items"]
        return items

    def topology(self) -> dict[str, Any]:
        status: dict[str, Any] = (
            get_json(self.cluster, "kvt", TOPOLOGY, "-n", NAMESPACE).get("status") or {}
        )
        return status

    def topology_ready(self) -> bool:
        ready = [c for c in self.topology().get("conditions") or [] if c["type"] == "Ready"]
        return bool(ready and ready[0]["status"] == "True")

    def lease_holder(self) -> str:
        lease = get_json(self.cluster, "lease", LEASE, "-n", NAMESPACE)
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    def describe(self) -> str:
        """The topology's engines and the engine pods, for a failure report."""
        engines = [
            f"{e['role']} {e.get('pod')} {e['state']} {e['engineId'][:8]} {e.get('message', '')}"
            for e in self.topology().get("engines") or []
        ]
        pods = [
            f"{p['metadata']['name']} {p['status'].get('phase')} ready={pod_ready(p)} "
            f"deleting={bool(p['metadata'].get('deletionTimestamp'))}"
            for p in self.pods("app=llama")
        ]
        return "engines:\n  " + "\n  ".join(engines) + "\npods:\n  " + "\n  ".join(pods)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(manifest))


@pytest.fixture(scope="module")
def install(cluster_c: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Install:
    assert cluster_c.images is not None
    helm = Helm(tmp_path_factory.mktemp("helm-home"), cluster_c.kubeconfig)
    # The chart's defaults, no --set: the node holds the image just built under the chart's
    # default name too (`kvtopo.cluster.images.published_names`), as `kind load` would.
    helm.run(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "--wait", "--timeout", f"{int(INSTALL_TIMEOUT_S)}s", timeout=INSTALL_TIMEOUT_S + 30,
    )  # fmt: skip
    return Install(cluster_c, helm)


def test_helm_install_runs_two_operator_pods_on_the_real_node_one_leading(
    install: Install,
) -> None:
    operators = install.pods("app.kubernetes.io/component=operator")
    assert len(operators) == 2
    for pod in operators:
        assert pod["spec"]["nodeName"] == NODE_NAME
        # The chart's default image, installed with no --set: the one built from docker/.
        assert pod["spec"]["containers"][0]["image"] == published_names()["operator"]
        assert pod_ready(pod), pod["metadata"]["name"]
        statuses = pod["status"]["containerStatuses"]
        assert all(s["ready"] and s["restartCount"] == 0 for s in statuses)
        # The chart's security context, as the real runtime applied it.
        context = pod["spec"]["containers"][0]["securityContext"]
        assert context["readOnlyRootFilesystem"] and context["runAsNonRoot"]
    names = {pod["metadata"]["name"] for pod in operators}
    wait_until(lambda: install.lease_holder().split("_")[0] in names, 60, "a leader")
    policies = get_json(install.cluster, "networkpolicy", "-n", NAMESPACE)["items"]
    assert {p["metadata"]["name"] for p in policies} >= {"kvtopo-operator"}


def test_the_real_kubelet_holds_decode_pods_unready_until_connected(install: Install) -> None:
    cluster = install.cluster
    cluster.kubectl(
        "create", "secret", "generic", TOKEN_SECRET, "-n", NAMESPACE,
        f"--from-literal=token={install.token}",
    )  # fmt: skip
    assert cluster.images is not None
    worker = cluster.images.worker
    install.apply(engine_deployment("decode-deployment", worker, 2))
    install.apply(engine_deployment("prefill-deployment", worker, 0))
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(ROOT / "examples" / "kvtopology.yaml"))

    def decode_pods() -> list[dict[str, Any]]:
        return install.pods("kvtopo.dev/role=decode")

    def containers_ready() -> bool:
        pods = decode_pods()
        return len(pods) == 2 and all(
            conditions(p).get("ContainersReady", {}).get("status") == "True" for p in pods
        )

    wait_until(containers_ready, 180, "decode containers running and ready (no prefill yet)")
    # With no prefill engine there is nothing to connect to: the gate keeps them out.
    held_until = time.monotonic() + 8
    while time.monotonic() < held_until:
        for pod in decode_pods():
            assert not pod_ready(pod), f"{pod['metadata']['name']} Ready before it connected"
        time.sleep(0.5)

    install.apply(engine_deployment("prefill-deployment", worker, 1))
    wait_until(
        lambda: len(decode_pods()) == 2 and all(pod_ready(p) for p in decode_pods()),
        180,
        "decode pods Ready once a prefill engine connected",
    )
    for pod in decode_pods():
        by_type = conditions(pod)
        assert by_type[GATE]["status"] == "True"
        # Ready followed the gate: never before it (the kubelet's condition, its time).
        assert by_type["Ready"]["lastTransitionTime"] >= by_type[GATE]["lastTransitionTime"]
        assert (
            by_type["ContainersReady"]["lastTransitionTime"] < by_type[GATE]["lastTransitionTime"]
        )
    wait_until(install.topology_ready, 120, "the KVTopology Ready")


def test_engines_move_verified_kv_between_pods_at_their_pod_ips(install: Install) -> None:
    engines = install.topology()["engines"]
    assert sorted(e["role"] for e in engines) == ["decode", "decode", "prefill"]
    subnet = POD_SUBNET.rsplit(".", 1)[0] + "."
    for engine in engines:
        assert engine["state"] == "Connected"
        assert engine["endpoint"].startswith(subnet), engine  # a pod IP on the bridge
    router = install.router
    pairs = router.routable_pairs()
    assert len(pairs) == 2
    sent = 0
    for i in range(12):
        sent += router.submit(*pairs[i % len(pairs)])
    assert sent == 12
    assert router.settle() == []
    assert router.ledger.failed() == []
    assert router.ledger.duplicates == 0
    # Every block of every request arrived and was checked on the decode side.
    assert router.ledger.verified_bytes() == 12 * router.blocks * 64 * 1024


def test_rollout_restart_of_decode_under_traffic_loses_nothing(install: Install) -> None:
    cluster = install.cluster
    before = {e["engineId"] for e in install.topology()["engines"] if e["role"] == "decode"}
    booked_before = len(install.router.ledger.booked)
    with RequestStream(install.router, rate_per_s=4) as stream:
        wait_until(lambda: len(install.router.ledger.booked) >= booked_before + 8, 60, "traffic")
        cluster.kubectl("rollout", "restart", "deployment/llama-decode", "-n", NAMESPACE)
        cluster.kubectl(
            "rollout", "status", "deployment/llama-decode", "-n", NAMESPACE, "--timeout=240s",
            timeout=260,
        )  # fmt: skip

        def new_decodes_serving() -> bool:
            engines = install.topology().get("engines") or []
            decodes = {
                e["engineId"]
                for e in engines
                if e["role"] == "decode" and e["state"] == "Connected"
            }
            return install.topology_ready() and len(decodes) == 2 and not decodes & before

        wait_until(
            new_decodes_serving,
            180,
            "two new decode engines connected",
            describe_last=install.describe,
        )
        served_new = len(install.router.ledger.booked)
        wait_until(
            lambda: len(install.router.ledger.booked) >= served_new + 8, 60, "traffic to new"
        )
    assert stream.errors == []
    ledger = install.router.ledger
    assert install.router.settle() == [], "lost: booked, never ended on both sides"
    assert ledger.failed() == []
    assert ledger.duplicates == 0
    decodes_used = {pair[1] for pair in stream.pairs_seen}
    assert decodes_used & before and decodes_used - before, "traffic ran on old and new engines"


def test_helm_upgrade_under_traffic_changes_no_gate_and_fails_no_request(
    install: Install,
) -> None:
    """`helm upgrade` with a changed operator value: the operator Deployment rolls (a new
    replica stands by, the leader gets SIGTERM and hands the Lease over) while a 4 req/s
    stream flows. Fail-static: no gate turns False, every engine pod stays Ready (both
    watched), and no request fails. On 7314fe4 the leader's SIGTERM turned every gate
    False (`NotSelected`) until a new round ran."""
    cluster = install.cluster
    api = ClusterApi(cluster.kubeconfig)
    engines = {p["metadata"]["name"] for p in install.pods("kvtopo.dev/role")}
    assert engines and all(pod_ready(p) for p in install.pods("kvtopo.dev/role"))
    booked_before = len(install.router.ledger.booked)
    with (
        GateWatch(api, NAMESPACE) as gates,
        GateWatch(api, NAMESPACE, condition="Ready") as ready,
        RequestStream(install.router, rate_per_s=4) as stream,
    ):
        wait_until(lambda: len(install.router.ledger.booked) >= booked_before + 8, 60, "traffic")
        install.helm.run(
            "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
            "--set", "operator.resyncSeconds=3", "--wait", "--timeout", "240s", timeout=270,
        )  # fmt: skip
        cluster.kubectl(
            "rollout", "status", "deployment/kvtopo-operator", "-n", NAMESPACE,
            "--timeout=240s", timeout=260,
        )  # fmt: skip
        wait_until(install.topology_ready, 120, "the KVTopology Ready under the new leader")
        served = len(install.router.ledger.booked)
        wait_until(lambda: len(install.router.ledger.booked) >= served + 8, 60, "traffic after")
    assert stream.errors == []
    assert gates.drops(pods=engines) == [], gates.drops(pods=engines)
    assert ready.drops(pods=engines) == [], ready.drops(pods=engines)
    ledger = install.router.ledger
    assert install.router.settle() == [], "lost: booked, never ended on both sides"
    assert ledger.failed() == []
    args = get_json(cluster, "deployment", "kvtopo-operator", "-n", NAMESPACE)
    container = args["spec"]["template"]["spec"]["containers"][0]
    assert "--resync-seconds=3" in container["args"], "the upgrade reached the operator"


def test_deleting_the_leader_pod_moves_the_lease(install: Install) -> None:
    holder = install.lease_holder()
    leader_pod = holder.split("_")[0]
    install.cluster.kubectl("delete", "pod", leader_pod, "-n", NAMESPACE, "--wait=false")

    def new_holder() -> str:
        pod = install.lease_holder().split("_")[0]
        return pod if pod not in ("", leader_pod) else ""

    survivor = wait_until(new_holder, 90, "the Lease held by the other operator replica")
    others = {p["metadata"]["name"] for p in install.pods("app.kubernetes.io/component=operator")}
    assert survivor != leader_pod
    assert survivor in others, (survivor, others)  # a replica of the release holds it
    wait_until(
        lambda: (
            len(ops := install.pods("app.kubernetes.io/component=operator")) == 2
            and all(pod_ready(p) for p in ops)
        ),
        120,
        "the Deployment back at two Ready operator pods",
    )
    wait_until(install.topology_ready, 120, "the KVTopology Ready under the new leader")


def test_helm_uninstall_leaves_nothing_of_the_operator(install: Install) -> None:
    cluster = install.cluster
    for name in ("llama-decode", "llama-prefill"):
        cluster.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true")
    cluster.kubectl("delete", "kvt", TOPOLOGY, "-n", NAMESPACE, "--wait=true")
    install.helm.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", timeout=180)

    def leftovers() -> list[str]:
        kinds = (
            "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,"
            "networkpolicies,configmaps,secrets,leases"
        )
        items = get_json(cluster, kinds, "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=kvtopo")
        named = [f"{i['kind']}/{i['metadata']['name']}" for i in items["items"]]
        lease = cluster.kubectl("get", "lease", LEASE, "-n", NAMESPACE, check=False)
        if lease.returncode == 0:
            named.append(f"Lease/{LEASE}")
        # Cluster-scoped objects of this release (a release of the same name in another
        # namespace, the drill's, keeps its own).
        cluster_wide = get_json(cluster, "clusterroles,clusterrolebindings")["items"]
        named += [
            f"{i['kind']}/{i['metadata']['name']}"
            for i in cluster_wide
            if (i["metadata"].get("annotations") or {}).get("meta.helm.sh/release-namespace")
            == NAMESPACE
            or i["metadata"]["name"].startswith(f"{NAMESPACE}-{RELEASE}")
        ]
        return named

    last: list[list[str]] = [[]]

    def gone() -> bool:
        last[0] = leftovers()
        return last[0] == []

    wait_until(gone, 120, "nothing of the release left", describe_last=lambda: f"left: {last[0]}")
    assert leftovers() == []


@pytest.mark.node_teardown
def test_cluster_down_puts_the_machine_back(cluster_c: LocalCluster) -> None:
    """Ordered last in the session: after the cluster stops, `ip link`, the firewall, the
    mounts, the kubelet's sysctls and the folders it makes are as they were before it."""
    before = cluster_c.host_before
    assert before is not None
    cluster_c.down()
    assert before.diff(HostSnapshot.capture()) == []
