"""Conditions that tell the truth, on a real API server with real workers: an engine with no
partner keeps Ready from True (and `kubectl get kvt` counts it as not connected), and a
worker that refuses the operator's key (a rotation gone wrong: its ConfigMap lost the key the
operator signs with) is Failed with the refusal, never paired, the topology Degraded with
one Event. `kubectl get/describe kvt` are printed."""

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


def test_a_worker_that_refuses_the_operators_key_is_failed_and_never_paired(
    env: Env, tmp_path: Path
) -> None:
    """No engine shares a credential with another any more (the old form of this test gave a
    decode another peer token, so its handshakes kept failing): the one credential an engine
    can lose is the operator's public key. d0's key file holds only a key the operator does
    not have, so it answers every call 401 with its challenge; the operator reports it and
    never pairs it, and keeps its peer p0 apart from it."""
    from kvtopo_worker.signing import new_private_key, public_pem

    stranger = tmp_path / "stranger.pem"
    stranger.write_text(public_pem(new_private_key()))
    p0 = env.pod("p0", "prefill", env.worker("prefill"))
    d0 = env.pod("d0", "decode", env.worker("decode", "--operator-key-file", str(stranger)))
    env.topology()
    env.start_operator()
    st = env.wait(
        "d0 Failed with the refusal, the topology Degraded",
        lambda: (
            (s := env.status())
            and any(
                e["pod"] == "d0" and e["state"] == "Failed" and "HTTP 401" in e["message"]
                for e in s.get("engines", [])
            )
            and condition(s, "Degraded")[0] == "True"
            and s
        ),
        timeout=60,
    )
    _, reason, message = condition(st, "Degraded")
    assert reason == "WorkerUnreachable" and "d0" in message, (reason, message)
    assert condition(st, "Ready")[0] == "False"
    assert st["summary"]["pairs"] == "0/0" or not st["summary"]["pairs"].startswith("1/")
    assert peers(p0) == set()
    # A key d0 does not know, not a forgery: counted apart, no failure of d0's own.
    assert d0.rejected("control_auth") == 0 and d0.rejected("unknown_key") > 0

    def unreachable_events() -> list[str]:
        lines: list[str] = env.cluster.kubectl(
            "get",
            "events",
            "-n",
            env.namespace,
            "--field-selector",
            "reason=WorkerUnreachable",
            "-o",
            "jsonpath={range .items[*]}{.message}{'\\n'}{end}",
        ).stdout.splitlines()
        return lines if any("d0" in e for e in lines) else []

    events = env.wait("the WorkerUnreachable Event of d0", unreachable_events)
    assert len(events) <= 2, events  # said once (rate-limited), not once a round
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
