"""Peer health on the operator's side: a holder that reports a live peer dropped or failing
has the pair counted unconnected and a handshake planned (the worker renews the peer on
it), with one PeerUnhealthy Warning when that starts; a peer whose pod is gone is evicted
as before; the worker client reads the health tolerantly; the gather forgets an unhealthy
mark once the operator's own add succeeded. Pure tables through the real constructors, and
a real aiohttp server for the client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kvtopo_operator import workers as workers_module
from kvtopo_operator.api import KVTopologySpec, KVTopologyStatus
from kvtopo_operator.gather import WorkerViews
from kvtopo_operator.logic import (
    PEER_UNHEALTHY,
    evaluate,
)
from kvtopo_operator.model import (
    Eviction,
    Handshake,
    Memory,
    Observed,
    Plan,
    PodView,
    WorkerUnreachable,
    WorkerView,
)
from tests.operator.test_workers import read_state

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SPEC = KVTopologySpec.model_validate(
    {
        "prefill": {"selector": {"matchLabels": {"app": "llama", "kvtopo.dev/role": "prefill"}}},
        "decode": {"selector": {"matchLabels": {"app": "llama", "kvtopo.dev/role": "decode"}}},
        "eviction": {"graceSeconds": 10},
    }
)


def pod(name: str, role: str) -> PodView:
    return PodView(
        name=name,
        role=role,
        labels={"app": "llama", "kvtopo.dev/role": role},
        ready=True,
        deleting=False,
        endpoint=f"10.0.0.{len(name)}:{8000 + sum(map(ord, name))}",
    )


PODS = [pod("p0", "prefill"), pod("d0", "decode"), pod("d1", "decode")]


def mesh(**unhealthy: dict[str, str]) -> dict[str, WorkerView | WorkerUnreachable]:
    """Every pair held both ways (incarnation "i-<engine>"); `unhealthy[pod]` is what that
    pod's worker reports unhealthy."""
    peers = {"p0": {"D0", "D1"}, "d0": {"P0"}, "d1": {"P0"}}
    ids = {"p0": "P0", "d0": "D0", "d1": "D1"}
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    return {
        name: WorkerView(
            engine_id=ids[name],
            role=roles[name],
            compat_hash="h",
            peers=frozenset(peers[name]),
            incarnation=f"i-{ids[name]}",
            peer_incarnations={p: f"i-{p}" for p in peers[name]},
            unhealthy_peers=unhealthy.get(name, {}),
        )
        for name in ids
    }


def plan_of(
    workers: dict[str, WorkerView | WorkerUnreachable],
    memory: Memory | None = None,
    pods: list[PodView] | None = None,
    previous: KVTopologyStatus | None = None,
    now: datetime = T0,
) -> Plan:
    return evaluate(
        Observed(
            generation=1,
            spec=SPEC,
            pods=tuple(PODS if pods is None else pods),
            workers=workers,
            previous=previous or KVTopologyStatus(),
            memory=memory or Memory(),
        ),
        now,
    )


def warnings(plan: Plan) -> list[str]:
    return [e.message for e in plan.events if e.reason == PEER_UNHEALTHY]


def test_a_holder_reporting_a_peer_unhealthy_gets_a_handshake_for_it_and_one_warning() -> None:
    healthy = plan_of(mesh())
    assert healthy.handshakes == () and healthy.pairs_connected == 2
    # d0 reports the prefill dropped: only d0's half of (P0, D0) is planned again, with the
    # prefill's identity (the worker renews it on this add).
    why = "dropped: send_notif to kvtopo-P0-r0: NIXL_ERR_REMOTE_DISCONNECT"
    plan = plan_of(mesh(d0={"P0": why}), memory=healthy.memory)
    p0, d0 = PODS[0], PODS[1]
    assert plan.handshakes == (
        Handshake("d0", d0.endpoint, "P0", p0.endpoint, "prefill", "", "i-P0", "D0"),
    )
    assert plan.pairs_connected == 1 and plan.progress.missing == {("P0", "D0")}
    assert plan.unhealthy_peers == {("D0", "P0")}
    ready = next(c for c in plan.status.conditions if c.type.value == "Ready")
    assert (ready.status, ready.reason) == ("False", "PairsMissing")
    (told,) = warnings(plan)
    assert "d0 reports p0 (engine P0) dropped" in told and "REMOTE_DISCONNECT" in told
    assert next(e for e in plan.events if e.reason == PEER_UNHEALTHY).type == "Warning"
    # Still unhealthy next round (the renewal is still ending): planned again, no new Event.
    again = plan_of(mesh(d0={"P0": why}), memory=plan.memory, previous=plan.status)
    assert again.handshakes == plan.handshakes and warnings(again) == []
    # p0 now reports D1 failing as well: a Warning for that pair only.
    both = plan_of(mesh(d0={"P0": why}, p0={"D1": "failing: WRITE timed out"}), memory=again.memory)
    assert {h.pod for h in both.handshakes} == {"d0", "p0"}
    (told,) = warnings(both)
    assert "p0 reports d1 (engine D1) failing" in told and "d0 reports" not in told
    # Renewed: healthy, connected, quiet; unhealthy again later: a Warning again.
    healed = plan_of(mesh(), memory=both.memory)
    assert healed.handshakes == () and warnings(healed) == [] and healed.unhealthy_peers == set()
    assert len(warnings(plan_of(mesh(d0={"P0": why}), memory=healed.memory))) == 1


