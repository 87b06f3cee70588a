"""The operator's pure decisions: tables of observed states and Hypothesis properties."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo_operator.api import (
    EngineState,
    EngineStatus,
    KVTopologySpec,
    KVTopologyStatus,
    dump,
)
from kvtopo_operator.logic import (
    evaluate,
    settle,
)
from kvtopo_operator.model import (
    Eviction,
    FailingHandshake,
    FailureView,
    Handshake,
    Memory,
    Observed,
    PodView,
    SetIdleTTL,
    WorkerUnreachable,
    WorkerView,
    precise,
    rfc3339,
)

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SPEC = KVTopologySpec.model_validate(
    {
        "prefill": {"selector": {"matchLabels": {"app": "llama", "kvtopo.dev/role": "prefill"}}},
        "decode": {"selector": {"matchLabels": {"app": "llama", "kvtopo.dev/role": "decode"}}},
        "pairing": {"matchLabels": ["version"]},
        "eviction": {"graceSeconds": 10},
    }
)


def pod(name: str, role: str, version: str = "v1", ready: bool = True) -> PodView:
    return PodView(
        name=name,
        role=role,
        labels={"app": "llama", "version": version, "kvtopo.dev/role": role},
        ready=ready,
        deleting=False,
        endpoint=f"127.0.0.1:{9000 + hash(name) % 1000}",
    )


def worker(
    eid: str, role: str, peers: set[str] = frozenset(), h: str = "hash", **kw: object
) -> WorkerView:  # type: ignore[assignment]
    return WorkerView(engine_id=eid, role=role, compat_hash=h, peers=frozenset(peers), **kw)  # type: ignore[arg-type]


def observe(
    pods: list[PodView], workers: dict[str, object], previous: KVTopologyStatus | None = None
) -> Observed:
    return Observed(
        generation=3,
        spec=SPEC,
        pods=tuple(pods),
        workers=workers,  # type: ignore[arg-type]
        previous=previous or KVTopologyStatus(),
    )


def full_mesh() -> tuple[list[PodView], dict[str, object]]:
    pods = [
        pod("p0", "prefill"),
        pod("p1", "prefill"),
        pod("d0", "decode"),
        pod("d1", "decode"),
        pod("d2", "decode"),
    ]
    ds, ps = {"D0", "D1", "D2"}, {"P0", "P1"}
    workers: dict[str, object] = {
        "p0": worker("P0", "prefill", ds),
        "p1": worker("P1", "prefill", ds),
        "d0": worker("D0", "decode", ps),
        "d1": worker("D1", "decode", ps),
        "d2": worker("D2", "decode", ps),
    }
    return pods, workers


def cond(status: KVTopologyStatus, ctype: str) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type.value == ctype)
    return c.status, c.reason


def test_full_mesh_is_ready_and_quiet() -> None:
    pods, workers = full_mesh()
    plan = evaluate(observe(pods, workers), T0)
    assert plan.handshakes == () and plan.evictions == ()
    assert plan.status.summary.pairs == "6/6"
    assert (plan.status.summary.prefill, plan.status.summary.decode) == ("2/2", "3/3")
    assert cond(plan.status, "Ready") == ("True", "AllPairsConnected")
    assert cond(plan.status, "Progressing") == ("False", "Stable")
    assert cond(plan.status, "Degraded") == ("False", "Healthy")
    assert {e.state for e in plan.status.engines} == {EngineState.CONNECTED}
    assert plan.status.observed_generation == 3


def test_fresh_engines_get_both_directions_of_every_pair() -> None:
    pods, workers = full_mesh()
    bare = {k: worker(v.engine_id, v.role) for k, v in workers.items()}  # type: ignore[attr-defined]
    plan = evaluate(observe(pods, bare), T0)
    assert len(plan.handshakes) == 12
    p0_d2 = Handshake("p0", pods[0].endpoint, "D2", pods[4].endpoint, "decode", engine_id="P0")
    assert p0_d2 in plan.handshakes and p0_d2.pair == ("P0", "D2")
    d2_p0 = Handshake("d2", pods[4].endpoint, "P0", pods[0].endpoint, "prefill", engine_id="D2")
    assert d2_p0 in plan.handshakes and d2_p0.pair == ("P0", "D2")
    assert cond(plan.status, "Ready") == ("False", "PairsMissing")
    assert cond(plan.status, "Progressing") == ("True", "Handshaking")


def test_pairing_labels_keep_revisions_apart() -> None:
    pods = [pod("p0", "prefill", "v1"), pod("d0", "decode", "v1"), pod("d1", "decode", "v2")]
    workers = {
        "p0": worker("P0", "prefill"),
        "d0": worker("D0", "decode"),
        "d1": worker("D1", "decode"),
    }
    plan = evaluate(observe(pods, workers), T0)  # type: ignore[arg-type]
    assert {h.peer_engine_id for h in plan.handshakes} == {"D0", "P0"}
    assert plan.status.summary.pairs == "0/1"
    d1 = next(e for e in plan.status.engines if e.engine_id == "D1")
    assert d1.state == EngineState.PENDING


def test_incompatible_engines_are_never_connected() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    workers = {"p0": worker("P0", "prefill", h="aaaa"), "d0": worker("D0", "decode", h="bbbb")}
    plan = evaluate(observe(pods, workers), T0)  # type: ignore[arg-type]
    assert plan.handshakes == ()
    states = {e.engine_id: e for e in plan.status.engines}
    assert states["P0"].state == states["D0"].state == EngineState.INCOMPATIBLE
    assert "aaaa" in states["D0"].message and "bbbb" in states["D0"].message
    assert cond(plan.status, "Degraded") == ("True", "Incompatible")
    assert [e.reason for e in plan.events] == ["Incompatible", "Incompatible"]
    again = evaluate(observe(pods, workers, plan.status), T0 + timedelta(seconds=5))  # type: ignore[arg-type]
    assert again.events == (), "an Incompatible event is recorded once, on the change"


def test_a_compatibility_rollout_pairs_each_hash_with_its_own_and_reports_only_the_lonely() -> None:
    """During a compatibility-hash rollout both hashes run side by side: an engine with
    partners of its own hash is paired with those and keeps its state (Connected), not
    Incompatible; only an engine with no partner of its hash is, with one message (not one
    per pair: 500 x 1500 engines made 750,000 messages a round)."""
    pods = [
        pod("p0", "prefill"),
        pod("p1", "prefill"),
        pod("d0", "decode"),
        pod("d1", "decode"),
        pod("d2", "decode"),
    ]
    workers = {
        "p0": worker("P0", "prefill", {"D0"}, h="old"),
        "p1": worker("P1", "prefill", {"D1"}, h="new"),
        "d0": worker("D0", "decode", {"P0"}, h="old"),
        "d1": worker("D1", "decode", {"P1"}, h="new"),
        "d2": worker("D2", "decode", h="odd"),
    }
    plan = evaluate(observe(pods, workers), T0)  # type: ignore[arg-type]
    states = {e.engine_id: e for e in plan.status.engines}
    assert {eid: states[eid].state for eid in ("P0", "P1", "D0", "D1")} == dict.fromkeys(
        ("P0", "P1", "D0", "D1"), EngineState.CONNECTED
    )
    assert states["D2"].state == EngineState.INCOMPATIBLE
    assert states["D2"].message.startswith("d2 (odd) has no prefill of its compatibility hash")
    assert plan.handshakes == () and plan.status.summary.pairs == "2/2"
    assert [e.reason for e in plan.events] == ["Incompatible"]


def test_deleted_decode_drains_then_is_evicted_from_every_prefill() -> None:
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    pods2 = [p for p in pods if p.name != "d2"]
    workers2 = {k: v for k, v in workers.items() if k != "d2"}
    at = T0 + timedelta(seconds=1)
    plan = evaluate(observe(pods2, workers2, before), at)
    d2 = next(e for e in plan.status.engines if e.engine_id == "D2")
    assert d2.state == EngineState.DRAINING and d2.since == precise(at)
    assert plan.evictions == ()
    assert cond(plan.status, "Progressing") == ("True", "Draining")
    assert plan.status.summary.pairs == "4/4"
    # Grace elapses: evict from both prefill workers.
    late = evaluate(observe(pods2, workers2, plan.status), at + timedelta(seconds=10))
    assert late.evictions == (
        Eviction("p0", pods[0].endpoint, "D2"),
        Eviction("p1", pods[1].endpoint, "D2"),
    )
    # The workers dropped it: Evicted, one event.
    dropped = {
        k: (worker(v.engine_id, v.role, v.peers - {"D2"}) if v.role == "prefill" else v)  # type: ignore[attr-defined]
        for k, v in workers2.items()
    }
    done = evaluate(observe(pods2, dropped, late.status), at + timedelta(seconds=11))
    d2 = next(e for e in done.status.engines if e.engine_id == "D2")
    assert d2.state == EngineState.EVICTED and done.evictions == ()
    assert [e.reason for e in done.events] == ["EngineEvicted"]
    gone = evaluate(observe(pods2, dropped, done.status), at + timedelta(minutes=6))
    assert all(e.engine_id != "D2" for e in gone.status.engines)


def test_restarted_worker_is_a_new_engine_and_the_old_one_is_evicted() -> None:
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    workers2 = dict(workers)
    workers2["d0"] = worker("D0-new", "decode")
    plan = evaluate(observe(pods, workers2, before), T0 + timedelta(seconds=1))
    assert {(h.pod, h.peer_engine_id) for h in plan.handshakes} == {
        ("p0", "D0-new"),
        ("p1", "D0-new"),
        ("d0", "P0"),
        ("d0", "P1"),
    }
    old = next(e for e in plan.status.engines if e.engine_id == "D0")
    assert old.state == EngineState.DRAINING
    late = evaluate(observe(pods, workers2, plan.status), T0 + timedelta(seconds=12))
    assert {(e.pod, e.engine_id) for e in late.evictions} == {("p0", "D0"), ("p1", "D0")}


def test_unknown_stale_peer_is_evicted_after_grace() -> None:
    pods, workers = full_mesh()
    workers = dict(workers)
    workers["p0"] = worker("P0", "prefill", {"D0", "D1", "D2", "ghost"})
    first = evaluate(observe(pods, workers), T0)
    assert first.evictions == ()
    # A peer no pod owns is counted, never an engine line (its timer is in the memory).
    assert first.status.stale_peers.count == 1
    assert first.status.stale_peers.engine_ids == ["ghost"]
    assert all(e.engine_id != "ghost" for e in first.status.engines)
    assert first.memory is not None
    obs = dataclasses.replace(observe(pods, workers, first.status), memory=first.memory)
    later = evaluate(obs, T0 + timedelta(seconds=10))
    assert [(e.pod, e.engine_id) for e in later.evictions] == [("p0", "ghost")]
    assert not any("ghost" in e.message for e in (*first.events, *later.events))


def test_a_worker_reporting_more_made_up_peers_than_it_could_hold_is_not_believed() -> None:
    """1,500 invented peers with 256-character ids (issue 54): on 7314fe4 they became
    1,446 phantom `Gone` lines with pod "" that sorted first and pushed the real prefills
    out of the status, and spent the topology's Event budget. Now the holder is refused
    (WorkerAnswerRefused, with the count), nothing it holds is evicted or listed, and the
    other engines are paired as before."""
    pods, workers = full_mesh()
    ghosts = {f"ghost-{i:05d}-" + "x" * 244 for i in range(1500)}
    workers = dict(workers)
    workers["d2"] = worker("D2", "decode", {"P0", "P1", *ghosts})
    plan = evaluate(observe(pods, workers), T0)
    by_pod = {e.pod: e for e in plan.status.engines}
    assert by_pod["d2"].state == EngineState.FAILED
    assert "1500 peers no pod of the topology has" in by_pod["d2"].message
    assert {e.pod for e in plan.status.engines} == {"p0", "p1", "d0", "d1", "d2"}
    assert plan.status.stale_peers.count == 0 and plan.status.engines_omitted == 0
    assert [e.reason for e in plan.events] == ["WorkerAnswerRefused"]
    assert plan.evictions == ()
    later = evaluate(observe(pods, workers, plan.status), T0 + timedelta(seconds=30))
    assert later.evictions == () and later.events == ()
    # A few strangers (a peer gone before the operator knew it) are believed and evicted.
    workers["d2"] = worker("D2", "decode", {"P0", "P1", *sorted(ghosts)[:3]})
    few = evaluate(observe(pods, workers), T0)
    assert few.status.stale_peers.count == 3 and len(few.status.stale_peers.engine_ids) == 3


def test_failure_counters_accumulate_across_worker_restarts() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    lf = FailureView(
        time=T0.timestamp(),
        type="push_reg_notif_failed",
        request_id="r9",
        engine_id="P0",
        message="no agents",
    )
    w1 = {
        "p0": worker("P0", "prefill", {"D0"}),
        "d0": worker(
            "D0", "decode", {"P0"}, failures={"push_reg_notif_failed": 2}, last_failure=lf
        ),
    }
    s1 = evaluate(observe(pods, w1), T0).status  # type: ignore[arg-type]
    assert s1.failures.counts == {"push_reg_notif_failed": 2}
    assert s1.failures.last is not None and s1.failures.last.request_id == "r9"
    assert s1.failures.last.pod == "d0"
    s2 = evaluate(observe(pods, w1, s1), T0 + timedelta(seconds=2)).status  # type: ignore[arg-type]
    assert s2.failures.counts == {"push_reg_notif_failed": 2}, "no new failures, no new counts"
    w3 = {
        "p0": w1["p0"],
        "d0": worker(
            "D0", "decode", {"P0"}, failures={"push_reg_notif_failed": 5}, last_failure=lf
        ),
    }
    s3 = evaluate(observe(pods, w3, s2), T0 + timedelta(seconds=4)).status  # type: ignore[arg-type]
    assert s3.failures.counts == {"push_reg_notif_failed": 5}
    # The decode worker restarts: a new engine, counters from zero.
    w4 = {
        "p0": w1["p0"],
        "d0": worker("D0b", "decode", failures={"registration_timeout": 1}, last_failure=lf),
    }
    p4 = evaluate(observe(pods, w4, s3), T0 + timedelta(seconds=6))  # type: ignore[arg-type]
    assert p4.status.failures.counts == {"push_reg_notif_failed": 5, "registration_timeout": 1}
    assert [e.reason for e in p4.events] == ["TransferFailures"]


def test_unreachable_worker_is_failed_not_evicted() -> None:
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    workers2 = dict(workers)
    workers2["d1"] = WorkerUnreachable("connection refused")
    plan = evaluate(observe(pods, workers2, before), T0 + timedelta(seconds=60))
    d1 = next(e for e in plan.status.engines if e.pod == "d1")
    assert d1.state == EngineState.FAILED and "connection refused" in d1.message
    assert plan.evictions == ()
    assert cond(plan.status, "Degraded") == ("True", "WorkerUnreachable")


def test_an_engine_on_a_lost_node_drains_from_the_flip_and_is_evicted_after_the_grace() -> None:
    """A pod whose node went NotReady (marked not Ready by the node lifecycle, `lost_since`)
    is not up: its engine is gone from that flip, whether or not its worker still answers
    (it may be reachable from the operator and not from its Services), and is evicted from
    every peer once the grace has passed since the flip, not since the operator noticed."""
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    flip = T0 + timedelta(seconds=2)
    lost = dataclasses.replace(pods[4], ready=False, lost_since=flip.timestamp())
    pods2 = [*pods[:4], lost]
    workers2 = {k: v for k, v in workers.items() if k != "d2"}  # not read: not up
    seen = flip + timedelta(seconds=3)  # the operator learns of it 3 s after the flip
    plan = evaluate(observe(pods2, workers2, before), seen)
    d2 = next(e for e in plan.status.engines if e.engine_id == "D2")
    assert d2.state == EngineState.DRAINING and d2.since == precise(flip)
    assert plan.evictions == () and plan.wake_in_s == pytest.approx(7.0)
    late = evaluate(observe(pods2, workers2, plan.status), flip + timedelta(seconds=10))
    assert late.evictions == (
        Eviction("p0", pods[0].endpoint, "D2"),
        Eviction("p1", pods[1].endpoint, "D2"),
    )


def test_unreachable_worker_is_kept_round_after_round_with_the_memory() -> None:
    """As the reconciler runs it: each round gets the previous status and memory. A worker
    that cannot be read while its pod is up is kept as it was (Failed), never gone: it is
    not listed twice, and its peers keep it past the grace (it may only be frozen)."""
    pods, workers = full_mesh()
    plan = evaluate(observe(pods, workers), T0)
    workers2 = dict(workers)
    workers2["d1"] = WorkerUnreachable("connection refused")
    for minute in range(1, 4):
        obs = dataclasses.replace(
            observe(pods, workers2, plan.status), memory=plan.memory or Memory()
        )
        plan = evaluate(obs, T0 + timedelta(minutes=minute))
        d1 = [e for e in plan.status.engines if e.engine_id == "D1" or e.pod == "d1"]
        assert [e.state for e in d1] == [EngineState.FAILED], d1
        assert plan.evictions == (), plan.evictions
        assert "D1" not in plan.memory.gone_since  # type: ignore[union-attr]


def test_condition_transition_time_moves_only_on_change() -> None:
    pods, workers = full_mesh()
    s1 = evaluate(observe(pods, workers), T0).status
    s2 = evaluate(observe(pods, workers, s1), T0 + timedelta(minutes=1)).status
    assert dump(s1) == dump(s2), "same observation, same status: nothing to write"


# --- properties ----------------------------------------------------------------------------

names = st.sampled_from(["a", "b", "c", "d", "e"])


@st.composite
def observations(draw: st.DrawFn) -> tuple[list[PodView], dict[str, object], KVTopologyStatus]:
    pods: list[PodView] = []
    workers: dict[str, object] = {}
    engine_ids = {f"{r[0]}{n}": r for n in ["0", "1", "2"] for r in ("prefill", "decode")}
    for eid, role in engine_ids.items():
        if not draw(st.booleans()):
            continue
        name = eid.lower()
        pods.append(pod(name, role, draw(st.sampled_from(["v1", "v2"])), ready=draw(st.booleans())))
        kind = draw(st.sampled_from(["ok", "ok", "unreachable", "none"]))
        if kind == "ok":
            others = [e for e, r in engine_ids.items() if r != role] + ["ghost"]
            peers = draw(st.sets(st.sampled_from(others)))
            workers[name] = worker(
                eid,
                role,
                peers,
                h=draw(st.sampled_from(["h", "h", "x"])),
                failures={"transfer_failed": draw(st.integers(0, 3))},
            )
        elif kind == "unreachable":
            workers[name] = WorkerUnreachable("down")
    prev_engines = [
        EngineStatus(
            pod=f"old{i}",
            role="decode",
            engine_id=f"OLD{i}",
            state=draw(st.sampled_from(list(EngineState))),
            since=rfc3339(T0 - timedelta(seconds=draw(st.integers(0, 30)))),
        )
        for i in range(draw(st.integers(0, 2)))
    ]
    return pods, workers, KVTopologyStatus(engines=prev_engines)


@settings(max_examples=200, deadline=None)
@given(observations(), st.integers(0, 100), st.randoms())
def test_same_observation_same_plan_whatever_the_order(
    obs: tuple[list[PodView], dict[str, object], KVTopologyStatus], seconds: int, rnd: object
) -> None:
    pods, workers, previous = obs
    now = T0 + timedelta(seconds=seconds)
    a = evaluate(observe(pods, workers, previous), now)
    shuffled = list(pods)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    items = list(workers.items())
    rnd.shuffle(items)  # type: ignore[attr-defined]
    b = evaluate(observe(shuffled, dict(items), previous), now)
    assert a.handshakes == b.handshakes and a.evictions == b.evictions
    assert dump(a.status) == dump(b.status)
    assert a.events == b.events


@settings(max_examples=200, deadline=None)
@given(observations(), st.integers(0, 100))
def test_plans_are_sane(
    obs: tuple[list[PodView], dict[str, object], KVTopologyStatus], seconds: int
) -> None:
    pods, workers, previous = obs
    plan = evaluate(observe(pods, workers, previous), T0 + timedelta(seconds=seconds))
    live = {w.engine_id for w in workers.values() if isinstance(w, WorkerView)}
    assert all(h.peer_engine_id in live for h in plan.handshakes), "only live engines are added"
    assert all(
        e.engine_id not in {h.peer_engine_id for h in plan.handshakes} for e in plan.evictions
    )
    assert len(set(plan.handshakes)) == len(plan.handshakes)
    connected, expected = (int(x) for x in plan.status.summary.pairs.split("/"))
    assert 0 <= connected <= expected
    ready = next(c for c in plan.status.conditions if c.type.value == "Ready")
    # Ready: every pair connected, and every usable engine has a partner.
    unpaired = bool(plan.progress.unpaired)
    assert (ready.status == "True") == (expected > 0 and connected == expected and not unpaired)
    assert all(v >= 0 for v in plan.status.failures.counts.values())


@pytest.mark.parametrize("grace", [0, 1, 30])
def test_eviction_waits_exactly_the_grace(grace: int) -> None:
    spec = SPEC.model_copy(
        update={"eviction": SPEC.eviction.model_copy(update={"grace_seconds": grace})}
    )
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    pods2 = [p for p in pods if p.name != "d0"]
    workers2 = {k: v for k, v in workers.items() if k != "d0"}

    def at(s: float, prev: KVTopologyStatus) -> tuple[int, KVTopologyStatus]:
        p = evaluate(Observed(3, spec, tuple(pods2), workers2, prev), T0 + timedelta(seconds=s))  # type: ignore[arg-type]
        return len(p.evictions), p.status

    n0, s0 = at(1, before)
    assert n0 == (2 if grace == 0 else 0)
    if grace:
        assert at(1 + grace - 1, s0)[0] == 0
        assert at(1 + grace, s0)[0] == 2


def test_the_plan_says_when_the_next_eviction_falls_due() -> None:
    pods, workers = full_mesh()
    before = evaluate(observe(pods, workers), T0).status
    pods2 = [p for p in pods if p.name != "d2"]
    workers2 = {k: v for k, v in workers.items() if k != "d2"}
    plan = evaluate(observe(pods2, workers2, before), T0 + timedelta(seconds=1))
    assert plan.wake_in_s == pytest.approx(10.0)
    later = evaluate(observe(pods2, workers2, plan.status), T0 + timedelta(seconds=7.5))
    assert later.wake_in_s == pytest.approx(3.5) and later.evictions == ()
    assert evaluate(observe(pods, workers), T0).wake_in_s is None


def test_the_idle_ttl_is_set_on_usable_workers_that_report_another_value() -> None:
    pods, workers = full_mesh()
    spec = SPEC.model_copy(
        update={"eviction": SPEC.eviction.model_copy(update={"idle_ttl_seconds": 30})}
    )
    workers["p0"] = dataclasses.replace(workers["p0"], idle_ttl_s=0.0)  # type: ignore[type-var]
    workers["p1"] = dataclasses.replace(workers["p1"], idle_ttl_s=30.0)  # type: ignore[type-var]
    workers["d0"] = dataclasses.replace(workers["d0"], idle_ttl_s=86400.0)  # type: ignore[type-var]
    # d1 predates the setting (None): it is never sent one. d2's worker is another pod's.
    workers["d2"] = dataclasses.replace(workers["d2"], idle_ttl_s=0.0, pod_uid="x")  # type: ignore[type-var]
    obs = dataclasses.replace(observe(pods, workers), spec=spec)
    plan = evaluate(obs, T0)
    assert plan.idle_ttls == (
        SetIdleTTL("d0", pods[2].endpoint, 30.0),
        SetIdleTTL("p0", pods[0].endpoint, 30.0),
    )
    # The default spec (0: off) turns the backstop off where a worker has it on.
    assert [s.pod for s in evaluate(observe(pods, workers), T0).idle_ttls] == ["d0", "p1"]


# --- conditions that tell the truth ---------------------------------------------------------


def test_an_engine_with_no_partner_keeps_ready_false_and_is_named() -> None:
    """One v1 pair plus decodes of v2 with no v2 prefill: the pair count alone (1/1) would
    say Ready; the unpaired engines say otherwise."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    pods += [pod(f"d{i}", "decode", version="v2") for i in range(1, 5)]
    workers: dict[str, object] = {"p0": worker("P0", "prefill", {"D0"})}
    workers["d0"] = worker("D0", "decode", {"P0"})
    for i in range(1, 5):
        workers[f"d{i}"] = worker(f"D{i}", "decode")
    plan = evaluate(observe(pods, workers), T0)
    ready = next(c for c in plan.status.conditions if c.type.value == "Ready")
    assert (ready.status, ready.reason) == ("False", "EnginesUnpaired")
    assert "4 engine(s) with no partner to pair with: d1, d2, d3, d4" in ready.message
    assert plan.status.summary.model_dump() == {"prefill": "1/1", "decode": "1/5", "pairs": "1/1"}


