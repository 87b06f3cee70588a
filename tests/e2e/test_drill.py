"""The rollout churn drill end to end: a short run passes its invariants, and a run with an
injected fault (decode engines crash with requests in flight) fails and names them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.nixl]

LOOSE = 4
"""How far above a latency target a test lets a run go: the targets are judged by the drill's
report and the benchmarks; a test decides on correctness (issue 32: the suite passes on a
busy machine)."""


def drill(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    report = tmp_path / "drill.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtopo.cli",
            "drill",
            "--no-live",
            "--workdir",
            str(tmp_path / "w"),
            "--json",
            str(report),
            "--plot",
            str(tmp_path / "drill.png"),
            "--settle",
            "2",
            "--rollouts",
            "1",
            "--scale-to",
            "3",
            "--timeout",
            "300",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(report.read_text())


def test_short_drill_keeps_every_invariant(tmp_path: Path) -> None:
    out, report = drill(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert report["rollouts"] == 1 and report["requests_total"] >= 100
    assert report["lost"] == 0 and report["false_failures"] == 0
    assert report["duplicate_failure_reports"] == 0
    assert (
        report["completed"] + sum(report["failed_by_reason"].values()) == report["requests_total"]
    )
    assert report["verified_bytes"] == report["completed"] * 4 * 64 * 1024
    # Latencies are the drill's own targets (its report's `targets`; `--strict-targets`
    # fails on them); a test on a busy machine bounds them loosely, far above the target.
    assert report["convergence_s"] and max(report["convergence_s"]) <= 5 * LOOSE
    assert report["eviction_s"] and report["eviction_max_s"] <= (report["grace"] + 2) * LOOSE
    # The pods list the kv-connected readiness gate: each engine's pod turned Ready (routable)
    # soon after the engine served (target: 1 s, p99).
    assert report["gated_engines"] >= 6 + 3, report["gated_engines"]
    assert report["engine_up_to_gate_p99_s"] <= 1.0 * LOOSE
    assert [t["name"] for t in report["targets"]] == ["engine serving -> pod Ready p99 (s)"]
    assert (tmp_path / "drill.png").stat().st_size > 10_000


def test_drill_fails_and_lists_requests_when_an_invariant_breaks(tmp_path: Path) -> None:
    out, report = drill(tmp_path, "--fault", "crash-decode")
    if out.returncode == 0 and report["completed"] == report["requests_total"]:
        # The decodes crashed (killed without draining as their pods went) held no request
        # at that moment: the fault struck nothing, so there was no invariant to break (seen
        # once in CI). Struck again in a run of its own; it must then be caught.
        again = tmp_path / "again"
        again.mkdir()
        out, report = drill(again, "--fault", "crash-decode")
    assert out.returncode == 1, out.stdout[-3000:]
    assert report["lost"] > 0
    assert "an invariant broke" in out.stdout
    assert report["offending_requests"]["lost"][0] in out.stdout


@pytest.mark.parametrize("chaos", ["freeze-decode", "kill-prefill"])
def test_a_frozen_decode_or_a_killed_prefill_at_tp2_breaks_no_invariant(
    tmp_path: Path, chaos: str
) -> None:
    # The fault strikes requests surely in flight (parked: registered, KV not ready); those
    # of the struck engine may fail, explained, but both sides agree and no byte is wrong.
    out, report = drill(tmp_path, "--chaos", chaos, "--tp", "2")
    assert out.returncode == 0, out.stdout[-3000:]
    assert report["tp"] == 2
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    assert any("parked" in label or "held" in label for label in struck), struck
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["outcome_mismatch"] == 0, report["offending_requests"]["outcome_mismatch"]
    assert report["verified_bytes"] == report["completed"] * 4 * 64 * 1024 * 2


@pytest.mark.parametrize("chaos", ["leader-kill", "rotate-credentials"])
def test_a_killed_leader_or_a_credential_rotation_costs_no_request(
    tmp_path: Path, chaos: str
) -> None:
    # leader-kill: two operator replicas elect on a Lease; the holder is SIGKILLed
    # mid-rollout and the standby must have every pair connected within the Lease + 5 s.
    # rotate-credentials: both Secrets change pod by pod (new + old, then new) under traffic.
    out, report = drill(tmp_path, "--chaos", chaos)
    assert out.returncode == 0, out.stdout[-3000:]
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["failed_by_reason"] == {}, "neither fault may fail a request"
    assert report["stale_peers_at_end"] == 0
    assert report["gate_drops_while_connected"] == 0, report["gate_drop_list"]
    if chaos == "leader-kill":
        assert any(label.startswith("SIGKILL the leader") for label in struck), struck
        (took,) = report["leader_takeover_s"]
        assert took <= (report["lease_s"] + 5) * LOOSE, struck
    else:
        assert any("old key and token dropped" in label for label in struck), struck


def test_an_engine_restarted_in_its_pod_is_reconnected_with_no_manual_action(
    tmp_path: Path,
) -> None:
    # restart-engine: a prefill engine with requests in flight is SIGKILLed and started
    # again in the same pod (same IP, port and engine id, a new incarnation). Its peers'
    # NIXL agents of it are dead (remote disconnect): what it held fails there, with a
    # reason, explained; the operator re-handshakes every pair of it on its own.
    out, report = drill(tmp_path, "--chaos", "restart-engine")
    assert out.returncode == 0, out.stdout[-3000:]
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    assert any(label.startswith("restart prefill") and "held" in label for label in struck)
    assert any("serves again" in label and "incarnation" in label for label in struck), struck
    # Its decodes reported it dropped (NIXL: remote disconnect) while it was down.
    told = [m for label in struck if (m := re.search(r"(\d+)/(\d+) of its peers report", label))]
    assert told and told[0][1] == told[0][2] != "0", struck
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["outcome_mismatch"] == 0, report["offending_requests"]["outcome_mismatch"]
    assert set(report["failed_by_reason"]) <= {"registration_timeout", "push_reg_notif_failed"}
    assert report["failed_by_reason"], "the requests the killed engine held failed"
    # From the kill to every pair connected: mostly the new process's start (imports; 26 s
    # on a loaded 2-core machine), bounded loosely; the operator's part, from the new
    # process serving to every pair connected, is bounded on its own.
    (took,) = report["restart_recovery_s"]
    assert took <= 20 * LOOSE, struck
    served = [
        float(m[1]) for label in struck if (m := re.search(r"serves again after ([\d.]+) s", label))
    ]
    assert served and took - served[0] <= 5 * LOOSE, struck
    assert report["stale_peers_at_end"] == 0
    assert report["verified_bytes"] == report["completed"] * 4 * 64 * 1024


def test_a_failed_node_s_engines_are_evicted_within_the_grace_of_its_ready_flip(
    tmp_path: Path,
) -> None:
    # node-failure: the engines of one kwok node are SIGKILLed and its kubelet (kwok) goes
    # silent; the node lifecycle controller flips its Ready 20 s later (the drill's own
    # cluster's grace) and marks its pods not Ready (their ContainersReady stays True). On
    # 9cfedae the operator kept those engines (unreachable: "cannot tell") until the taint
    # eviction deleted the pods.
    out, report = drill(tmp_path, "--chaos", "node-failure")
    assert out.returncode == 0, out.stdout[-3000:]
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    assert any("Ready flipped" in label for label in struck), struck
    (took,) = report["node_failure_evicted_s"]
    assert took <= (report["grace"] + 2) * LOOSE, struck
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["outcome_mismatch"] == 0, report["offending_requests"]["outcome_mismatch"]
    assert report["stale_peers_at_end"] == 0


def test_a_hung_decode_costs_the_others_no_gate_and_no_convergence(tmp_path: Path) -> None:
    # hang-decode: one decode SIGSTOPped as the rollout begins, until a new engine was gated
    # meanwhile (60 s at most; a minute every time before, while the Deployment waited for
    # the hung pod: nothing more was tested then). On 9cfedae every
    # round waited for its read (the handshake deadline, 5 s): the other engines' gates and
    # convergence waited with it.
    out, report = drill(tmp_path, "--chaos", "hang-decode")
    assert out.returncode == 0, out.stdout[-3000:]
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    assert any(label.startswith("SIGSTOP decode") for label in struck), struck
    # The hang lasted until a new engine was connected and gated meanwhile (and a few
    # rounds more): what is measured happened while a peer hung.
    assert any(
        label.startswith("SIGCONT decode") and "a new engine gated" in label for label in struck
    ), struck
    assert report["engine_up_to_gate_p99_s"] <= 1.0 * LOOSE, report
    assert report["convergence_p99_s"] <= 5.0 * LOOSE, report
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["outcome_mismatch"] == 0, report["offending_requests"]["outcome_mismatch"]


# Each of these faults has its own test beside real workers in test_fail_static.py (the
# stalled API server and the clock 90 s ahead too); under a drill's traffic the default
# suite runs the one every `helm upgrade` makes, and KVTOPO_ALL_DRILLS=1 runs all three (a
# drill is a minute or more of the suite's hour).
OPERATOR_FAULTS = ["operator-upgrade"] + (
    ["apiserver-stall", "clock-skew"] if os.environ.get("KVTOPO_ALL_DRILLS") == "1" else []
)


@pytest.mark.parametrize("chaos", OPERATOR_FAULTS)
def test_the_operator_s_own_faults_change_nothing_it_controls(tmp_path: Path, chaos: str) -> None:
    # Fail-static (issue 54): the leader replaced three times as a rolling update does
    # (operator-upgrade), kube-apiserver frozen twice past the renew deadline
    # (apiserver-stall), the standby 90 s ahead taking over (clock-skew). On 7314fe4 the
    # first two turned the gates of connected engines False (NotSelected: 9 and 10 of them
    # in one run each) and the third never converged (every worker answered 401).
    out, report = drill(tmp_path, "--chaos", chaos)
    assert out.returncode == 0, out.stdout[-3000:]
    struck = [m["label"] for m in report["marks"] if m["kind"] == "chaos"]
    wanted = {
        "operator-upgrade": ("SIGTERM the leader", 3),
        "apiserver-stall": ("kube-apiserver SIGSTOP", 2),
        "clock-skew": ("90 s ahead takes over", 1),
    }[chaos]
    assert sum(wanted[0] in label for label in struck) == wanted[1], struck
    assert report["gate_drops_while_connected"] == 0, report["gate_drop_list"]
    for key in ("lost", "false_failures", "duplicate_failure_reports", "corrupted"):
        assert report[key] == 0, (key, report["offending_requests"])
    assert report["outcome_mismatch"] == 0 and report["stale_peers_at_end"] == 0
    assert report["failed_by_reason"] == {}, "no operator fault may fail a request"
