"""RBAC proven, not assumed: the operator, as the chart's ServiceAccount, reconciles end to end.

On the tier-a API server (`--authorization-mode=Node,RBAC`) the chart is installed with its
default values (namespace scope). A token for the chart's ServiceAccount is minted through
the TokenRequest API (`kubectl create token`), and `kvtopo-operator` runs as a local process
with a kubeconfig holding only that token and exactly the arguments of the chart's
Deployment (local paths and loopback ports swapped in), reading the worker token from the
chart's generated Secret. Two engine pods backed by real `kvtopo-worker` processes must get
connected (Ready=True, pairs 1/1), and deleting one must be evicted and reported by an Event
the operator creates, all with no permission the chart does not grant.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from tests.cluster.kube import apply, create_namespace, get_json
from tests.e2e.harness import OperatorHarness
from tests.helm.chart import CHART, Helm, binary, parse
from tests.worker.workers import WorkerProcess, start_worker, stop_operator_and_workers

pytestmark = pytest.mark.nixl

RELEASE = "kvtopo"
SERVICE_ACCOUNT = "kvtopo"  # the chart's default: the full name, "kvtopo" for this release
TOKEN_SECRET = "kvtopo-worker-token"
GRACE = 1
# The operator turns kopf's cluster-wide scanning of namespaces and CRDs off, so with the
# chart's grants it meets no refusal at all.
READY_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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

    def worker_token_file(self) -> Path:
        secret = get_json(self.cluster, "secret", TOKEN_SECRET, "-n", self.namespace)
        path = self.tmp / "worker-token"
        path.write_bytes(base64.b64decode(secret["data"]["token"]))
        return path

    def deployment_args(self) -> list[str]:
        manifest = self.helm.run("get", "manifest", RELEASE, "-n", self.namespace).stdout
        deploy = next(d for d in parse(manifest) if d["kind"] == "Deployment")
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["kvtopo-operator"]
        args: list[str] = c["args"]
        return args


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


def refusals(log: str) -> set[str]:
    """What the API server refused the operator, one entry per logged refusal: the resource
    when the line names it, else the line itself."""
    out = set()
    for line in log.splitlines():
        if not re.search(r"\b403\b|forbidden", line, re.IGNORECASE):
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
    token_file = env.worker_token_file()
    swapped = {
        "--worker-token-file": str(token_file),
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
    args.append(f"--kubeconfig={kubeconfig}")

    for name, role in (("p0", "prefill"), ("d0", "decode")):
        env.pod(
            name,
            role,  # type: ignore[arg-type]
            lambda identity, role=role: start_worker(
                role, token_file, env.tmp, "--num-blocks", "16", *identity
            ),
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

    log = env.operator_log.read_text(errors="replace") if env.operator_log else ""
    refused = refusals(log)
    assert not refused, (
        f"the operator was refused {sorted(refused)}: the chart's RBAC misses "
        f"something it needs\n{env.operator_tail(60)}"
    )
    assert "Traceback" not in log, env.operator_tail(80)