def test_conditions_are_those_of_the_outcome_of_acting() -> None:
    pods, workers = full_mesh()
    bare = {k: worker(v.engine_id, v.role) for k, v in workers.items()}  # type: ignore[attr-defined]
    plan = evaluate(observe(pods, bare), T0)
    deadline = timedelta(seconds=30)
    # Every handshake made: Ready at once, not a round later.
    status, events, _ = settle(plan, plan.handshakes, {}, KVTopologyStatus(), 3, deadline, T0)
    assert cond(status, "Ready") == ("True", "AllPairsConnected")
    assert cond(status, "Progressing") == ("False", "Stable")
    assert {e.state for e in status.engines} == {EngineState.CONNECTED}
    assert status.summary.model_dump() == {"prefill": "2/2", "decode": "3/3", "pairs": "6/6"}
    assert events == ()
    # One half of one pair failing: that pair is not connected, the rest are.
    bad = next(h for h in plan.handshakes if h.pod == "d2" and h.peer_engine_id == "P0")
    made = [h for h in plan.handshakes if h != bad]
    young = {bad: FailingHandshake(T0 - timedelta(seconds=5), "HTTP 401 from the peer")}
    status, events, _ = settle(plan, made, young, KVTopologyStatus(), 3, deadline, T0)
    assert cond(status, "Ready") == ("False", "PairsMissing")
    assert cond(status, "Progressing") == ("True", "Handshaking")
    assert cond(status, "Degraded") == ("False", "Healthy")
    assert status.summary.pairs == "5/6" and events == ()
    # The same failure past the progress deadline: Degraded names it, one Event.
    old = {bad: FailingHandshake(T0 - timedelta(seconds=31), "HTTP 401 from the peer")}
    status, events, _ = settle(plan, made, old, KVTopologyStatus(), 3, deadline, T0)
    degraded = next(c for c in status.conditions if c.type.value == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "HandshakeFailed")
    assert "d2 adding prefill P0: HTTP 401 from the peer" in degraded.message
    assert [e.reason for e in events] == ["HandshakeFailed"]
    _, events, _ = settle(plan, made, old, status, 3, deadline, T0 + timedelta(seconds=2))
    assert events == (), "an Event when it turns Degraded, not every round"


