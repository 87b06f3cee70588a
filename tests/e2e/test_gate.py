"""The readiness gate kvtopo.dev/kv-connected on a real API server with real workers: the
operator sets the condition of a pod that lists the gate (pods/status) True once its engine
is connected to its partners, False while it has none (a decode whose version no prefill
has), and False again when its partner's pod goes; a pod without the gate is never
written. Tier a has no kubelet: the pods' containers are marked ready by the test."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from kvtopo_operator.api import KV_CONNECTED_GATE
from tests.cluster.kube import get_json
from tests.e2e.env import Env, peers

pytestmark = pytest.mark.nixl


def gate(env: Env, pod: str) -> dict[str, Any]:
    obj = get_json(env.cluster, "pod", pod, "-n", env.namespace)
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == KV_CONNECTED_GATE), {})


def test_the_gate_follows_the_engines_connections(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.pod("d1", "decode", env.worker("decode"), version="v2", kv_gate=True)  # no v2 prefill
    env.pod("d2", "decode", env.worker("decode"))  # no gate: never written
    env.topology(readinessGate={"minConnectedPartners": 1})
    env.start_operator()

    for pod in ("p0", "d0"):
        got = env.wait(
            f"{pod}'s gate True",
            lambda pod=pod: (g := gate(env, pod)).get("status") == "True" and g,
        )
        assert got["reason"] == "KVConnected", got
    assert gate(env, "p0")["message"] == "2/2 partners connected"
    assert gate(env, "d0")["message"] == "1/1 partners connected"
    d1 = env.wait("d1's gate False", lambda: (g := gate(env, "d1")).get("status") == "False" and g)
    assert d1["reason"] == "NoPartner", d1
    assert gate(env, "d2") == {}
    # The kubelet's conditions are untouched by the operator's patch (merged by type).
    obj = get_json(env.cluster, "pod", "d0", "-n", env.namespace)
    types = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert types["ContainersReady"] == "True" and types["Ready"] == "False", types

    # The prefill's pod goes: d0 has no partner left, its gate turns False.
    env.delete_pod("p0")
    gone = env.wait(
        "d0's gate False once p0 is gone",
        lambda: (g := gate(env, "d0")).get("status") == "False" and g,
    )
    assert gone["reason"] == "NoPartner", gone


def test_a_pod_that_leaves_every_topology_has_its_gate_turned_false(env: Env) -> None:
    """The gate follows every pod the operator gated: a pod relabelled out of the selector
    (its engine is then evicted from its peers) has the condition False within a round,
    and when the topology itself is deleted, so do the pods only it selected: a Service
    must not keep routing to engines that can no longer receive KV."""
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1})
    env.start_operator()
    for pod in ("p0", "d0", "d1"):
        env.wait(f"{pod}'s gate True", lambda pod=pod: gate(env, pod).get("status") == "True")

    env.cluster.kubectl("label", "pod", "d1", "-n", env.namespace, "app=elsewhere", "--overwrite")
    left = env.wait(
        "d1's gate False once relabelled",
        lambda: (g := gate(env, "d1")).get("status") == "False" and g,
    )
    assert left["reason"] == "NotSelected", left
    assert gate(env, "d0")["status"] == "True"

    env.cluster.kubectl("delete", "kvtopology", "llama", "-n", env.namespace, "--wait=true")
    for pod in ("p0", "d0"):
        got = env.wait(
            f"{pod}'s gate False once the topology is deleted",
            lambda pod=pod: (g := gate(env, pod)).get("status") == "False" and g,
        )
        assert got["reason"] == "NotSelected", got


def test_a_hung_worker_costs_its_own_engine_only(env: Env) -> None:
    """One decode's worker SIGSTOPped (hung, not dead: its socket accepts, nothing answers)
    must not slow the decisions about the others: a new gated decode is connected and its
    gate True in about a round, not after the hung worker's read deadline each round. On
    9cfedae every round waited for the hung worker's read (5 s): the new decode's gate took
    5-10 s. The hung engine itself is reported Failed (worker unreachable), not evicted."""
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    hung = env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1})
    env.start_operator()
    for pod in ("p0", "d0", "d1"):
        env.wait(f"{pod}'s gate True", lambda pod=pod: gate(env, pod).get("status") == "True")

    hung.proc.send_signal(signal.SIGSTOP)
    try:
        # The operator finds it out (its re-read passes the 5 s handshake deadline).
        env.wait(
            "d1 reported unreachable",
            lambda: any(
                e.get("pod") == "d1"
                and e.get("state") == "Failed"
                and "unreachable" in e["message"]
                for e in env.status().get("engines", [])
            ),
        )
        took = []
        for name in ("d2", "d3"):
            env.pod(name, "decode", env.worker("decode"), kv_gate=True)
            ready = time.monotonic()
            env.wait(f"{name}'s gate True", lambda n=name: gate(env, n).get("status") == "True")
            took.append(time.monotonic() - ready)
        # A round or two (resync 1 s; the hung worker's read deadline is 5 s).
        print(f"gate True after {[round(t, 2) for t in took]} s with a hung worker")
        assert max(took) < 2.5, took
        engines = {e["pod"]: e for e in env.status()["engines"]}
        assert engines["d1"]["state"] == "Failed", engines["d1"]
        assert hung.engine_id in peers(env.workers["p0"])  # kept: nobody can tell yet
    finally:
        hung.proc.send_signal(signal.SIGCONT)


def test_a_pod_whose_role_label_is_removed_has_its_gate_turned_false(env: Env) -> None:
    """The engine-pod watch is filtered on `kvtopo.dev/role`: removing the label makes the
    pod leave it (reported DELETED, while it runs on). Its engine is evicted from its peers,
    and its gate, which the operator set True, must not stay True. On 7314fe4 it said
    `True/KVConnected "1/1 partners connected"` for good."""
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1})
    env.start_operator()
    for pod in ("p0", "d0", "d1"):
        env.wait(f"{pod}'s gate True", lambda pod=pod: gate(env, pod).get("status") == "True")
    gone = env.workers["d1"].engine_id
    env.cluster.kubectl("label", "pod", "d1", "-n", env.namespace, "kvtopo.dev/role-")
    left = env.wait(
        "d1's gate False once its role label is removed",
        lambda: (g := gate(env, "d1")).get("status") == "False" and g,
        timeout=15,
    )
    assert left["reason"] == "NotSelected" and "kvtopo.dev/role" in left["message"], left
    env.wait("d1 evicted from p0", lambda: gone not in peers(env.workers["p0"]), timeout=15)
    assert gate(env, "d0")["status"] == "True"
    # Labelled again, it is an engine pod again: connected, its gate True.
    env.cluster.kubectl("label", "pod", "d1", "-n", env.namespace, "kvtopo.dev/role=decode")
    env.wait("d1's gate True again", lambda: gate(env, "d1").get("status") == "True", timeout=30)
