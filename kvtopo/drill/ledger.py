"""The drill's books: every request, every connectivity sample, and the invariants.

Owns the record of each request (pair, submit time, outcomes seen on each side), the
timeline of connected pairs sampled from the workers, rollout/chaos marks, and the report:
`lost` (submitted, never ended), `false_failures` (failed although its prefill and decode
engines were connected, and neither was going away, for the request's whole life),
`duplicate_failure_reports` (a second outcome for one request on one side), `corrupted`
(the decode received bytes that failed verification), `outcome_mismatch` (the prefill and
the decode report different outcomes for one request), verified bytes, convergence and
eviction times. A failure is explained, not false, when one of its engines was going away
or impaired (frozen, killed) during the request's life. Pure bookkeeping: no I/O, times
are given by the caller.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    request_id: str
    prefill: str  # engine ids
    decode: str
    submitted_at: float
    decode_outcomes: list[dict[str, Any]] = field(default_factory=list)
    prefill_outcomes: list[dict[str, Any]] = field(default_factory=list)
    ended_at: float | None = None


@dataclass
class Mark:
    t: float
    kind: str  # "rollout", "scale", "chaos", "phase"
    label: str


@dataclass
class Ledger:
    t0: float
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    samples_t: list[float] = field(default_factory=list)
    samples_pairs: list[frozenset[tuple[str, str]]] = field(default_factory=list)
    going: dict[str, float] = field(default_factory=dict)  # engine -> when it began to go
    # engine -> (from, to) windows in which it was impaired by a fault (frozen, killed)
    impaired: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    marks: list[Mark] = field(default_factory=list)
    convergence: list[tuple[str, float]] = field(default_factory=list)  # (engine, seconds)
    rollout_convergence: list[float] = field(default_factory=list)
    eviction: list[tuple[str, float]] = field(default_factory=list)
    orphan_outcomes: int = 0
    chaos_recovery_s: list[float] = field(default_factory=list)
    # --chaos leader-kill: from the leader's SIGKILL to the topology converged again
    leader_takeover_s: list[float] = field(default_factory=list)
    # --chaos restart-engine: from the engine's SIGKILL (restarted at once in its pod) to
    # every pair of the serving engines connected again (its new incarnation held both ways)
    restart_recovery_s: list[float] = field(default_factory=list)
    stale_peers_at_end: list[str] = field(default_factory=list)  # "holder -> gone engine"
    # The kv-connected readiness gate: (engine, when it and a partner both served, when its
    # pod was first seen Ready)
    gate: list[tuple[str, float, float]] = field(default_factory=list)
    gate_seen: set[str] = field(default_factory=set)
    # (from, to) of faults of the control plane (operator, API server, leader): from the
    # fault to the topology converged again. No gate can turn True then; an engine whose
    # wait overlaps one is reported apart, not held to the gate's p99.
    control_faults: list[tuple[float, float]] = field(default_factory=list)
    # --chaos abort-storm: requests an engine took an abort for (they may fail, with reason
    # aborted on the side aborted, and must agree), and the share of requests to abort.
    aborted: set[str] = field(default_factory=set)
    abort_share: float = 0.0
    late_writes: int = 0  # blocks written after their request ended, by drained engines
    abort_stages: dict[str, int] = field(default_factory=dict)  # drained engines' counts
    # --chaos node-failure: from the node's Ready flip to its engines evicted from every
    # peer, and the most that may take (the grace + 2 s).
    node_failure_evicted_s: list[float] = field(default_factory=list)
    node_failure_limit_s: float | None = None
    # --chaos hang-decode: the most the other engines' convergence p99 may be (seconds).
    convergence_p99_limit_s: float | None = None
    # Every time a pod's kv-connected gate went from True to False (not being deleted):
    # (when, pod, engine id, role, why the operator said). One of an engine connected to its
    # partners then is a drop the fail-static operator must never make.
    gate_drops: list[tuple[float, str, str, str, str]] = field(default_factory=list)

    # --- recording -------------------------------------------------------------------------

    def count_abort_stages(self, stages: dict[str, int]) -> None:
        """Adds a drained engine's counts of where aborts found its requests."""
        for stage, n in stages.items():
            self.abort_stages[stage] = self.abort_stages.get(stage, 0) + n

    def submitted(self, request_id: str, prefill: str, decode: str, t: float) -> None:
        self.requests[request_id] = RequestRecord(request_id, prefill, decode, t)

    def withdraw(self, request_id: str) -> None:
        """The decode side refused the request: it was never submitted."""
        rec = self.requests.get(request_id)
        if rec is not None and not rec.decode_outcomes:
            del self.requests[request_id]

    def outcome(self, side: str, outcome: dict[str, Any], t: float) -> None:
        rec = self.requests.get(outcome["request_id"])
        if rec is None:
            self.orphan_outcomes += 1
            return
        if side == "decode":
            rec.decode_outcomes.append(outcome)
            if rec.ended_at is None:
                rec.ended_at = t
        else:
            rec.prefill_outcomes.append(outcome)

    def sample(self, t: float, pairs: frozenset[tuple[str, str]]) -> None:
        self.samples_t.append(t)
        self.samples_pairs.append(pairs)

    def going_away(self, engine_id: str, t: float) -> None:
        self.going.setdefault(engine_id, t)

    def impair(self, engine_id: str, start: float, end: float) -> None:
        """A fault impaired the engine from `start` to `end` (its requests may fail)."""
        self.impaired.setdefault(engine_id, []).append((start, end))

    def impair_until(self, engine_id: str, start: float, end: float) -> None:
        """The impairment of the engine that began at `start` ends at `end` (a fault that
        ended sooner than first said)."""
        spans = self.impaired.get(engine_id, [])
        self.impaired[engine_id] = [(a, end if a == start else b) for a, b in spans]

    def mark(self, t: float, kind: str, label: str) -> None:
        self.marks.append(Mark(t, kind, label))

    def gate_dropped(self, t: float, pod: str, engine_id: str, role: str, cause: str) -> None:
        self.gate_drops.append((t, pod, engine_id, role, cause))

    def connected_at(self, engine_id: str, role: str, t: float) -> bool:
        """Whether the engine was connected to a partner (both ways) in the last sample at
        or before `t`, and was neither going away nor impaired by a fault then."""
        gone_at = self.going.get(engine_id)
        if not engine_id or (gone_at is not None and gone_at <= t):
            return False
        if any(a <= t <= b for a, b in self.impaired.get(engine_id, ())):
            return False
        i = bisect.bisect_right(self.samples_t, t) - 1
        if i < 0:
            return False
        side = 0 if role == "prefill" else 1
        return any(pair[side] == engine_id for pair in self.samples_pairs[i])

    # --- invariants ------------------------------------------------------------------------

    def in_flight(self) -> int:
        return sum(1 for r in self.requests.values() if r.ended_at is None)

    def connected_throughout(self, rec: RequestRecord) -> bool:
        """Both directions of the pair connected in every sample of the request's life,
        with samples on both sides of it, and neither engine going away meanwhile."""
        end = rec.ended_at if rec.ended_at is not None else rec.submitted_at
        for eid in (rec.prefill, rec.decode):
            gone_at = self.going.get(eid)
            if gone_at is not None and gone_at <= end:
                return False
            for start, stop in self.impaired.get(eid, ()):
                if start <= end and rec.submitted_at <= stop:
                    return False
        lo = bisect.bisect_right(self.samples_t, rec.submitted_at) - 1
        hi = bisect.bisect_left(self.samples_t, end)
        if lo < 0 or hi >= len(self.samples_t):
            return False
        pair = (rec.prefill, rec.decode)
        return all(pair in self.samples_pairs[i] for i in range(lo, hi + 1))

    def report(self) -> dict[str, Any]:
        done = [r for r in self.requests.values() if _status(r) == "done"]
        failed = [r for r in self.requests.values() if _status(r) == "failed"]
        lost = [r.request_id for r in self.requests.values() if not r.decode_outcomes]
        duplicates = [
            r.request_id
            for r in self.requests.values()
            if len(r.decode_outcomes) > 1 or len(r.prefill_outcomes) > 1
        ]
        false_failures = [
            r.request_id
            for r in failed
            if r.request_id not in self.aborted and self.connected_throughout(r)
        ]
        corrupted = [r.request_id for r in failed if _corrupted(r)]
        mismatched = [
            r.request_id
            for r in self.requests.values()
            if r.decode_outcomes
            and r.prefill_outcomes
            and r.decode_outcomes[0]["status"] != r.prefill_outcomes[0]["status"]
        ]
        by_reason = Counter(str(r.decode_outcomes[0].get("reason") or "unknown") for r in failed)
        conv = sorted(s for _, s in self.convergence)
        evict = sorted(s for _, s in self.eviction)
        gate = sorted(
            ready - up
            for _, up, ready in self.gate
            if not any(up <= end and ready >= start for start, end in self.control_faults)
        )
        drops = [
            {
                "t": round(t - self.t0, 3),
                "pod": pod,
                "engine": eid,
                "cause": cause,
                "connected": self.connected_at(eid, role, t),
            }
            for t, pod, eid, role, cause in self.gate_drops
        ]
        return {
            "rollouts": sum(1 for m in self.marks if m.kind == "rollout"),
            "requests_total": len(self.requests),
            "completed": len(done),
            "failed_by_reason": dict(sorted(by_reason.items())),
            "lost": len(lost),
            "false_failures": len(false_failures),
            "duplicate_failure_reports": len(duplicates),
            "corrupted": len(corrupted),
            "outcome_mismatch": len(mismatched),
            "verified_bytes": sum(int(r.decode_outcomes[0].get("verified_bytes", 0)) for r in done),
            "unverified_completions": sum(
                1 for r in done if not r.decode_outcomes[0].get("verified_bytes")
            ),
            "convergence_s": [round(s, 3) for s in self.rollout_convergence],
            "convergence_p99_s": round(_percentile(conv, 0.99), 3) if conv else None,
            "eviction_s": [round(s, 3) for s in evict],
            "eviction_max_s": round(max(evict), 3) if evict else None,
            "gated_engines": len(gate),
            "gated_during_control_fault": len(self.gate) - len(gate),
            "engine_up_to_gate_p99_s": round(_percentile(gate, 0.99), 3) if gate else None,
            "engine_up_to_gate_max_s": round(max(gate), 3) if gate else None,
            "orphan_outcomes": self.orphan_outcomes,
            "aborted": len(self.aborted),
            "aborted_share": round(len(self.aborted) / len(self.requests), 3)
            if self.requests
            else 0.0,
            "abort_share_wanted": self.abort_share,
            "late_writes": self.late_writes,
            "node_failure_evicted_s": [round(s, 3) for s in self.node_failure_evicted_s],
            "node_failure_limit_s": self.node_failure_limit_s,
            "convergence_p99_limit_s": self.convergence_p99_limit_s,
            "abort_stages": dict(sorted(self.abort_stages.items())),
            "chaos_recovery_s": [round(s, 3) for s in self.chaos_recovery_s],
            "leader_takeover_s": [round(s, 3) for s in self.leader_takeover_s],
            "restart_recovery_s": [round(s, 3) for s in self.restart_recovery_s],
            "gate_drops": len(drops),
            "gate_drops_while_connected": sum(1 for d in drops if d["connected"]),
            "gate_drop_list": drops[:50],
            "stale_peers_at_end": len(self.stale_peers_at_end),
            "stale_peer_list": self.stale_peers_at_end[:50],
            "offending_requests": {
                "lost": lost[:50],
                "false_failures": false_failures[:50],
                "duplicate_failure_reports": duplicates[:50],
                "corrupted": corrupted[:50],
                "outcome_mismatch": mismatched[:50],
            },
            "marks": [
                {"t": round(m.t - self.t0, 3), "kind": m.kind, "label": m.label} for m in self.marks
            ],
        }


