"""Node loss from the Node itself (issue 54, defect 5), on the real API server with real
workers: a gated decode whose gate is False (connected to one of the two partners it
needs) runs on node `lost-node`; the node dies (its engine killed, and its Ready turned
Unknown, as the node lifecycle controller does when a kubelet goes silent). The pod's own
Ready is False already (its gate), so nothing about the pod changes. On 7314fe4 its
unreachable engine read as "cannot tell, kept" and the prefill held it for good; with the
Node watch (`--watch-nodes`) it is lost from the node's transition and evicted within the
grace."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from tests.cluster.kube import apply
from tests.e2e.env import GRACE, Env, peers
from tests.e2e.test_gate import gate
from tests.e2e.test_hostile_engines import hostile

pytestmark = pytest.mark.nixl
NODE = "lost-node"


def set_node_ready(env: Env, status: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cond = {
        "type": "Ready",
        "status": status,
        "reason": "KubeletReady" if status == "True" else "NodeStatusUnknown",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    env.cluster.kubectl(
        "patch",
        "node",
        NODE,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": [cond]}}),
    )


def test_a_lost_node_s_engine_is_evicted_though_its_gate_was_false(env: Env) -> None:
    apply(env.cluster, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    set_node_ready(env, "True")
    try:
        env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
        compat = str(env.workers["p0"].state()["compat_hash"])
        # A second prefill no engine can add (its metadata cannot be fetched): d0 has 1 of
        # the 2 partners it needs, so its gate stays False.
        hostile(env, "p9", "prefill", "--engine-id", "P9-unreachable", "--compat-hash", compat)
        d0 = env.pod("d0", "decode", env.worker("decode"), kv_gate=True, node=NODE)
        env.topology(readinessGate={"minConnectedPartners": 2})
        env.start_operator()
        env.wait("p0 holds d0", lambda: d0.engine_id in peers(env.workers["p0"]))
        env.wait("d0's gate False (1 of 2)", lambda: gate(env, "d0").get("status") == "False")
        # The node dies: its engine with it, and its Ready goes Unknown.
        d0.proc.kill()
        d0.proc.wait(10)
        lost = time.monotonic()
        set_node_ready(env, "Unknown")
        env.wait(
            "d0 evicted from p0 within the grace of the node's flip",
            lambda: d0.engine_id not in peers(env.workers["p0"]),
            timeout=GRACE + 10,
        )
        took = time.monotonic() - lost
        print(f"d0 evicted {took:.1f} s after its node's Ready flip (grace {GRACE} s)")
        assert took <= GRACE + 2 + 1.5, took
    finally:
        env.cluster.kubectl("delete", "node", NODE, "--wait=false", check=False)