# --- pairing is level-based both ways -------------------------------------------------------


def test_a_connection_no_longer_paired_is_evicted_after_the_grace() -> None:
    """d0's pairing label changed from v1 to v2 (or the spec's pairing did): its connection
    with the v1 prefill is removed after the grace, like a gone engine's, both ways."""
    pods = [pod("p0", "prefill"), pod("d0", "decode", version="v2")]
    workers: dict[str, object] = {
        "p0": worker("P0", "prefill", {"D0"}),
        "d0": worker("D0", "decode", {"P0"}),
    }
    first = evaluate(observe(pods, workers), T0)
    assert first.evictions == () and first.handshakes == ()
    assert first.wake_in_s == SPEC.eviction.grace_seconds
    assert first.memory is not None
    later = dataclasses.replace(observe(pods, workers), memory=first.memory)
    due = evaluate(later, T0 + timedelta(seconds=SPEC.eviction.grace_seconds))
    assert sorted((e.pod, e.engine_id) for e in due.evictions) == [("d0", "P0"), ("p0", "D0")]
    # Paired again before the grace ran out: nothing is evicted, the timer is dropped.
    back = [pod("p0", "prefill"), pod("d0", "decode")]
    again = dataclasses.replace(observe(back, workers), memory=first.memory)
    kept = evaluate(again, T0 + timedelta(seconds=SPEC.eviction.grace_seconds))
    assert kept.evictions == ()
    assert kept.memory is not None and kept.memory.unpairing_since == {}