def _status(rec: RequestRecord) -> str:
    if not rec.decode_outcomes:
        return "lost"
    return str(rec.decode_outcomes[0]["status"])


def _corrupted(rec: RequestRecord) -> bool:
    """The decode said its bytes failed verification (a WRITE landed wrong or late)."""
    first = rec.decode_outcomes[0]
    return first.get("reason") == "transfer_failed" and "verification" in str(
        first.get("message", "")
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


GATE_P99_LIMIT_S = 1.0
ABORTED_SHARE_MIN = 0.10


def invariants_hold(report: dict[str, Any]) -> bool:
    """Whether the run was correct: nothing lost, failed falsely, reported twice, corrupted
    or ended differently on its two sides, no stale peer left, no late write; an abort storm
    aborted what it was asked to; a node-failure run saw the lost node's engines evicted at
    all. Latencies are `targets`, judged apart (a busy machine slows them, it does not make
    a request lost)."""
    keys = (
        "lost",
        "false_failures",
        "duplicate_failure_reports",
        "corrupted",
        "outcome_mismatch",
        "unverified_completions",
        "stale_peers_at_end",
        "late_writes",
        "gate_drops_while_connected",
    )
    # --chaos abort-storm: at least 10% of the requests were aborted (at random stages).
    wanted = float(report.get("abort_share_wanted") or 0)
    aborts_ok = not wanted or float(report.get("aborted_share") or 0) >= ABORTED_SHARE_MIN
    # --chaos node-failure: a run that measured no eviction broke it.
    node_ok = report.get("node_failure_limit_s") is None or bool(
        report.get("node_failure_evicted_s")
    )
    return aborts_ok and node_ok and all(int(report.get(k) or 0) == 0 for k in keys)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's latency targets, each `{name, measured, limit, met}` (the slowest measure
    against its limit): the readiness gate's p99; with leader-kill, each take-over within
    the Lease + 5 s; with node-failure, the eviction within the grace + 2 s of the node's
    flip; with hang-decode, the other engines' convergence p99."""
    out: list[dict[str, Any]] = []

    def add(name: str, measured: float, limit: float) -> None:
        out.append({"name": name, "measured": measured, "limit": limit, "met": measured <= limit})

    add(
        "engine serving -> pod Ready p99 (s)",
        report.get("engine_up_to_gate_p99_s") or 0.0,
        GATE_P99_LIMIT_S,
    )
    takeovers = report.get("leader_takeover_s") or []
    if takeovers:
        add("leader take-over (s)", max(takeovers), float(report.get("lease_s") or 0) + 5)
    node_limit = report.get("node_failure_limit_s")
    evicted = report.get("node_failure_evicted_s") or []
    if node_limit is not None and evicted:
        add("lost node's engines evicted after the flip (s)", max(evicted), float(node_limit))
    conv_limit = report.get("convergence_p99_limit_s")
    if conv_limit is not None:
        add("convergence p99 (s)", report.get("convergence_p99_s") or 0.0, float(conv_limit))
    return out
