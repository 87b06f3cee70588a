"""The operator end to end on a real API server (tier a) with real `kvtopo-worker` processes.

Pods are created directly and marked Ready by patching their status (tier a has no kubelet);
each pod's `kvtopo.dev/control-endpoint` annotation points at a real worker process on
loopback. The operator runs as its own process so it can be killed mid-way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtopo import launch
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from tests.cluster.kube import apply, create_namespace
from tests.e2e.harness import ROOT, OperatorHarness
from tests.worker.workers import WorkerProcess, start_worker, stop_operator_and_workers

pytestmark = pytest.mark.nixl

GRACE = 2


@dataclass
class Env(OperatorHarness):
    token_file: Path

    # --- workers and pods ------------------------------------------------------------------

    def worker(self, role: str, *extra: str) -> WorkerProcess:
        w = start_worker(
            role,
            self.token_file,
            self.tmp,
            "--num-blocks",
            "32",
            "--block-bytes",
            "4096",
            "--registration-timeout",
            "3",
            "--transfer-timeout",
            "3",
            *extra,
        )
        return w

    def pod(  # type: ignore[override]
        self, name: str, role: manifests.Role, w: WorkerProcess, version: str = "v1"
    ) -> None:
        super().pod(name, role, w, version=version)

    def repoint(self, name: str, w: WorkerProcess) -> None:
        self.workers[name] = w
        self.cluster.kubectl(
            "annotate",
            "pod",
            name,
            "-n",
            self.namespace,
            "--overwrite",
            f"kvtopo.dev/control-endpoint={w.endpoint}",
        )

    def delete_pod(self, name: str) -> None:
        self.cluster.kubectl("delete", "pod", name, "-n", self.namespace, "--wait=true")

    def topology(self, name: str = "llama", **spec: Any) -> None:
        spec.setdefault("eviction", {"graceSeconds": GRACE})
        body = manifests.topology(
            name, app="llama", namespace=self.namespace, pair_on=("version",), **spec
        )
        apply(self.cluster, body)

    # --- the operator ----------------------------------------------------------------------

    def start_operator(self) -> None:  # type: ignore[override]
        args = launch.operator_args(
            self.namespace, self.cluster.kubeconfig, self.token_file, resync_s=1
        )
        super().start_operator(args, f"operator-{time.monotonic_ns()}.log")

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.send_signal(signal.SIGKILL)
        self.operator.wait(10)


def ready_status(st: dict[str, Any]) -> str:
    return next((c["status"] for c in st.get("conditions", []) if c["type"] == "Ready"), "")


def peers(w: WorkerProcess) -> set[str]:
    return {p["engine_id"] for p in w.state()["peers"]}


@pytest.fixture
def env(cluster_a: LocalCluster, tmp_path: Path) -> Iterator[Env]:
    cluster_a.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    cluster_a.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    token = tmp_path / "token"
    token.write_text("e2e-token\n")
    e = Env(cluster_a, create_namespace(cluster_a, "kvt-e2e", wait_for_sa=False), tmp_path, token)
    try:
        yield e
    finally:
        stop_operator_and_workers(e.operator, 10, e.workers.values())


def test_pairs_connect_and_a_deleted_decode_is_evicted(env: Env) -> None:
    for i in range(2):
        env.pod(f"p{i}", "prefill", env.worker("prefill"))
    for i in range(3):
        env.pod(f"d{i}", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    st = env.wait(
        "Ready with 6/6 pairs",
        lambda: (
            (s := env.status())
            and ready_status(s) == "True"
            and s["summary"]["pairs"] == "6/6"
            and s
        ),
    )
    assert st["summary"] == {"prefill": "2/2", "decode": "3/3", "pairs": "6/6"}
    ids = {name: w.engine_id for name, w in env.workers.items()}
    decodes = {ids[f"d{i}"] for i in range(3)}
    prefills = {ids[f"p{i}"] for i in range(2)}
    for name, w in env.workers.items():
        assert peers(w) == (decodes if name.startswith("p") else prefills), name
    printed = env.cluster.kubectl("get", "kvt", "-n", env.namespace).stdout
    assert "6/6" in printed and "True" in printed
    described = env.cluster.kubectl("describe", "kvt", "llama", "-n", env.namespace).stdout
    assert "AllPairsConnected" in described

    gone = ids["d2"]
    t0 = time.monotonic()
    env.delete_pod("d2")
    env.wait(
        "d2 evicted from both prefill workers",
        lambda: all(gone not in peers(env.workers[p]) for p in ("p0", "p1")),
        timeout=GRACE + 10,
    )
    elapsed = time.monotonic() - t0
    assert elapsed <= GRACE + 1, f"eviction took {elapsed:.2f}s (grace {GRACE}s)"
    st = env.wait(
        "status shows d2 evicted",
        lambda: (
            (s := env.status())
            and any(e["engineId"] == gone and e["state"] == "Evicted" for e in s["engines"])
            and s
        ),
    )
    assert st["summary"]["pairs"] == "4/4"
    env.wait(
        "EngineEvicted event",
        lambda: (
            "EngineEvicted"
            in env.cluster.kubectl(
                "get",
                "events",
                "-n",
                env.namespace,
                "--field-selector",
                "involvedObject.name=llama",
            ).stdout
        ),
    )
    described = env.cluster.kubectl("describe", "kvt", "llama", "-n", env.namespace).stdout
    assert "Conditions:" in described and "Events:" in described
    assert "EngineEvicted" in described, described[-1500:]


def test_restarted_worker_is_a_new_engine(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    old = env.workers["d0"]
    old.stop()
    new = env.worker("decode")
    env.repoint("d0", new)
    env.wait(
        "new engine connected, old one evicted",
        lambda: (
            peers(env.workers["p0"]) == {new.engine_id}
            and peers(new) == {env.workers["p0"].engine_id}
        ),
        timeout=GRACE + 20,
    )
    st = env.wait(
        "status converged", lambda: (s := env.status()) and ready_status(s) == "True" and s
    )
    states = {e["engineId"]: e["state"] for e in st["engines"]}
    assert states[new.engine_id] == "Connected"
    assert states.get(old.engine_id) in ("Evicted", "Draining", None)


def test_registration_failure_reaches_status_within_10s(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    d0 = env.workers["d0"]
    assert d0.submit("doomed-1", env.workers["p0"], 1) == 202  # fine: P knows it
    status, _ = d0.call(
        "POST",
        "/v1/requests",
        {"request_id": "doomed-2", "peer_engine_id": "no-such-engine", "num_blocks": 1},
    )
    assert status == 202
    t0 = time.monotonic()
    st = env.wait(
        "failure counted",
        lambda: (
            (s := env.status())
            and s.get("failures", {}).get("counts", {}).get("push_reg_notif_failed")
            and s
        ),
        timeout=10,
    )
    assert time.monotonic() - t0 <= 10
    assert st["failures"]["counts"]["push_reg_notif_failed"] == 1
    last = st["failures"]["last"]
    assert last["type"] == "push_reg_notif_failed" and last["requestId"] == "doomed-2"
    assert last["pod"] == "d0"


def test_incompatible_engines_are_reported_never_connected(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill", "--model-id", "llama-8b"))
    env.pod("d0", "decode", env.worker("decode", "--model-id", "llama-70b"))
    env.topology()
    env.start_operator()
    st = env.wait(
        "Incompatible",
        lambda: (
            (s := env.status())
            and any(e["state"] == "Incompatible" for e in s.get("engines", []))
            and s
        ),
    )
    assert {e["state"] for e in st["engines"]} == {"Incompatible"}
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Incompatible")
    assert peers(env.workers["p0"]) == set() and peers(env.workers["d0"]) == set()


def test_operator_killed_and_restarted_loses_nothing(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.pod("d1", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "2/2")
    d0 = env.workers["d0"]
    d0.call("POST", "/v1/requests", {"request_id": "x", "peer_engine_id": "nope", "num_blocks": 1})
    env.wait(
        "counted",
        lambda: (
            env.status().get("failures", {}).get("counts", {}).get("push_reg_notif_failed") == 1
        ),
    )
    env.kill_operator()
    # Churn while the operator is down: one decode goes, another arrives.
    gone = env.workers["d1"].engine_id
    env.delete_pod("d1")
    env.pod("d2", "decode", env.worker("decode"))
    env.start_operator()
    st = env.wait(
        "converged after restart",
        lambda: (
            (s := env.status())
            and ready_status(s) == "True"
            and s["summary"]["pairs"] == "2/2"
            and gone not in peers(env.workers["p0"])
            and s
        ),
        timeout=GRACE + 30,
    )
    assert st["failures"]["counts"]["push_reg_notif_failed"] == 1, "counters kept, not doubled"
    # No peer was connected twice: each worker added each peer once.
    p0 = env.workers["p0"]
    added = [
        line
        for line in _metrics(p0).splitlines()
        if line.startswith('kvtopo_worker_handshakes_total{result="added"}')
    ]
    assert added and float(added[0].split()[-1]) == 3.0  # d0, d1, d2: once each


def _metrics(w: WorkerProcess) -> str:
    import urllib.request

    return urllib.request.urlopen(w.url + "/metrics", timeout=5).read().decode()


def test_operator_help_mentions_scope() -> None:
    out = subprocess.run(
        launch.operator_command(["--help"]),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert (
        out.returncode == 0 and "--namespace" in out.stdout and "--worker-token-file" in out.stdout
    )