def test_the_summary_counts_available_engines_and_ready_can_be_a_minimum() -> None:
    """One decode that no prefill can reach (issue 54): on 7314fe4 the summary said
    `prefill 0/2` (a prefill counted only when connected to every partner), and Ready was
    False for the whole topology. Now each role counts its available engines (as their
    gates say), and `spec.availability` makes Ready a minimum, Degraded naming the rest."""
    pods, workers = full_mesh()
    workers = dict(workers)
    workers["p0"] = worker("P0", "prefill", {"D0", "D1"})
    workers["p1"] = worker("P1", "prefill", {"D0", "D1"})
    workers["d2"] = worker("D2", "decode", set())
    plan = evaluate(observe(pods, workers), T0)
    assert plan.status.summary.prefill == "2/2" and plan.status.summary.decode == "2/3"
    assert cond(plan.status, "Ready")[0] == "False"  # unset: every pair, as before
    spec = SPEC.model_copy(
        update={"availability": SPEC.availability.model_copy(update={"min_available_decode": 2})}
    )
    obs = dataclasses.replace(observe(pods, workers), spec=spec)
    plan = evaluate(obs, T0)
    assert cond(plan.status, "Ready") == ("True", "EnginesAvailable")
    assert cond(plan.status, "Degraded") == ("True", "EnginesUnavailable")
    degraded = next(c for c in plan.status.conditions if c.type == "Degraded")
    assert "d2" in degraded.message
    spec3 = spec.model_copy(
        update={"availability": spec.availability.model_copy(update={"min_available_decode": 3})}
    )
    plan = evaluate(dataclasses.replace(obs, spec=spec3), T0)
    assert cond(plan.status, "Ready") == ("False", "TooFewAvailable")
