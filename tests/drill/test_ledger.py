"""The drill's books: which requests count as lost, falsely failed, corrupted or mismatched,
and which failures a fault explains. Pure bookkeeping, given times."""

from __future__ import annotations

from typing import Any

from kvtopo.drill.ledger import Ledger, invariants_hold, targets

PAIR = frozenset({("p1", "d1")})


def outcome(rid: str, status: str, reason: str | None = None, message: str = "") -> dict[str, Any]:
    return {"request_id": rid, "status": status, "reason": reason, "message": message}


def ledger_with_samples() -> Ledger:
    ledger = Ledger(t0=0.0)
    for t in range(0, 101, 1):
        ledger.sample(float(t), PAIR)
    return ledger


def test_corrupted_and_mismatched_requests_are_counted_and_break_the_invariants() -> None:
    ledger = ledger_with_samples()
    for rid in ("ok", "corrupt", "mismatch", "both-failed", "prefill-unknown"):
        ledger.submitted(rid, "p1", "d1", 10.0)
    ledger.outcome("decode", {**outcome("ok", "done"), "verified_bytes": 8}, 11.0)
    ledger.outcome("prefill", outcome("ok", "done"), 11.0)
    bad = outcome("corrupt", "failed", "transfer_failed", "2 blocks failed verification")
    ledger.outcome("decode", bad, 11.0)
    ledger.outcome("prefill", outcome("corrupt", "done"), 11.0)
    ledger.outcome("decode", outcome("mismatch", "failed", "registration_timeout"), 12.0)
    ledger.outcome("prefill", outcome("mismatch", "done"), 12.0)
    ledger.outcome("decode", outcome("both-failed", "failed", "registration_timeout"), 12.0)
    ledger.outcome("prefill", outcome("both-failed", "failed", "registration_timeout"), 12.0)
    ledger.outcome("decode", {**outcome("prefill-unknown", "done"), "verified_bytes": 8}, 12.0)
    report = ledger.report()
    assert report["corrupted"] == 1
    assert report["offending_requests"]["corrupted"] == ["corrupt"]
    # "corrupt" disagrees too (the prefill wrote it, the decode refused its bytes).
    assert sorted(report["offending_requests"]["outcome_mismatch"]) == ["corrupt", "mismatch"]
    assert report["outcome_mismatch"] == 2
    assert not invariants_hold(report)


def test_a_failure_during_a_fault_on_its_engine_is_explained_not_false() -> None:
    ledger = ledger_with_samples()
    ledger.submitted("frozen", "p1", "d1", 20.0)
    ledger.submitted("before", "p1", "d1", 5.0)
    ledger.impair("d1", 19.0, 40.0)
    ledger.outcome("decode", outcome("frozen", "failed", "registration_timeout"), 30.0)
    ledger.outcome("decode", outcome("before", "failed", "registration_timeout"), 8.0)
    report = ledger.report()
    assert report["offending_requests"]["false_failures"] == ["before"]


def test_a_slow_readiness_gate_misses_its_target_and_breaks_no_invariant() -> None:
    ledger = ledger_with_samples()
    ledger.gate.extend((f"e{i}", 10.0, 10.2) for i in range(10))
    report = ledger.report()
    assert report["gated_engines"] == 10 and report["engine_up_to_gate_p99_s"] == 0.2
    assert invariants_hold(report) and all(t["met"] for t in targets(report))
    ledger.gate.append(("slow", 20.0, 21.5))
    report = ledger.report()
    assert report["engine_up_to_gate_p99_s"] == 1.5 and report["engine_up_to_gate_max_s"] == 1.5
    # Latency is a target (a busy machine is slow; no request was lost): judged apart.
    assert invariants_hold(report)
    [gate] = targets(report)
    assert gate == {
        "name": "engine serving -> pod Ready p99 (s)",
        "measured": 1.5,
        "limit": 1.0,
        "met": False,
    }


def test_the_chaos_targets_are_judged_by_their_own_limits() -> None:
    report = ledger_with_samples().report()
    report.update(
        lease_s=4,
        leader_takeover_s=[3.0, 9.5],
        node_failure_limit_s=5.0,
        node_failure_evicted_s=[2.4],
        convergence_p99_limit_s=5.0,
        convergence_p99_s=6.0,
    )
    met = {t["name"]: t["met"] for t in targets(report)}
    assert met == {
        "engine serving -> pod Ready p99 (s)": True,
        "leader take-over (s)": False,  # 9.5 > 4 + 5
        "lost node's engines evicted after the flip (s)": True,
        "convergence p99 (s)": False,
    }
    assert invariants_hold(report)
    report["node_failure_evicted_s"] = []  # the lost node's engines were never evicted
    assert not invariants_hold(report)


def test_a_gate_held_up_by_a_control_plane_fault_is_reported_apart() -> None:
    ledger = ledger_with_samples()
    ledger.gate.extend([("before", 5.0, 5.3), ("during", 19.0, 31.0), ("after", 40.0, 40.4)])
    ledger.control_faults.append((20.0, 35.0))  # the operator killed, back and converged
    report = ledger.report()
    assert report["gated_engines"] == 2 and report["gated_during_control_fault"] == 1
    assert report["engine_up_to_gate_max_s"] == 0.4
    assert invariants_hold(report)


def test_a_gate_dropped_while_its_engine_was_connected_breaks_the_invariant() -> None:
    """`gate_drops_while_connected`: a gate that turned False while its engine held a
    partner (in the last sample before the drop) and was neither going away nor impaired."""
    ledger = ledger_with_samples()
    prefill, decode = next(iter(PAIR))
    ledger.gate_dropped(10.5, "d0", decode, "decode", "NotSelected: no KVTopology selects it")
    assert invariants_hold(ledger.report()) is False
    report = ledger.report()
    assert report["gate_drops"] == 1 and report["gate_drops_while_connected"] == 1
    assert report["gate_drop_list"][0]["cause"].startswith("NotSelected")
    # Going away, impaired, or with no partner then: a drop, but not of a connected engine.
    calm = ledger_with_samples()
    calm.going_away(decode, 10.0)
    calm.gate_dropped(10.5, "d0", decode, "decode", "EngineNotUsable: being deleted")
    calm.impair(prefill, 20.0, 30.0)
    calm.gate_dropped(25.0, "p0", prefill, "prefill", "EngineNotUsable: frozen")
    calm.gate_dropped(50.0, "d9", "D9", "decode", "NoPartner")
    report = calm.report()
    assert report["gate_drops"] == 3 and report["gate_drops_while_connected"] == 0
    assert invariants_hold(report)
