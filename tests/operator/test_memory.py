"""Correctness state outlives status writes and truncation: eviction timers and failure
baselines live in the operator's memory (`logic.Memory`), the status only records them.
Pure tables for `evaluate`, and the real reconcile loop with a status writer that always
fails (403)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from datetime import datetime, timedelta
from typing import Any, cast

import pytest

from kvtopo_operator import logic
from kvtopo_operator.api import MAX_ENGINES_IN_STATUS, EngineState, KVTopologyStatus, Reason, dump
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import evaluate
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import (
    Memory,
    Observed,
    RoundCache,
    WorkerUnreachable,
    WorkerView,
)
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import FakeKube, RecordingWorkers
from tests.operator.test_logic import SPEC, T0, pod, worker
from tests.operator.test_ownership import body


def observe(
    pods: list[Any], workers: dict[str, Any], previous: KVTopologyStatus, **kw: Any
) -> Observed:
    return Observed(3, SPEC, tuple(pods), workers, previous, **kw)


GRACE = timedelta(seconds=SPEC.eviction.grace_seconds)


def test_a_gone_engine_is_evicted_after_the_grace_though_no_status_was_written() -> None:
    both = [pod("p0", "prefill"), pod("d0", "decode")]
    live = {"p0": worker("P0", "prefill", {"D0"}), "d0": worker("D0", "decode", {"P0"})}
    written = evaluate(observe(both, live, KVTopologyStatus()), T0).status  # the last write
    only_p0 = {"p0": live["p0"]}
    # d0 is deleted; every status write fails from now on, so `previous` stays `written`.
    first = evaluate(observe(both[:1], only_p0, written), T0 + timedelta(seconds=1))
    assert first.evictions == () and first.memory is not None
    later = T0 + timedelta(seconds=1) + GRACE
    remembered = evaluate(observe(both[:1], only_p0, written, memory=first.memory), later)
    assert [(e.pod, e.engine_id) for e in remembered.evictions] == [("p0", "D0")]
    # Without the memory the timer restarts every round: never evicted.
    forgetful = evaluate(observe(both[:1], only_p0, written), later)
    assert forgetful.evictions == ()


def test_a_readiness_blip_does_not_count_an_engines_failures_twice() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    failing = worker("D0", "decode", {"P0"}, failures={"transfer_failed": 7})
    live = {"p0": worker("P0", "prefill", {"D0"}), "d0": failing}
    one = evaluate(observe(pods, live, KVTopologyStatus()), T0)
    assert one.status.failures.counts == {"transfer_failed": 7}
    blip = [pod("p0", "prefill"), pod("d0", "decode", ready=False)]  # 3 s NotReady
    two = evaluate(
        observe(blip, {"p0": live["p0"]}, one.status, memory=one.memory),
        T0 + timedelta(seconds=3),
    )
    three = evaluate(observe(pods, live, two.status, memory=two.memory), T0 + timedelta(seconds=6))
    assert three.status.failures.counts == {"transfer_failed": 7}, "not 14"
    assert not any(e.reason == "TransferFailures" for e in three.events)
    # From the status alone (the old way) the blip doubled the count.
    two_old = evaluate(observe(blip, {"p0": live["p0"]}, one.status), T0 + timedelta(seconds=3))
    three_old = evaluate(observe(pods, live, two_old.status), T0 + timedelta(seconds=6))
    assert three_old.status.failures.counts == {"transfer_failed": 14}


def test_beyond_the_status_limit_counters_do_not_grow_every_round() -> None:
    n = MAX_ENGINES_IN_STATUS + 60
    pods = [pod("p0", "prefill")] + [pod(f"d{i:04d}", "decode") for i in range(n)]
    decodes = {f"d{i:04d}": f"D{i:04d}" for i in range(n)}
    live: dict[str, Any] = {"p0": worker("P0", "prefill", set(decodes.values()))}
    for name, eid in decodes.items():
        live[name] = worker(eid, "decode", {"P0"}, failures={"transfer_failed": 1})
    one = evaluate(observe(pods, live, KVTopologyStatus()), T0)
    assert len(one.status.engines) == MAX_ENGINES_IN_STATUS
    assert one.status.failures.counts == {"transfer_failed": n}
    two = evaluate(observe(pods, live, one.status, memory=one.memory), T0 + timedelta(seconds=2))
    assert two.status.failures.counts == {"transfer_failed": n}
    assert not any(e.reason == "TransferFailures" for e in two.events)
    # From the status alone (a restarted operator) the engines past the limit are not
    # counted again: the status says lines were left out, so their counters are baselines.
    old = evaluate(observe(pods, live, one.status), T0 + timedelta(seconds=2))
    assert one.status.engines_omitted == n + 1 - MAX_ENGINES_IN_STATUS
    assert old.status.failures.counts == {"transfer_failed": n}


class RefusingKube(FakeKube):
    """Every status write is refused, as by an admission webhook or RBAC gone wrong."""

    refused = 0

    async def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str,
        uid: str = "",
    ) -> bool:
        self.refused += 1
        raise RuntimeError("(403) Forbidden: denied by admission webhook")


@pytest.mark.asyncio
async def test_with_every_status_write_refused_a_gone_engine_is_still_evicted() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = RefusingKube({"llama": body("llama", "2026-11-30T11:00:00Z")})
    spec = dump(
        SPEC.model_copy(update={"eviction": SPEC.eviction.model_copy(update={"grace_seconds": 1})})
    )
    kube.bodies["llama"]["spec"] = spec
    workers = RecordingWorkers.for_pods(pods)
    current = list(pods)
    metrics = OperatorMetrics()
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: current,
        topologies=lambda namespace: [],
        metrics=metrics,
        settings=Settings(resync_s=0.05, retry_s=0.01),
    )

    def peers_of(name: str) -> frozenset[str]:
        view = workers.views[next(p.endpoint for p in pods if p.name == name)]
        assert isinstance(view, WorkerView)
        return view.peers

    try:
        reconciler.ensure(("ns", "llama"))
        for _ in range(400):
            await asyncio.sleep(0.01)
            if peers_of("p0") == {"D0"}:
                break
        assert peers_of("p0") == {"D0"} and kube.refused > 0
        current.remove(pods[1])  # d0 deleted
        loop = asyncio.get_running_loop()
        gone_at = loop.time()
        while peers_of("p0") and loop.time() - gone_at < 10:  # noqa: ASYNC110 - polls state
            await asyncio.sleep(0.02)
        took = loop.time() - gone_at
        assert peers_of("p0") == frozenset(), "evicted although no status was ever written"
        assert 1.0 <= took < 3.0, took
        assert metrics.status_write_failures._value.get() == kube.refused
    finally:
        reconciler.cancel_all()


class Unprocessable(Exception):
    """What the kubernetes client raises for a 422: the API server refused the content."""

    status = 422
    body = '{"message": "status.failures.counts: Invalid value"}'


class RefusingContent(FakeKube):
    """Every status write is refused for its content (422), as a write past a schema bound."""

    refused = 0

    async def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str,
        uid: str = "",
    ) -> bool:
        self.refused += 1
        raise Unprocessable("(422) Unprocessable Entity")


@pytest.mark.asyncio
async def test_a_refused_status_write_backs_off_and_is_said_once() -> None:
    """A refusal that will repeat is not retried every 0.2 s forever: the writer backs off
    exponentially (retry_s doubling, capped), and one StatusWriteRefused Event says why,
    while the rounds' decisions go on."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = RefusingContent({"llama": body("llama", "2026-11-30T11:00:00Z")})
    kube.bodies["llama"]["spec"] = dump(SPEC)
    workers = RecordingWorkers.for_pods(pods)
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods,
        topologies=lambda namespace: [],
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=0.02, retry_s=0.1, status_interval_s=0.0),
    )
    try:
        reconciler.ensure(("ns", "llama"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < 3.2:  # noqa: ASYNC110 - observing the writer's pace
            await asyncio.sleep(0.05)
        # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s: at most 6 tries in 3.2 s (every 0.1 s: 32).
        assert 3 <= kube.refused <= 6, kube.refused
        refusals = [e for e in kube.events if e[2] == "StatusWriteRefused"]
        assert len(refusals) == 1 and "422" in refusals[0][3], kube.events
        assert workers.calls, "the rounds stopped deciding"
    finally:
        reconciler.cancel_all()


@pytest.mark.asyncio
async def test_a_topology_deleted_while_the_watch_was_away_is_forgotten() -> None:
    """The watch missed the deletion (a relist after 410 sends no DELETED) and still hands
    the reconciler the old body: the first status write answered 404 makes the loop ask the
    API server itself, and a topology gone there is forgotten; writes stop."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    stale = body("llama", "2026-11-30T11:00:00Z")
    stale["spec"] = dump(SPEC)
    kube = FakeKube({})  # the API server no longer has it
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, RecordingWorkers.for_pods(pods)),
        pods=lambda namespace, port: pods,
        topologies=lambda namespace: [],
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=0.02, retry_s=0.02, status_interval_s=0.0),
        bodies=lambda key: stale,  # what the watch still holds
    )
    try:
        reconciler.ensure(("ns", "llama"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        while reconciler.running and loop.time() - start < 5:  # noqa: ASYNC110 - polls state
            await asyncio.sleep(0.02)
        assert reconciler.running == 0, "the deleted topology's loop still runs"
        writes = kube.status_writes
        await asyncio.sleep(0.5)
        assert kube.status_writes == writes <= 2, kube.status_writes
    finally:
        reconciler.cancel_all()


def _view(eid: str, role: str, held: dict[str, str], **kw: Any) -> WorkerView:
    return WorkerView(
        engine_id=eid,
        role=role,  # type: ignore[arg-type]
        compat_hash="hash",
        peers=frozenset(held),
        incarnation=f"i-{eid}",
        peer_incarnations=held,
        **kw,
    )


def _full_mesh(ps: list[str], ds: list[str]) -> dict[str, WorkerView]:
    """Each worker's view with every engine of the other role held (pod name -> view)."""
    inc = {n.upper(): f"i-{n.upper()}" for n in ps + ds}
    return {
        n: _view(
            n.upper(),
            "prefill" if n in ps else "decode",
            {o.upper(): inc[o.upper()] for o in (ds if n in ps else ps)},
        )
        for n in ps + ds
    }


def _as_without_memo(obs: Observed, now: datetime, what: str) -> tuple[KVTopologyStatus, Memory]:
    """`evaluate` of `obs`, asserted equal to the same round with an empty memo: the status
    and the memory for the next round."""
    remembered = evaluate(obs, now)
    empty = dataclasses.replace(obs.memory, cache=RoundCache())
    assert remembered == evaluate(dataclasses.replace(obs, memory=empty), now), what
    assert remembered.memory is not None
    return remembered.status, remembered.memory


def test_the_round_memo_changes_no_decision() -> None:
    """Rounds that carry `Memory.cache` decide exactly as rounds that start without it,
    through unchanged views (the memo's hits), replaced ones, a restarted engine, an
    unhealthy peer, evictions and a pairing label change."""
    ps, ds = ["p0", "p1", "p2"], ["d0", "d1", "d2", "d3"]
    pods = {n: pod(n, "prefill" if n in ps else "decode") for n in ps + ds}
    views = _full_mesh(ps, ds)
    rounds: list[dict[str, WorkerView]] = [dict(views), dict(views)]
    # d3 goes; p0 and p1 have dropped it, p2 still holds it.
    r = {n: v for n, v in views.items() if n != "d3"}
    for n in ("p0", "p1"):
        held = {k: x for k, x in r[n].peer_incarnations.items() if k != "D3"}
        r[n] = dataclasses.replace(r[n], peers=frozenset(held), peer_incarnations=held)
    rounds += [r, dict(r)]
    # d0 restarts (a new incarnation), p1 reports d1 unhealthy.
    r = dict(r)
    r["d0"] = dataclasses.replace(r["d0"], incarnation="i-D0-2")
    r["p1"] = dataclasses.replace(r["p1"], unhealthy_peers={"D1": "dropped: disconnected"})
    rounds += [r, dict(r)]
    rounds.append({n: v for n, v in r.items() if n != "d1"})
    pod_rounds = [list(pods.values())] * len(rounds)
    relabeled = dict(pods, d2=pod("d2", "decode", version="v2"))
    rounds.append(dict(rounds[-1]))
    pod_rounds.append(list(relabeled.values()))
    previous, memory = KVTopologyStatus(), Memory()
    for i, (round_pods, workers) in enumerate(zip(pod_rounds, rounds, strict=True)):
        now = T0 + timedelta(seconds=5 * i)
        present = [p for p in round_pods if p.name in workers]
        obs = Observed(3, SPEC, tuple(present), workers, previous, memory=memory)
        previous, memory = _as_without_memo(obs, now, f"round {i}")
    assert memory.cache.results  # the memo was used and kept


@pytest.mark.parametrize("seed", range(12))
def test_patched_results_decide_as_fresh_ones_through_random_churn(seed: int) -> None:
    """Rounds whose views the operator derived from last round's (`WorkerView.answered`:
    adds, evictions, deferred ones, several batches between two rounds, more than the
    lineage reaches) and whose groups changed (engines joining, leaving, restarting,
    relabelled, some without an incarnation), mixed with views read anew (health reports),
    decide exactly as rounds that start with an empty memo."""
    rng = random.Random(seed)
    ps, ds = [f"p{i}" for i in range(4)], [f"d{i}" for i in range(6)]
    pods = {n: pod(n, "prefill" if n in ps else "decode") for n in ps + ds}
    views = _full_mesh(ps, ds)
    next_id = 100
    previous, memory = KVTopologyStatus(), Memory()
    patched = 0
    for i in range(30):
        names = sorted(views)
        for _ in range(rng.randrange(6)):  # the operator's own calls, answered
            holder = rng.choice(names)
            v = views[holder]
            others = [views[n] for n in names if views[n].role != v.role]
            added = {
                o.engine_id: o.incarnation if rng.random() < 0.9 else "stale"
                for o in rng.sample(others, min(len(others), rng.randrange(3)))
            }
            evicted = {
                eid: rng.choice(["evicted", "absent", "deferred"])
                for eid in rng.sample(sorted(v.peers), min(len(v.peers), rng.randrange(2)))
            }
            views[holder] = v.answered(added, evicted)
        roll = rng.random()
        if roll < 0.15 and len(views) > 4:  # an engine goes
            gone = rng.choice(names)
            del views[gone], pods[gone]
        elif roll < 0.3:  # an engine comes (its worker holds nothing yet)
            role = rng.choice(["prefill", "decode"])
            name = f"{role[0]}{next_id}"
            next_id += 1
            pods[name] = pod(name, role)
            inc = "" if rng.random() < 0.3 else f"i-{name}"
            views[name] = dataclasses.replace(_view(name.upper(), role, {}), incarnation=inc)
        elif roll < 0.4:  # an engine restarts under its id
            name = rng.choice(names)
            views[name] = dataclasses.replace(views[name], incarnation=f"i-{name}-{i}")
        elif roll < 0.5:  # a view read anew: a peer reported unhealthy
            name = rng.choice(names)
            v = views[name]
            if v.peers:
                sick = rng.choice(sorted(v.peers))
                views[name] = dataclasses.replace(v, unhealthy_peers={sick: "dropped: gone"})
        elif roll < 0.55:  # relabelled into another pairing group, or back
            name = rng.choice(names)
            version = "v2" if pods[name].labels["version"] == "v1" else "v1"
            pods[name] = pod(name, pods[name].role, version=version)
        now = T0 + timedelta(seconds=5 * i)
        obs = Observed(3, SPEC, tuple(pods.values()), dict(views), previous, memory=memory)
        before = dict(memory.cache.results)
        previous, memory = _as_without_memo(obs, now, f"seed {seed}, round {i}")
        patched += sum(
            1
            for key, (view, _, _) in memory.cache.results.items()
            if key in before and before[key][0] is not view and view.changed_since(before[key][0])
        )
    assert patched  # derived views met last round's results


def test_a_derived_views_result_is_patched_not_computed_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the operator's calls changed every prefill's view by a few engines, a round
    computes no holder's result over its whole group (a rollout's round is not its cold
    price): only the engines that changed are looked at."""
    ps, ds = [f"p{i}" for i in range(3)], [f"d{i}" for i in range(5)]
    pods = [pod(n, "prefill" if n in ps else "decode") for n in ps + ds]
    views = _full_mesh(ps, ds)
    first = evaluate(Observed(3, SPEC, tuple(pods), views, KVTopologyStatus()), T0)
    assert first.memory is not None and first.pairs_connected == 15
    # d4 is replaced by d5: every prefill evicts D4 and adds D5 (one batch each).
    d5 = _view("D5", "decode", {p.upper(): f"i-{p.upper()}" for p in ps})
    now = {n: v for n, v in views.items() if n != "d4"}
    now["d5"] = d5
    for p in ps:
        now[p] = views[p].answered({"D5": "i-D5"}, {"D4": "evicted"})
    pods = [p for p in pods if p.name != "d4"] + [pod("d5", "decode")]
    whole: list[str] = []
    real = logic._held_as_is
    monkeypatch.setattr(logic, "_held_as_is", lambda h, a: whole.append(h.engine_id) or real(h, a))
    obs = Observed(3, SPEC, tuple(pods), now, first.status, memory=first.memory)
    second = evaluate(obs, T0 + timedelta(seconds=5))
    assert second.pairs_connected == second.pairs_expected == 15
    assert whole == ["D5"]  # the new engine alone: nothing to patch from
    # A prefill whose view was read anew (no lineage) is computed whole.
    now["p0"] = dataclasses.replace(now["p0"], peer_incarnations=dict(now["p0"].peer_incarnations))
    whole.clear()
    obs = Observed(3, SPEC, tuple(pods), now, second.status, memory=second.memory)
    evaluate(obs, T0 + timedelta(seconds=10))
    assert whole == ["P0"]


def test_an_unchanged_engine_line_is_last_rounds_line_and_a_changed_one_is_new() -> None:
    """A round keeps the previous status's line of each engine whose line would say the
    same (lines are immutable; building two thousand anew each round was a fifth of it),
    and builds the line of an engine whose peers changed, with its `since` kept."""
    ps, ds = ["p0", "p1"], ["d0", "d1"]
    pods = [pod(n, "prefill" if n in ps else "decode") for n in ps + ds]
    views = _full_mesh(ps, ds)
    first = evaluate(Observed(3, SPEC, tuple(pods), views, KVTopologyStatus()), T0)
    lines = {e.pod: e for e in first.status.engines}
    assert {e.state for e in lines.values()} == {EngineState.CONNECTED}
    # p0 now holds one more (unknown) peer: its line changes, the others do not.
    changed = dict(views)
    held = {**views["p0"].peer_incarnations, "X": "i-X"}
    changed["p0"] = dataclasses.replace(views["p0"], peers=frozenset(held), peer_incarnations=held)
    obs = Observed(3, SPEC, tuple(pods), changed, first.status, memory=first.memory)
    second = evaluate(obs, T0 + timedelta(seconds=5))
    again = {e.pod: e for e in second.status.engines}
    assert all(again[n] is lines[n] for n in ("p1", "d0", "d1"))
    assert again["p0"] is not lines["p0"]
    assert (again["p0"].peers, lines["p0"].peers) == (3, 2)
    assert again["p0"].since == lines["p0"].since  # still Connected since the first round


def test_usable_engines_judges_a_pod_again_only_when_its_pod_or_worker_view_changed() -> None:
    """`usable_engines` with last round's memo takes a pod's judgement as it was while its
    pod view and worker view are the same objects, judges it again when either changed
    (not ready, unreachable, another pod's worker, another role), and still finds two pods
    whose workers report one engine id, each judged last round. Every round is compared
    with the same round judged without the memo."""
    ps, ds = ["p0", "p1"], ["d0", "d1", "d2"]
    pods = {n: pod(n, "prefill" if n in ps else "decode") for n in ps + ds}
    views: dict[str, WorkerView | WorkerUnreachable] = dict(_full_mesh(ps, ds))
    cache = RoundCache()

    def judged() -> logic.Engines:
        fresh = logic.usable_engines(list(pods.values()), views)
        remembered = logic.usable_engines(list(pods.values()), views, cache)
        assert remembered == fresh
        return remembered

    first = judged()
    assert sorted(first.live) == ["D0", "D1", "D2", "P0", "P1"]
    again = judged()
    assert all(again.live[eid] is first.live[eid] for eid in first.live), "not judged anew"
    pods["d0"] = dataclasses.replace(pods["d0"], ready=False)
    views["d1"] = WorkerUnreachable("connection refused")
    views["p1"] = dataclasses.replace(cast(WorkerView, views["p1"]), pod_uid="another-pod")
    views["d2"] = dataclasses.replace(cast(WorkerView, views["d2"]), role="prefill")
    changed = judged()
    assert sorted(changed.live) == ["P0"]
    assert changed.live["P0"] is first.live["P0"]
    assert {name: why for name, (_, _, why) in changed.unusable.items()} == {
        "d1": Reason.WORKER_UNREACHABLE,
        "d2": Reason.WORKER_UNREACHABLE,
        "p1": Reason.IDENTITY_MISMATCH,
    }
    # Back as they were, then a new pod whose worker reports P0's engine id: it is refused.
    pods["d0"] = dataclasses.replace(pods["d0"], ready=True)
    views.update(_full_mesh(ps, ds))
    judged()
    pods["p9"] = pod("p9", "prefill")
    views["p9"] = dataclasses.replace(cast(WorkerView, views["p0"]))
    twins = judged()  # no holder named: the pod up first (then by name) keeps the id
    assert twins.live["P0"].pod.name == "p0"
    assert "p0" not in twins.unusable
    assert twins.unusable["p9"][2] == Reason.DUPLICATE_ENGINE_ID
    del pods["p9"], views["p9"]
    assert "P0" in judged().live


@pytest.mark.parametrize("seed", range(8))
def test_a_gone_engine_s_holders_are_every_usable_engine_that_holds_it(seed: int) -> None:
    """`evictions_due` finds a gone engine's holders among what each holds beyond its
    partners or is evicting: they are exactly the usable engines whose peers include it,
    those evicting it (a deferred eviction) counted too and sent no second eviction."""
    rng = random.Random(seed)
    ps, ds = [f"p{i}" for i in range(4)], [f"d{i}" for i in range(8)]
    views = _full_mesh(ps, ds)
    gone_ids = {f"D{i}" for i in range(8, 12)} | {f"P{i}" for i in range(4, 6)}
    for name, v in list(views.items()):
        others = sorted(i for i in gone_ids if (i[0] == "D") == (v.role == "prefill"))
        held = {i: f"i-{i}" for i in others if rng.random() < 0.6}
        if rng.random() < 0.2:  # a stray: a gone engine of its own role
            stray = rng.choice(sorted(gone_ids))
            held[stray] = f"i-{stray}"
        evicting = frozenset(i for i in held if rng.random() < 0.3)
        views[name] = dataclasses.replace(
            v,
            peers=v.peers | frozenset(held),
            peer_incarnations={**v.peer_incarnations, **held},
            evicting=evicting,
        )
    pods = [pod(n, "prefill" if n in ps else "decode") for n in ps + ds]
    engines = logic.usable_engines(pods, dict(views))
    gone = {
        eid: logic.Gone(eid.lower(), "decode" if eid[0] == "D" else "prefill", "", T0 - GRACE_LONG)
        for eid in gone_ids
    }
    for pairing in (
        logic.pair_engines(SPEC, engines.live),
        logic.pair_engines(SPEC, engines.live, extra=False),
    ):
        got = logic.evictions_due(engines.live, gone, pairing, Memory(), timedelta(seconds=1), T0)
        assert got.still_held == {
            g: sum(1 for e in engines.live.values() if g in e.worker.peers) for g in gone
        }
        assert sorted((e.pod, e.engine_id) for e in got.evictions) == sorted(
            (e.pod.name, g)
            for g in gone
            for e in engines.live.values()
            if g in e.worker.peers and g not in e.worker.evicting
        )


GRACE_LONG = timedelta(seconds=60)
