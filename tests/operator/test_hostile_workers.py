"""One worker's answer cannot wedge its topology: every field the worker protocol lets a
worker send, at its limit or beyond, is read by the real `WorkerClient` from a real HTTP
server and handed to `evaluate` beside healthy engines. The round completes: the gone engine
is evicted, the new one connected, the hostile engine alone is Failed with the reason (or
its value clamped), and the status validates as the API server will check it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from kvtopo_operator.api import EngineState, KVTopologyStatus, dump
from kvtopo_operator.logic import admissions, evaluate
from kvtopo_operator.model import Eviction, WorkerView
from tests.operator.test_logic import SPEC, T0, full_mesh, observe, pod, worker
from tests.operator.test_workers import read_state


def answer(**fields: Any) -> dict[str, Any]:
    """A decode worker's /v1/state (engine D3, paired with both prefills) with `fields`."""
    state: dict[str, Any] = {
        "engine_id": "D3",
        "role": "decode",
        "compat_hash": "hash",
        "peers": [{"engine_id": "P0"}, {"engine_id": "P1"}],
        "failures": {"transfer_failed": 1},
        "last_failure": {"time": 1_700_000_000.0, "type": "transfer_failed", "message": "x"},
    }
    state.update(fields)
    return state


HOSTILE = {
    # The protocol allows a 480-character message; the operator prefixed "peer <id>: ".
    "long_message": answer(
        last_failure={
            "time": 1_700_000_000.0,
            "type": "transfer_failed",
            "engine_id": "P" * 256,
            "message": "m" * 480,
        }
    ),
    "time_1e20": answer(
        last_failure={"time": 1e20, "type": "transfer_failed", "message": "from the future"}
    ),
    "negative_time": answer(
        last_failure={"time": -1e12, "type": "transfer_failed", "message": "from the past"}
    ),
    "counter_past_uint64": answer(failures={"transfer_failed": 2**64 + 5}),
    "negative_counter": answer(failures={"transfer_failed": -7}),
    "engine_id_300": answer(engine_id="D" * 300),
    "compat_hash_100": answer(compat_hash="h" * 100),
    "unknown_role": answer(role="router"),
    # More peers than any topology gives an engine (600,000 cost a 45 s round).
    "peers_16385": answer(peers=[{"engine_id": f"X{i}"} for i in range(16_385)]),
}
REFUSED = {
    "peers_16385": "16385 peers",
    "engine_id_300": "engine id",
    "compat_hash_100": "compatibility hash",
    "unknown_role": "role",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_one_workers_field_costs_its_engine_only(case: str) -> None:
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    # This round: D2's pod is gone (its eviction falls due), d3 is new and hostile, d4 new.
    pods2 = [p for p in pods if p.name != "d2"] + [pod("d3", "decode"), pod("d4", "decode")]
    workers2 = {k: v for k, v in workers.items() if k != "d2"}
    workers2["d3"] = read_state(HOSTILE[case])
    workers2["d4"] = worker("D4", "decode")
    mid = evaluate(observe(pods2, workers2, before), T0 + timedelta(seconds=1)).status
    plan = evaluate(observe(pods2, workers2, mid), T0 + timedelta(seconds=20))

    assert Eviction("p0", pods[0].endpoint, "D2") in plan.evictions
    assert {(h.pod, h.peer_engine_id) for h in plan.handshakes} >= {("p0", "D4"), ("d4", "P0")}
    # What the API server would check: the status validates, its counters fit uint64.
    KVTopologyStatus.model_validate(dump(plan.status))
    assert all(0 <= n < 2**63 for n in plan.status.failures.counts.values()), plan.status
    d3 = next(e for e in plan.status.engines if e.pod == "d3")
    if case in REFUSED:
        assert d3.state == EngineState.FAILED and REFUSED[case] in d3.message, d3
    else:  # clamped, and paired like any other engine
        assert isinstance(workers2["d3"], WorkerView)
        assert d3.state == EngineState.HANDSHAKING, d3
        assert ("p0", "D3") in {(h.pod, h.peer_engine_id) for h in plan.handshakes}
    last = plan.status.failures.last
    if last is not None:
        assert len(last.message) <= 512 and last.time.startswith("20"), last


def test_what_workers_make_up_grows_no_memory_of_the_operator() -> None:
    """Peer health values and failure types the operator does not know are logged once
    each, within a bound, whatever a worker invents: unknown health reads as ok."""
    from kvtopo_operator import workers as client

    peers = [{"engine_id": f"P{i}", "health": f"weird-{i}-" + "x" * 5000} for i in range(300)]
    failures = {f"made-up-{i}-" + "y" * 5000: 1 for i in range(600)}
    view = read_state(answer(peers=peers, failures=failures))
    assert isinstance(view, WorkerView) and view.unhealthy_peers == {}
    assert view.failures == {"other": 600}
    assert len(client._unknown_health_seen) <= 64
    assert len(client._unknown_failures_seen) <= 256
    assert max(map(len, client._unknown_health_seen | client._unknown_failures_seen)) <= 64


def test_a_pod_whose_worker_reports_a_held_engine_id_is_refused_and_the_holder_kept() -> None:
    """A pod whose worker reports another engine's id (a copy-paste, or an attacker taking
    the victim's KV; ids are public): the engine that held the id keeps it and stays
    connected; the newcomer is Failed with DuplicateEngineId and one Event naming both pods,
    Degraded says so, nothing is handshaken under that id at the newcomer's endpoint, and
    nothing drops out of the status. On 7314fe4 both were Failed (the victim knocked out)."""
    from tests.operator.test_logic import cond

    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    pods2 = [*pods, pod("d9", "decode")]
    workers2 = {**workers, "d9": worker("D1", "decode")}  # d1's engine id
    plan = evaluate(observe(pods2, workers2, before), T0 + timedelta(seconds=1))
    by_pod = {e.pod: e for e in plan.status.engines}
    assert by_pod["d1"].state == EngineState.CONNECTED, by_pod["d1"]
    assert by_pod["d9"].state == EngineState.FAILED, by_pod["d9"]
    assert "held by pod d1" in by_pod["d9"].message and "pod d9" in by_pod["d9"].message
    assert cond(plan.status, "Degraded") == ("True", "DuplicateEngineId")
    assert [e.reason for e in plan.events] == ["DuplicateEngineId"]
    assert "d1" in plan.events[0].message and "d9" in plan.events[0].message
    assert all(h.pod != "d9" and h.endpoint != pods2[-1].endpoint for h in plan.handshakes)
    assert all(h.peer_endpoint != pods2[-1].endpoint for h in plan.handshakes)
    assert plan.evictions == ()
    # The same rule pairs arrivals between rounds: d9 is not admitted, under the id d1 held.
    live = {eid: name for name, eid in plan.progress.live}
    assert live["D1"] == "d1"
    assert admissions(SPEC, pods2, workers2, {"d9"}, live) == ()
    # Resolved (d9 goes): nothing changed for d1, no Event.
    again = evaluate(observe(pods, workers, plan.status), T0 + timedelta(seconds=2))
    assert next(e for e in again.status.engines if e.pod == "d1").state == EngineState.CONNECTED
    assert cond(again.status, "Degraded") == ("False", "Healthy")
    assert again.events == ()


def test_counts_are_over_every_engine_and_a_restart_counts_no_failure_twice() -> None:
    """4 prefills x 2,100 decodes, all connected, each worker having counted 5 failures:
    the status lists what its bounds allow and says how many it left out, but the summary
    and the counters are over every engine; an operator restarted on that status (no
    memory) counts nobody's failures again."""
    from kvtopo_operator.logic import evaluate as decide
    from kvtopo_operator.model import Memory, Observed

    n_p, n_d = 4, 2100
    ps = {f"P{i}" for i in range(n_p)}
    ds = {f"D{i}" for i in range(n_d)}
    pods = [pod(f"p{i}", "prefill") for i in range(n_p)] + [
        pod(f"d{i}", "decode") for i in range(n_d)
    ]
    bad = {"transfer_failed": 5}
    workers: dict[str, object] = {
        f"p{i}": worker(f"P{i}", "prefill", ds, failures=bad) for i in range(n_p)
    }
    workers |= {f"d{i}": worker(f"D{i}", "decode", ps, failures=bad) for i in range(n_d)}
    first = decide(observe(pods, workers), T0)
    status = first.status
    assert (status.summary.prefill, status.summary.decode) == (f"{n_p}/{n_p}", f"{n_d}/{n_d}")
    assert len(status.engines) + status.engines_omitted == n_p + n_d
    assert status.engines_omitted > 0
    assert status.failures.counts == {"transfer_failed": 5 * (n_p + n_d)}
    written = KVTopologyStatus.model_validate(dump(status))  # what a restarted operator reads
    restarted = Observed(
        generation=3,
        spec=observe(pods, workers).spec,
        pods=tuple(pods),
        workers=workers,  # type: ignore[arg-type]
        previous=written,
        memory=Memory(),
    )
    again = decide(restarted, T0 + timedelta(seconds=5))
    assert again.status.failures.counts == {"transfer_failed": 5 * (n_p + n_d)}
    assert not [e for e in again.events if e.reason == "TransferFailures"]


def test_the_status_stays_within_its_byte_budget_whatever_the_messages() -> None:
    """2,100 engines whose workers all fail with the longest message a line carries: the
    status stays well under etcd's request limit (1.5 MiB) and says what it left out."""
    import json

    from kvtopo_operator.model import WorkerUnreachable

    pods = [pod(f"d{i:04d}-" + "x" * 200, "decode") for i in range(2100)]
    workers = {p.name: WorkerUnreachable("m" * 600) for p in pods}
    status = evaluate(observe(pods, workers), T0).status  # type: ignore[arg-type]
    size = len(json.dumps(dump(status)))
    assert size < 1 << 20, size
    assert status.engines_omitted == 2100 - len(status.engines) > 0
