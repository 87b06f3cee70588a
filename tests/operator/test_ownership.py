"""A pod belongs to at most one KVTopology: the claim (`logic.owned_pods`), what the losing
topology's plan and status say (`evaluate`: the Conflict condition, its Event, nothing done
to the pods), and the reconcile loop that takes the namespace's other topologies from its
topology source (`Reconciler`, with a fake Kubernetes client and recording workers).

The claim: among the topologies of a namespace whose role selector matches a pod, the oldest
(metadata.creationTimestamp, ties by name) owns it. It depends on nothing else, so it is the
same whichever topology asks, in whatever order the others arrived, at any time."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo_operator.api import (
    EngineState,
    KVTopologySpec,
    KVTopologyStatus,
    Reason,
    dump,
)
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import (
    claim_namespace,
    claim_order,
    evaluate,
    invalid_spec,
    owned_pods,
)
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import (
    Observed,
    PodView,
    TopologyView,
    WorkerView,
    precise,
)
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import FakeKube, RecordingWorkers

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def spec(prefill: dict[str, str], decode: dict[str, str], grace: int = 10) -> KVTopologySpec:
    return KVTopologySpec.model_validate(
        {
            "prefill": {"selector": {"matchLabels": prefill}},
            "decode": {"selector": {"matchLabels": decode}},
            "eviction": {"graceSeconds": grace},
        }
    )


LLAMA = spec({"app": "llama"}, {"app": "llama"})


def topo(name: str, created: str, s: KVTopologySpec | None = LLAMA) -> TopologyView:
    return TopologyView(name, created, s)


def pod(name: str, role: str, **labels: str) -> PodView:
    return PodView(
        name=name,
        role=role,
        labels={"app": "llama", "kvtopo.dev/role": role, **labels},
        ready=True,
        deleting=False,
        endpoint=f"127.0.0.1:{(9000 if role == 'prefill' else 9500) + int(name[1:])}",
    )


PODS = [pod("p0", "prefill"), pod("p1", "prefill"), pod("d0", "decode"), pod("d1", "decode")]
EARLY, LATE = "2026-11-30T11:00:00Z", "2026-11-30T11:00:05Z"


def claim(me: TopologyView, *others: TopologyView) -> tuple[list[str], dict[str, str]]:
    mine, elsewhere = owned_pods(me, others, PODS)
    return [p.name for p in mine], elsewhere


# --- the claim -------------------------------------------------------------------------------


def test_one_topology_owns_every_pod_it_selects() -> None:
    me = topo("llama", EARLY)
    assert claim(me) == (["d0", "d1", "p0", "p1"], {})
    assert claim(me, me) == (["d0", "d1", "p0", "p1"], {}), "its own index entry is skipped"


def test_of_two_overlapping_the_older_owns_whatever_the_order_of_arrival() -> None:
    old, young = topo("zeta", EARLY), topo("alpha", LATE)  # the name would favour alpha
    everyone = {"d0": "zeta", "d1": "zeta", "p0": "zeta", "p1": "zeta"}
    for index in itertools.permutations([old, young, topo("other", EARLY, None)]):
        assert claim(old, *index) == (["d0", "d1", "p0", "p1"], {})
        assert claim(young, *index) == ([], everyone)


def test_of_two_created_in_the_same_second_the_name_decides() -> None:
    a, b = topo("a-llama", EARLY), topo("b-llama", EARLY)
    assert claim(a, b) == (["d0", "d1", "p0", "p1"], {})
    assert claim(b, a)[0] == [] and set(claim(b, a)[1].values()) == {"a-llama"}
    assert claim_order(a) < claim_order(b)


def test_a_pod_matched_by_both_on_one_role_only_goes_to_the_older() -> None:
    # Both take every prefill; their decodes are apart (tier a and tier b).
    pods = [
        pod("p0", "prefill"),
        pod("d0", "decode", tier="a"),
        pod("d1", "decode", tier="b"),
    ]
    old = topo("old", EARLY, spec({"app": "llama"}, {"tier": "a"}))
    young = topo("young", LATE, spec({"app": "llama"}, {"tier": "b"}))
    mine, elsewhere = owned_pods(old, [young], pods)
    assert [p.name for p in mine] == ["d0", "p0"] and elsewhere == {}
    mine, elsewhere = owned_pods(young, [old], pods)
    assert [p.name for p in mine] == ["d1"] and elsewhere == {"p0": "old"}


def test_the_older_deleted_the_younger_takes_over() -> None:
    old, young = topo("zeta", EARLY), topo("alpha", LATE)
    assert claim(young, old)[0] == []
    assert claim(young) == (["d0", "d1", "p0", "p1"], {})  # zeta gone from the index


def test_selectors_that_stop_overlapping_give_the_pods_back() -> None:
    young = topo("alpha", LATE)
    assert claim(young, topo("zeta", EARLY))[0] == []
    moved = topo("zeta", EARLY, spec({"app": "mistral"}, {"app": "mistral"}))
    assert claim(young, moved) == (["d0", "d1", "p0", "p1"], {})


def test_a_topology_whose_spec_cannot_be_read_claims_nothing() -> None:
    unreadable = topo("zeta", EARLY, None)
    assert claim(topo("alpha", LATE), unreadable) == (["d0", "d1", "p0", "p1"], {})
    assert claim(unreadable) == ([], {})


def test_a_missing_or_bad_creation_time_sorts_last() -> None:
    assert claim(topo("a", ""), topo("b", LATE))[0] == []
    assert claim(topo("a", "yesterday"), topo("b", LATE))[0] == []
    assert claim(topo("a", "2026-11-30T11:00:00.250Z"), topo("b", LATE))[1] == {}


labels = st.fixed_dictionaries({"app": st.sampled_from(["llama", "mistral"])}).flatmap(
    lambda base: st.dictionaries(st.sampled_from(["tier", "zone"]), st.sampled_from("ab")).map(
        lambda extra: {**base, **extra}
    )
)
selectors = st.dictionaries(
    st.sampled_from(["app", "tier", "zone"]),
    st.sampled_from(["llama", "mistral", "a", "b"]),
    min_size=1,
    max_size=2,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(selectors, selectors, st.integers(0, 3)), min_size=1, max_size=5
    ),  # (prefill selector, decode selector, creation second)
    st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), labels), max_size=8),
    st.randoms(use_true_random=False),
)
def test_every_selected_pod_has_exactly_one_owner_whoever_asks(
    specs: list[tuple[dict[str, str], dict[str, str], int]],
    pods: list[tuple[str, dict[str, str]]],
    rnd: Any,
) -> None:
    topologies = [
        topo(f"t{i}", f"2026-11-30T11:00:0{sec}Z", spec(p, d if d != p else {**d, "x": "y"}))
        for i, (p, d, sec) in enumerate(specs)
    ]
    views = [
        PodView(f"pod{i}", role, {**lab, "kvtopo.dev/role": role}, True, False, "e:1")
        for i, (role, lab) in enumerate(pods)
    ]
    owners: dict[str, list[str]] = {}
    for me in topologies:
        others = list(topologies)
        rnd.shuffle(others)
        mine, elsewhere = owned_pods(me, others, views)
        for p in mine:
            owners.setdefault(p.name, []).append(me.name)
        for owner in elsewhere.values():
            assert claim_order(next(t for t in topologies if t.name == owner)) < claim_order(me)
    for p in views:
        selecting = [t for t in topologies if owned_pods(t, [], [p])[0]]
        if selecting:
            assert owners.get(p.name) == [min(selecting, key=claim_order).name], p.name
        else:
            assert p.name not in owners


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(selectors, selectors, st.integers(0, 3)), min_size=1, max_size=6),
    st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), labels), max_size=12),
)
def test_the_namespace_s_claim_made_once_is_each_topology_s_own(
    specs: list[tuple[dict[str, str], dict[str, str], int]],
    pods: list[tuple[str, dict[str, str]]],
) -> None:
    """`claim_namespace` (one pass over the namespace's pods, shared by every loop) gives
    each topology exactly what `owned_pods` gives it alone."""
    topologies = [
        topo(f"t{i}", f"2026-11-30T11:00:0{sec}Z", spec(p, d if d != p else {**d, "x": "y"}))
        for i, (p, d, sec) in enumerate(specs)
    ]
    views = [
        PodView(f"pod{i}", role, {**lab, "kvtopo.dev/role": role}, True, False, "e:1")
        for i, (role, lab) in enumerate(pods)
    ]
    shared = claim_namespace(topologies, views)
    for me in topologies:
        mine, elsewhere = owned_pods(me, topologies, views)
        assert shared.owned[me.name] == mine
        assert dict(shared.claimed[me.name]) == elsewhere
    assert shared.selected == {p.name for t in topologies for p in owned_pods(t, [], views)[0]}


# --- the losing topology's plan and status ---------------------------------------------------


def workers_of(peers: dict[str, set[str]]) -> dict[str, WorkerView]:
    return {
        name: WorkerView(
            name.upper(), "prefill" if name[0] == "p" else "decode", "h", frozenset(ps)
        )
        for name, ps in peers.items()
    }


CONNECTED = {"p0": {"D0"}, "d0": {"P0"}}


def observe(
    claimed: dict[str, str],
    previous: KVTopologyStatus | None = None,
    peers: dict[str, set[str]] = CONNECTED,
    pods: list[PodView] | None = None,
) -> Observed:
    shown = pods if pods is not None else [pod("p0", "prefill"), pod("d0", "decode")]
    return Observed(
        generation=2,
        spec=LLAMA,
        pods=tuple(p for p in shown if p.name not in claimed),
        workers={k: v for k, v in workers_of(peers).items() if k not in claimed},
        previous=previous or KVTopologyStatus(),
        claimed=claimed,
    )


def conflict(status: KVTopologyStatus) -> tuple[str, str, str]:
    c = next(c for c in status.conditions if c.type.value == "Conflict")
    return c.status, c.reason, c.message


def test_without_a_conflict_the_condition_is_false() -> None:
    plan = evaluate(observe({}), T0)
    assert conflict(plan.status)[:2] == ("False", Reason.NO_CONFLICT.value)
    assert len(plan.status.conditions) <= 8
    assert [e.reason for e in plan.events] == []


def test_the_losing_topology_touches_nothing_and_says_whose_pods_they_are() -> None:
    claimed = {"p0": "zeta", "d0": "zeta"}
    plan = evaluate(observe(claimed), T0)
    assert plan.handshakes == () and plan.evictions == () and plan.idle_ttls == ()
    assert plan.status.engines == []
    summary = plan.status.summary
    assert (summary.prefill, summary.decode, summary.pairs) == ("0/0", "0/0", "0/0")
    status, reason, message = conflict(plan.status)
    assert (status, reason) == ("True", "PodsClaimedElsewhere")
    assert "d0, p0" in message and "zeta" in message
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "Conflict")]
    assert "d0, p0" in plan.events[0].message and "zeta" in plan.events[0].message
    # The next rounds: the same condition (its transition time kept), no Event again.
    later = evaluate(observe(claimed, plan.status), T0 + timedelta(seconds=30))
    assert later.events == () and later.handshakes == () and later.evictions == ()
    c0, c1 = (
        next(c for c in s.conditions if c.type.value == "Conflict")
        for s in (plan.status, later.status)
    )
    assert c1.last_transition_time == c0.last_transition_time
    # The older one deleted: this one takes over (already connected: no handshake needed).
    over = evaluate(observe({}, later.status), T0 + timedelta(seconds=60))
    assert conflict(over.status)[:2] == ("False", "NoConflict")
    assert over.status.summary.pairs == "1/1" and over.handshakes == ()
    assert [e.reason for e in over.events] == []


def test_engines_handed_over_to_the_older_topology_are_not_drained_nor_evicted() -> None:
    # This topology managed p0 and d0 until an older one came to select them too.
    before = evaluate(observe({}), T0).status
    assert {e.engine_id for e in before.engines} == {"P0", "D0"}
    claimed = {"p0": "zeta", "d0": "zeta"}
    plan = evaluate(observe(claimed, before), T0 + timedelta(seconds=1))
    assert plan.status.engines == [] and plan.evictions == ()
    late = evaluate(observe(claimed, plan.status), T0 + timedelta(minutes=10))
    assert late.evictions == () and not any(e.reason == "EngineEvicted" for e in late.events)


def test_a_peer_of_a_pod_claimed_elsewhere_is_evicted_from_this_topologys_own_pods() -> None:
    # Partial overlap: the older topology takes the prefill; this one keeps the decode,
    # which then has nobody to pair with here: the old pair is torn down on this side.
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    before = evaluate(observe({}, pods=pods), T0).status
    claimed = {"p0": "zeta"}
    at = T0 + timedelta(seconds=1)
    plan = evaluate(observe(claimed, before, pods=pods), at)
    p0 = next(e for e in plan.status.engines if e.engine_id == "P0")
    assert p0.state == EngineState.DRAINING and p0.since == precise(at) and p0.pod == "p0"
    assert plan.status.summary.prefill.endswith("/0"), "the claimed pod is not counted"
    late = evaluate(observe(claimed, plan.status, pods=pods), at + timedelta(seconds=10))
    assert [(e.pod, e.engine_id) for e in late.evictions] == [("d0", "P0")]
    assert all(h.pod == "d0" for h in late.handshakes)


def test_an_unreadable_spec_keeps_the_conflict_condition_as_it_was() -> None:
    previous = evaluate(observe({"p0": "zeta", "d0": "zeta"}), T0).status
    status, _ = invalid_spec(previous, 3, "spec.transfer.mode: bad", T0 + timedelta(seconds=1))
    assert conflict(status) == conflict(previous)


# --- the reconcile loop ------------------------------------------------------------------------


def body(name: str, created: str, s: KVTopologySpec = LLAMA) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": created,
            "generation": 1,
            "resourceVersion": "1",
            "uid": f"uid-{name}",
        },
        "spec": dump(s),
    }


@pytest.mark.asyncio
async def test_the_loop_of_the_younger_topology_never_calls_a_worker() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"zeta": body("zeta", EARLY), "alpha": body("alpha", LATE)})
    workers = RecordingWorkers.for_pods(pods)
    index = [topo("alpha", LATE), topo("zeta", EARLY)]  # as kopf's index holds them
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods,
        topologies=lambda namespace: index,
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=0.05, retry_s=0.01),
    )
    try:
        reconciler.ensure(("ns", "alpha"))
        for _ in range(200):  # several rounds of the younger alone
            await asyncio.sleep(0.005)
        status = KVTopologyStatus.model_validate(kube.bodies["alpha"]["status"])
        assert workers.calls == [], "no state read, no handshake, no eviction"
        assert conflict(status)[:2] == ("True", "PodsClaimedElsewhere")
        assert [e[:3] for e in kube.events] == [("alpha", "Warning", "Conflict")]
        assert "d0, p0" in kube.events[0][3] and "zeta" in kube.events[0][3]

        reconciler.ensure(("ns", "zeta"))
        for _ in range(400):
            await asyncio.sleep(0.005)
            zeta = kube.bodies["zeta"].get("status") or {}
            if zeta.get("summary", {}).get("pairs") == "1/1":
                break
        assert kube.bodies["zeta"]["status"]["summary"]["pairs"] == "1/1"
        touched = {endpoint for _, endpoint in workers.calls}
        assert touched == {p.endpoint for p in pods}  # by zeta, the owner
        zeta_status = KVTopologyStatus.model_validate(kube.bodies["zeta"]["status"])
        assert conflict(zeta_status)[:2] == ("False", "NoConflict")
        assert [e for e in kube.events if e[0] == "alpha"] == [kube.events[0]], "one Event"
    finally:
        reconciler.cancel_all()


def test_conditions_fit_the_status_list() -> None:
    plan = evaluate(observe({"p0": "zeta"}), T0)
    types = [c.type.value for c in plan.status.conditions]
    assert len(types) == len(set(types)) <= 8 and "Conflict" in types


def test_the_message_names_every_owner_and_stays_within_bounds() -> None:
    claimed = {f"p{i}": "zeta" for i in range(50)} | {"d0": "omega"}
    status, reason, message = conflict(evaluate(observe(claimed), T0).status)
    assert (status, reason) == ("True", "PodsClaimedElsewhere")
    assert "owned by KVTopology omega" in message and "owned by KVTopology zeta" in message
    assert "and 30 more" in message and len(message) <= 1024
    assert "51 selected pod(s)" in message


# --- the kopf-fed index ------------------------------------------------------------------------


def test_the_topology_index_holds_name_creation_time_and_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtopo_operator import handlers

    def index(spec: dict[str, Any]) -> dict[str, TopologyView]:
        meta = {"creationTimestamp": EARLY, "generation": 1}
        return handlers.kv_topologies(namespace="ns", name="zeta", meta=meta, spec=spec)

    assert index(dump(LLAMA)) == {"ns": topo("zeta", EARLY)}
    bad = dict(dump(LLAMA), transfer={"mode": "carrier-pigeon"})
    assert index(bad) == {"ns": topo("zeta", EARLY, None)}, "unreadable: claims nothing"
    monkeypatch.setattr(handlers, "_state", {})
    with pytest.raises(RuntimeError):
        handlers._topology_source("ns")  # no loop runs before kopf filled the index
    monkeypatch.setattr(handlers, "_state", {"kv_topologies": {"ns": [topo("zeta", EARLY)]}})
    assert list(handlers._topology_source("ns")) == [topo("zeta", EARLY)]
    assert list(handlers._topology_source("other")) == []


@pytest.mark.asyncio
async def test_a_pod_event_pokes_only_the_loops_whose_selectors_match_it() -> None:
    """100 topologies in one namespace: a pod event used to poke every loop there (each
    ran a round). Now only the loops selecting the pod (as it was or as it is) are poked;
    every round of every loop shares one claim of the namespace."""
    llama, mistral = (
        spec({"app": "llama"}, {"app": "llama"}),
        spec({"app": "mistral"}, {"app": "mistral"}),
    )
    kube = FakeKube(
        {"llama": body("llama", EARLY, llama), "mistral": body("mistral", LATE, mistral)}
    )
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    index = [topo("llama", EARLY, llama), topo("mistral", LATE, mistral)]
    claims = []
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, RecordingWorkers.for_pods(pods)),
        pods=lambda namespace, port: claims.append(1) or pods,  # type: ignore[func-returns-value]
        topologies=lambda namespace: index,
        pods_version=lambda namespace: 1,  # the pods never change here
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=60, retry_s=60),
    )
    try:
        for name in ("llama", "mistral"):
            reconciler.ensure(("ns", name))
        loops = reconciler._loops
        for _ in range(400):
            await asyncio.sleep(0.005)
            if all(loop.spec is not None and not loop.poke.is_set() for loop in loops.values()):
                break
        assert all(loop.spec is not None for loop in loops.values())
        assert len(claims) == 1, "the namespace's pods were claimed once for both loops"
        for loop in loops.values():
            loop.poke.clear()
        reconciler.poke_pods("ns", [("decode", {"app": "mistral", "kvtopo.dev/role": "decode"})])
        assert loops[("ns", "mistral")].poke.is_set()
        assert not loops[("ns", "llama")].poke.is_set()
    finally:
        await reconciler.stop()