def test_an_unhealthy_peer_whose_pod_is_gone_is_evicted_not_handshaked() -> None:
    first = plan_of(mesh())
    workers = mesh(d0={"P0": "dropped: gone"}, d1={"P0": "dropped: gone"})
    del workers["p0"]
    pods = PODS[1:]  # the prefill's pod was deleted
    gone = plan_of(workers, memory=first.memory, pods=pods, previous=first.status)
    assert gone.handshakes == () and gone.evictions == ()
    assert warnings(gone) == [], "a gone peer is not re-handshaked"
    later = plan_of(
        workers,
        memory=gone.memory,
        pods=pods,
        previous=gone.status,
        now=T0 + timedelta(seconds=11),
    )
    assert set(later.evictions) == {
        Eviction("d0", PODS[1].endpoint, "P0"),
        Eviction("d1", PODS[2].endpoint, "P0"),
    }


def test_the_client_reads_dropped_and_failing_and_takes_an_unknown_health_for_ok(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers_module, "_unknown_health_seen", set())  # a fresh process

    def peer(eid: str, **extra: Any) -> dict[str, Any]:
        return {
            "engine_id": eid,
            "agents": {"0": f"a-{eid}"},
            "transfers_in_flight": 0,
            "eviction_pending": False,
            "idle_s": 0.0,
            "incarnation": f"i-{eid}",
            **extra,
        }

    state = {
        "engine_id": "D0",
        "role": "decode",
        "compat_hash": "h",
        "protocol_version": 4,
        "peers": [
            peer("P0", health="dropped", health_reason="NIXL_ERR_REMOTE_DISCONNECT"),
            peer("P1", health="failing", health_reason=""),
            peer("P2", health="ok"),
            peer("P3"),  # a worker that predates peer health
            peer("P4", health="wobbly", health_reason="a newer worker's notion"),
            peer("P5", health="wobbly"),
        ],
        "failures": {},
        "requests_done": 0,
        "requests_failed": 0,
        "requests_in_flight": 0,
        "started_at": 0.0,
    }

    def body() -> object:
        return read_state(state, 2.0)

    with caplog.at_level(logging.WARNING, logger="kvtopo_operator.workers"):
        view = body()
    assert isinstance(view, WorkerView), view
    assert view.unhealthy_peers == {"P0": "dropped: NIXL_ERR_REMOTE_DISCONNECT", "P1": "failing"}
    assert view.peers == {"P0", "P1", "P2", "P3", "P4", "P5"}
    logged = [r.getMessage() for r in caplog.records if "wobbly" in r.getMessage()]
    assert len(logged) == 1, "an unknown health value is logged once"


def test_the_gather_forgets_an_unhealthy_mark_once_the_operators_add_succeeded() -> None:
    views = {"d0": mesh(d0={"P0": "dropped: x"})["d0"]}

    async def read(
        endpoint: str, timeout_s: float, known: WorkerView | None = None, pod_uid: str = ""
    ) -> WorkerView | WorkerUnreachable:
        return views["d0"]

    gather = WorkerViews(read, max_age_s=60.0, clock=lambda: 0.0)
    seen = asyncio.run(gather.gather([PODS[1]], concurrency=1, timeout_s=1.0))
    assert isinstance(seen["d0"], WorkerView) and seen["d0"].unhealthy_peers
    gather.peer_added("d0", "P0", "i-P0")
    cached = gather.view("d0")
    assert isinstance(cached, WorkerView)
    assert dataclasses.replace(cached, unhealthy_peers={}) == cached
    assert cached.peer_incarnations["P0"] == "i-P0"
