"""Conditions that tell the truth, on a real API server with real workers: an engine with no
partner keeps Ready from True (and `kubectl get kvt` counts it as not connected), and a
handshake that keeps failing (here: a decode given another peer credential, so every
metadata fetch is refused) makes the topology Degraded=True HandshakeFailed once the
progress deadline has passed, with one Event. `kubectl get/describe kvt` are printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.env import Env, peers

pytestmark = pytest.mark.nixl


def condition(st: dict[str, Any], kind: str) -> tuple[str, str, str]:
    c = next((c for c in st.get("conditions", []) if c["type"] == kind), None)
    return ("", "", "") if c is None else (c["status"], c["reason"], c.get("message", ""))


def show(env: Env) -> str:
    printed = env.cluster.kubectl("get", "kvt", "-n", env.namespace).stdout
    described = env.cluster.kubectl("describe", "kvt", "llama", "-n", env.namespace).stdout
    print(f"$ kubectl get kvt\n{printed}\n$ kubectl describe kvt llama\n{described}")
    return printed


def test_a_decode_with_no_partner_keeps_ready_false(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.pod("d1", "decode", env.worker("decode"), version="v2")  # no v2 prefill
    env.topology()
    env.start_operator()
    st = env.wait(
        "the v1 pair connected and the v2 decode reported",
        lambda: (
            (s := env.status())
            and s.get("summary", {}).get("pairs") == "1/1"
            and condition(s, "Ready")[1] == "EnginesUnpaired"
            and s
        ),
    )
    status, reason, message = condition(st, "Ready")
    assert (status, reason) == ("False", "EnginesUnpaired") and "d1" in message, message
    assert st["summary"] == {"prefill": "1/1", "decode": "1/2", "pairs": "1/1"}
    printed = show(env)
    assert "1/2" in printed and "False" in printed


def test_a_handshake_that_keeps_failing_degrades_the_topology(env: Env, tmp_path: Path) -> None:
    wrong = tmp_path / "other-peer-token"
    wrong.write_text("a-peer-token-nobody-else-has\n")
    env.pod("p0", "prefill", env.worker("prefill"))
    # This decode presents, and accepts, a peer credential no other engine has: every
    # metadata fetch between it and the prefill is refused (401), round after round.
    env.pod("d0", "decode", env.worker("decode", "--peer-token-file", str(wrong)))
    env.topology(handshake={"progressDeadlineSeconds": 3})
    env.start_operator()
    st = env.wait(
        "Degraded=True HandshakeFailed",
        lambda: (s := env.status()) and condition(s, "Degraded")[1] == "HandshakeFailed" and s,
        timeout=60,
    )
    status, _, message = condition(st, "Degraded")
    assert status == "True" and "HTTP 401" in message, message
    assert condition(st, "Ready")[0] == "False"
    assert condition(st, "Progressing")[:2] == ("True", "Handshaking")
    assert peers(env.workers["p0"]) == set() and peers(env.workers["d0"]) == set()

    def handshake_events() -> list[str]:
        # Events are posted off the reconcile path: shortly after the status says so.
        lines: list[str] = env.cluster.kubectl(
            "get",
            "events",
            "-n",
            env.namespace,
            "--field-selector",
            "reason=HandshakeFailed",
            "-o",
            "jsonpath={range .items[*]}{.message}{'\\n'}{end}",
        ).stdout.splitlines()
        return lines if any("past the progress deadline" in e for e in lines) else []

    events = env.wait("the HandshakeFailed Event of the deadline", handshake_events)
    # One Event per handshake when it starts failing and one when the topology turns
    # Degraded, not one per round.
    degraded_events = [e for e in events if "past the progress deadline" in e]
    assert len(degraded_events) == 1, events
    assert len(events) <= 3, events
    show(env)


def test_a_pairing_label_change_removes_the_old_connection_after_the_grace(env: Env) -> None:
    """Level-based pairing: d0 is relabelled v1 -> v2 (no v2 prefill): its connection with
    the v1 prefill is evicted on both sides after the grace, and d0 is reported unpaired."""
    p0 = env.pod("p0", "prefill", env.worker("prefill"))
    d0 = env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: peers(p0) == {d0.engine_id} and peers(d0) == {p0.engine_id})
    env.cluster.kubectl("label", "pod", "d0", "-n", env.namespace, "version=v2", "--overwrite")
    env.wait(
        "the stale pair evicted on both sides",
        lambda: peers(p0) == set() and peers(d0) == set(),
        timeout=30,
    )
    st = env.wait(
        "d0 reported without a partner",
        lambda: (s := env.status()) and condition(s, "Ready")[1] == "EnginesUnpaired" and s,
    )
    assert "d0" in condition(st, "Ready")[2]
    assert st["summary"]["pairs"] == "0/0"
