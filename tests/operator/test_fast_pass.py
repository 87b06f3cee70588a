"""Engines that come up after a round gathered (`Reconciler._arrivals`, `logic.admissions`):
late arrivals join the round's own calls, and the fast pass (on by default) pairs them in
the pause after a round; both by the rules of a round and under its spec, claim and view of
which engines are usable, acting on nothing they cannot vouch for; what the fast pass's
calls end with is the next round's. Built through the real constructor with the fakes of
`tests.operator.fakes`; the loop's first rounds run as in production, the fast pass is then
called as `_between_rounds` calls it, and each such test checks that no round ran
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import admissions
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import PodView, WorkerUnreachable, WorkerView
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import FakeKube, HungCalls, RecordingWorkers
from tests.operator.test_reconcile import KEY, SPEC, build, pod, topology_body, until


def worker_of(p: PodView, **changes: object) -> WorkerView:
    return dataclasses.replace(
        WorkerView(p.name.upper(), p.role, "h", frozenset(), pod_uid=p.uid), **changes
    )


async def settled(reconciler: Reconciler, workers: RecordingWorkers, pods: list[PodView]) -> float:
    """Runs the loop until every pair of `pods` is held both ways and a round has ended
    since; returns when that round ended (monotonic)."""
    reconciler.ensure(KEY)
    prefills = {p.name.upper() for p in pods if p.role == "prefill"}
    decodes = {p.name.upper() for p in pods if p.role == "decode"}

    def meshed() -> bool:
        return all(
            workers.peers_of(p.endpoint) == (decodes if p.role == "prefill" else prefills)
            for p in pods
        )

    await until("the first pairs", meshed)
    loop = reconciler._loops[KEY]
    seen = loop.round_ended
    await until("a round after them", lambda: loop.round_ended > seen)
    return loop.round_ended


def passing_while_acting(
    pods: list[PodView], kube: FakeKube, workers: RecordingWorkers
) -> Reconciler:
    """A reconciler over `pods` whose rounds wait up to 30 s for their calls (no straggler
    rule ends a wait whose every call hangs) and run passes meanwhile (with the gather's
    arrivals left to the round's own calls)."""
    return Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: list(pods),
        metrics=OperatorMetrics(),
        settings=Settings(
            resync_s=60.0,
            retry_s=0.01,
            round_wait_s=30.0,
            status_interval_s=0,
            passes_while_acting=True,
            # The round's gather would pair its new engines itself, by calls the round
            # does not wait for: these tests need a round that waits on its own calls.
            admit_while_deciding=False,
        ),
    )


@contextlib.asynccontextmanager
async def settled_loop(
    pods: list[PodView],
) -> AsyncIterator[tuple[FakeKube, RecordingWorkers, Reconciler, float]]:
    """A reconciler over `pods` (listed afresh each round) whose loop has settled
    (`settled`): its kube, workers, itself and when the settling round ended; stopped after."""
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = build(lambda: pods, kube, workers)
    try:
        yield kube, workers, reconciler, await settled(reconciler, workers, pods)
    finally:
        await reconciler.stop()


@pytest.mark.asyncio
async def test_a_decode_up_since_the_last_round_is_paired_by_the_fast_pass_alone() -> None:
    pods = [pod("p0", "prefill"), pod("p1", "prefill"), pod("d0", "decode")]
    async with settled_loop(pods) as (kube, workers, reconciler, ended):
        loop = reconciler._loops[KEY]
        d1 = pod("d1", "decode")
        workers.views[d1.endpoint] = worker_of(d1)
        pods.append(d1)
        reads = len(workers.reads)
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        # Both halves of both pairs, with one read: the new worker's only.
        assert workers.peers_of(d1.endpoint) == {"P0", "P1"}
        assert all("D1" in workers.peers_of(p.endpoint) for p in pods[:2])
        assert workers.reads[reads:] == [d1.endpoint]
        assert loop.round_ended == ended  # no round ran
        assert reconciler.metrics.arrival_handshakes._value.get() == 4
        # Nothing left for a round to make: the views hold what the calls made.
        loop.poke.set()
        await until("a round after the fast pass", lambda: loop.round_ended > ended)
        await until(
            "the status with every pair",
            lambda: kube.bodies["llama"]["status"]["summary"]["pairs"] == "4/4",
        )


@pytest.mark.asyncio
async def test_the_fast_pass_acts_on_nothing_it_cannot_vouch_for() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    async with settled_loop(pods) as (kube, workers, reconciler, ended):
        loop = reconciler._loops[KEY]
        calls = len(workers.calls)
        # A worker of another pod, a second engine with d0's engine id, and one that is not
        # up yet: none is paired; the round says why.
        stranger, twin, down = pod("d1", "decode"), pod("d2", "decode"), pod("d3", "decode")
        workers.views[stranger.endpoint] = worker_of(stranger, pod_uid="uid-elsewhere")
        workers.views[twin.endpoint] = worker_of(twin, engine_id="D0")
        workers.views[down.endpoint] = worker_of(down)
        pods += [stranger, twin, dataclasses.replace(down, ready=False)]
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        made = [c for c in workers.calls[calls:] if c[0] != "state"]
        assert made == []
        assert sorted(workers.reads[-2:]) == sorted([stranger.endpoint, twin.endpoint])
        # A spec changed since the last round: the round reads it; the pass does nothing.
        late = pod("d4", "decode")
        workers.views[late.endpoint] = worker_of(late)
        pods.append(late)
        kube.bodies["llama"]["metadata"]["generation"] = 2
        reads = len(workers.reads)
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        assert len(workers.reads) == reads
        assert loop.round_ended == ended


@pytest.mark.asyncio
async def test_what_the_fast_pass_s_calls_end_with_is_the_next_round_s() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    async with settled_loop(pods) as (kube, workers, reconciler, ended):
        loop = reconciler._loops[KEY]
        d1 = pod("d1", "decode")
        workers.views[d1.endpoint] = worker_of(d1)
        workers.refused_adds = {"D1"}  # the prefill cannot add it
        pods.append(d1)
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        assert "D1" not in workers.peers_of(pods[0].endpoint)
        assert workers.peers_of(d1.endpoint) == {"P0"}
        assert not any(e[2] == "HandshakeFailed" for e in kube.events)
        # The next round takes the failure (its Event), though its own try of the half
        # succeeds: the prefill takes the decode now.
        workers.refused_adds = set()
        loop.poke.set()
        await until("a round after the fast pass", lambda: loop.round_ended > ended)
        await until(
            "the failure's Event", lambda: any(e[2] == "HandshakeFailed" for e in kube.events)
        )
        assert sum(1 for e in kube.events if e[2] == "HandshakeFailed") == 1
        await until("the half, made", lambda: "D1" in workers.peers_of(pods[0].endpoint))


def test_admissions_pair_only_the_new_engines_rows_by_the_round_s_rules() -> None:
    spec = SPEC.model_copy(
        update={"pairing": SPEC.pairing.model_copy(update={"match_labels": ["zone"]})}
    )

    def zoned(name: str, role: str, zone: str) -> PodView:
        p = pod(name, role)
        return dataclasses.replace(p, labels={**p.labels, "zone": zone})

    p0, p1, d0, d1 = (
        zoned("p0", "prefill", "a"),
        zoned("p1", "prefill", "b"),
        zoned("d0", "decode", "a"),
        zoned("d1", "decode", "a"),
    )
    views = {p.name: worker_of(p) for p in (p0, p1, d0, d1)}
    views["d0"] = dataclasses.replace(views["d0"], peers=frozenset({"P0"}))
    live = {"P0": "p0", "P1": "p1", "D0": "d0"}
    made = admissions(spec, [p0, p1, d0, d1], views, {"d1"}, live)
    # d1 pairs with its zone's prefill only, both halves; d0's own missing half (P0 lacks
    # it) is the round's, not the fast pass's.
    assert sorted((h.pod, h.peer_engine_id) for h in made) == [("d1", "P0"), ("p0", "D1")]
    # A new prefill and a new decode: each one's row, with the old engines too, but not the
    # old engines' own missing half (P0 lacks D0: the round's).
    p2 = zoned("p2", "prefill", "a")
    views["p2"] = worker_of(p2)
    both = admissions(spec, [p0, p1, p2, d0, d1], views, {"d1", "p2"}, live)
    assert sorted((h.pod, h.peer_engine_id) for h in both) == [
        ("d0", "P2"),
        ("d1", "P0"),
        ("d1", "P2"),
        ("p0", "D1"),
        ("p2", "D0"),
        ("p2", "D1"),
    ]
    # A prefill the last round did not find usable is no partner; nor is an incompatible one.
    assert admissions(spec, [p0, d1], views, {"d1"}, {"D0": "d0"}) == ()
    views["d1"] = dataclasses.replace(views["d1"], compat_hash="other")
    assert admissions(spec, [p0, d1], views, {"d1"}, live) == ()


class _Unwalkable(dict[str, str]):
    """A prefill's record of the peers it holds that may be looked up, never walked whole."""

    def _walked(self, *_: object) -> object:
        raise AssertionError("a new decode's pairing walked a prefill's whole peer record")

    items = keys = values = __iter__ = _walked  # type: ignore[assignment]


def test_a_new_decode_s_admission_costs_its_own_rows_not_its_prefills_whole_records() -> None:
    """A prefill at 64 x 2,000 holds two thousand peers: pairing one new decode with it
    looks up that decode in its record and never walks the record whole (before: 4.3 ms
    per admission of one decode at 64 x 2,000; after: 0.5 ms)."""
    held = {f"D{i}": f"inc-D{i}" for i in range(2000)}
    prefills = [pod(f"p{i}", "prefill") for i in range(4)]
    old = pod("d0", "decode")
    views: dict[str, WorkerView | WorkerUnreachable] = {
        p.name: dataclasses.replace(
            worker_of(p), peers=frozenset(held), peer_incarnations=_Unwalkable(held)
        )
        for p in prefills
    }
    views["d0"] = dataclasses.replace(worker_of(old), incarnation="inc-D0")
    new = pod("d9000", "decode")
    views["d9000"] = worker_of(new, incarnation="inc-D9000")
    live = {**{f"P{i}": f"p{i}" for i in range(4)}, "D0": "d0"}
    made = admissions(SPEC, [*prefills, old, new], views, {"d9000"}, live)
    assert sorted((h.pod, h.peer_engine_id) for h in made) == sorted(
        [("d9000", f"P{i}") for i in range(4)] + [(f"p{i}", "D9000") for i in range(4)]
    )
    # One of them holds the new decode already, at its incarnation: that half is not made.
    views["p0"] = dataclasses.replace(
        views["p0"],
        peers=frozenset({*held, "D9000"}),
        peer_incarnations=_Unwalkable({**held, "D9000": "inc-D9000"}),
    )
    again = admissions(SPEC, [*prefills, old, new], views, {"d9000"}, live)
    assert ("p0", "D9000") not in {(h.pod, h.peer_engine_id) for h in again}
    assert len(again) == len(made) - 1


@pytest.mark.asyncio
async def test_a_decode_up_after_the_round_s_gather_joins_that_round_s_calls() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    d1 = pod("d1", "decode")
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods([*pods, d1])
    listed: list[int] = []  # how many pods each listing gave

    def listing() -> list[PodView]:
        # From the round's gather on, the next listing (the one just before it acts)
        # has the new decode: it came up while the round decided.
        out = list(pods)
        if armed and len(listed) >= armed[0]:
            out.append(d1)
        listed.append(len(out))
        return out

    armed: list[int] = []
    reconciler = build(listing, kube, workers)
    try:
        ended = await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        armed.append(len(listed) + 1)  # the round's first listing lacks it, the next has it
        loop.poke.set()
        await until(
            "the new pair, both ways",
            lambda: (
                workers.peers_of(d1.endpoint) == {"P0"}
                and "D1" in workers.peers_of(pods[0].endpoint)
            ),
        )
        # Both halves were planned as arrivals, in the round that had not gathered it.
        assert reconciler.metrics.arrival_handshakes._value.get() == 2
        assert listed[armed[0] - 1 : armed[0] + 1] == [2, 3]
        assert workers.reads.count(d1.endpoint) == 1
        assert loop.round_ended > ended
        await until(
            "the status with the new pair",
            lambda: kube.bodies["llama"]["status"]["summary"]["pairs"] == "2/2",
        )
    finally:
        await reconciler.stop()


@pytest.mark.asyncio
async def test_a_worker_read_after_the_round_s_wait_is_paired_by_the_fast_pass_once() -> None:
    """A worker whose read ended after the round's wait (or a new worker's retry that
    succeeded) was not decided on by that round: the fast pass pairs it as an arrival, once,
    instead of leaving it to the next full round; an engine the round saw and did not find
    usable stays the round's."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    async with settled_loop(pods) as (_kube, workers, reconciler, ended):
        loop = reconciler._loops[KEY]
        d1, twin = pod("d1", "decode"), pod("d2", "decode")
        workers.views[d1.endpoint] = worker_of(d1)
        workers.views[twin.endpoint] = worker_of(twin, engine_id="D0")
        pods += [d1, twin]
        # The reads end outside any round or pass, as a read the round stopped waiting for.
        await loop.views.read_new([d1, twin], concurrency=4, timeout_s=1.0)
        calls = len(workers.calls)
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        assert workers.peers_of(d1.endpoint) == {"P0"}
        assert "D1" in workers.peers_of(pods[0].endpoint)
        assert reconciler.metrics.arrival_handshakes._value.get() == 2
        assert loop.round_ended == ended  # no round ran
        made = [c for c in workers.calls[calls:] if c[0] != "state"]
        assert twin.endpoint not in {c[1] for c in made}
        # Paired once: a second pass has nothing to do.
        calls = len(workers.calls)
        await reconciler._fast_pass(KEY, loop, time.monotonic() + 2.0)
        assert [c for c in workers.calls[calls:] if c[0] != "state"] == []
        assert reconciler.metrics.arrival_handshakes._value.get() == 2


@pytest.mark.asyncio
async def test_a_decode_up_while_a_round_acts_is_paired_before_the_round_ends() -> None:
    """A round waits for its calls (here up to 30 s: every one of them hangs, so no
    straggler rule ends the wait early); a decode that comes up meanwhile is read and
    paired by a pass during the wait: its own half at once, the prefill's half queued
    behind the prefill's call out and made when it ends, all before the round ends."""
    p0, d0, d1, d2 = (
        pod(n, "prefill" if n[0] == "p" else "decode") for n in ("p0", "d0", "d1", "d2")
    )
    pods = [p0, d0]
    kube = FakeKube({"llama": topology_body()})
    workers = HungCalls.for_pods([p0, d0, d1, d2])
    reconciler = passing_while_acting(pods, kube, workers)
    try:
        await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        workers.hung = {p0.endpoint, d1.endpoint}
        ended = loop.round_ended
        pods.append(d1)
        reconciler.poke_namespace("ns")
        await until(
            "the round's calls out",
            lambda: (
                workers.calls.count(("change_peers (hung)", p0.endpoint)) == 1
                and ("change_peers (hung)", d1.endpoint) in workers.calls
            ),
        )
        pods.append(d2)
        reconciler.poke_namespace("ns")
        await until("d2 holds P0", lambda: workers.peers_of(d2.endpoint) == {"P0"})
        assert p0.name in loop.calls.queued  # its half of the pair, behind its call out
        assert loop.round_ended == ended, "the round ended: the pair was not the pass's"
        workers.release.set()
        await until(
            "p0 holds every decode", lambda: workers.peers_of(p0.endpoint) == {"D0", "D1", "D2"}
        )
        await until("a round after it", lambda: loop.round_ended > ended)
        await until(
            "the status with every pair",
            lambda: kube.bodies["llama"]["status"]["summary"]["pairs"] == "3/3",
        )
    finally:
        workers.release.set()
        await reconciler.stop()


@pytest.mark.asyncio
async def test_a_hung_worker_up_while_a_round_acts_holds_the_round_no_longer() -> None:
    """A worker that comes up while a round acts and never answers its read (SIGSTOPped)
    holds the pass that reads it, not the round: once the round's calls end, the round
    ends (the pass's wait for the read, 30 s here, would otherwise hold it), and an engine
    that answers is paired after."""
    release, read_release = asyncio.Event(), asyncio.Event()

    class Hung(RecordingWorkers):
        hung_calls: set[str] = set()
        hung_reads: set[str] = set()

        async def change_peers(self, endpoint: str, *args: Any, **kw: Any) -> Any:
            if endpoint in self.hung_calls:
                self.calls.append(("change_peers (hung)", endpoint))
                await release.wait()
            return await super().change_peers(endpoint, *args, **kw)

        async def state(self, endpoint: str, *args: Any, **kw: Any) -> Any:
            if endpoint in self.hung_reads:
                self.calls.append(("state (hung)", endpoint))
                await read_release.wait()
            return await super().state(endpoint, *args, **kw)

    p0, d0, d1, d2, d3 = (
        pod(n, "prefill" if n[0] == "p" else "decode") for n in ("p0", "d0", "d1", "d2", "d3")
    )
    pods = [p0, d0]
    kube = FakeKube({"llama": topology_body()})
    workers = Hung.for_pods([p0, d0, d1, d2, d3])
    reconciler = passing_while_acting(pods, kube, workers)
    try:
        await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        workers.hung_calls = {p0.endpoint, d1.endpoint}
        workers.hung_reads = {d2.endpoint}
        ended = loop.round_ended
        pods.append(d1)
        reconciler.poke_namespace("ns")
        await until(
            "the round's calls out",
            lambda: (
                ("change_peers (hung)", d1.endpoint) in workers.calls
                and ("change_peers (hung)", p0.endpoint) in workers.calls
            ),
        )
        pods.append(d2)  # its worker hangs: the pass reading it waits, alone
        reconciler.poke_namespace("ns")
        await until("the hung read out", lambda: ("state (hung)", d2.endpoint) in workers.calls)
        assert loop.round_ended == ended
        release.set()  # the round's calls end; d2's read does not
        await until("the round's end", lambda: loop.round_ended > ended)
        pods.append(d3)
        reconciler.poke_namespace("ns")
        await until("p0 holds D3", lambda: "D3" in workers.peers_of(p0.endpoint))
        assert workers.peers_of(d3.endpoint) == {"P0"}
        assert "D2" not in workers.peers_of(p0.endpoint)
    finally:
        release.set()
        read_release.set()
        await reconciler.stop()


class HeldKube(FakeKube):
    """A kube whose topology reads wait while `held` is set and not released: a round (and
    a pass) under way stops at its first step."""

    held: asyncio.Event | None = None

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.held is not None:
            await self.held.wait()
        return await super().get_topology(namespace, name)


@pytest.mark.asyncio
async def test_a_new_worker_is_read_when_its_pod_is_usable_not_when_the_round_gets_to_it() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = HeldKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = build(lambda: pods, kube, workers)
    reconciler.settings.prefetch_interval_s = 0.05  # off by default (`Settings`)
    try:
        ended = await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        kube.held = asyncio.Event()  # every round and pass from now on waits at its start
        d1 = pod("d1", "decode")
        workers.views[d1.endpoint] = worker_of(d1)
        pods.append(d1)
        reconciler.poke_namespace("ns")  # the pod watch: the namespace's pods changed
        await until("the new worker's first read", lambda: d1.endpoint in workers.reads)
        assert loop.round_ended == ended  # read while no round could have
        assert reconciler.metrics.state_prefetches._value.get() == 1
        kube.held.set()
        await until("d1 paired", lambda: workers.peers_of(d1.endpoint) == {"P0"})
        await until("p0 holds d1", lambda: "D1" in workers.peers_of(pods[0].endpoint))
        assert workers.reads.count(d1.endpoint) == 1  # the rounds took the prefetched view
    finally:
        await reconciler.stop()


@pytest.mark.asyncio
async def test_no_prefetch_before_a_round_decided_nor_of_a_pod_another_topology_owns() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = HeldKube({"llama": topology_body()})
    kube.held = asyncio.Event()  # the first round cannot decide
    workers = RecordingWorkers.for_pods(pods)
    reconciler = build(lambda: pods, kube, workers)
    reconciler.settings.prefetch_interval_s = 0.05  # off by default (`Settings`)
    try:
        reconciler.ensure(KEY)
        loop = reconciler._loops[KEY]
        assert await reconciler._prefetch_once(KEY, loop) == 0  # no round decided yet
        assert workers.reads == []
        kube.held.set()
        await settled(reconciler, workers, pods)
        stranger = dataclasses.replace(
            pod("d2", "decode"), labels={"app": "other", "kvtopo.dev/role": "decode"}
        )
        workers.views[stranger.endpoint] = worker_of(stranger)
        pods.append(stranger)
        assert await reconciler._prefetch_once(KEY, loop) == 0  # not this topology's pod
        assert stranger.endpoint not in workers.reads
    finally:
        await reconciler.stop()


@pytest.mark.asyncio
async def test_an_engine_first_read_at_a_round_s_gather_is_paired_while_the_round_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode the round's gather reads for the first time gets both halves of its pairs
    while the round's decision runs (`Settings.admit_while_deciding`), not after it: in a
    rollout's surge the decision of a 2,000-engine round takes a share of a second. The
    decision here waits (up to 3 s) until it sees both halves made; the round's own plan
    then has nothing left to make for them, and the status counts the pairs."""
    import kvtopo_operator.reconcile as reconcile_module

    pods = [pod("p0", "prefill"), pod("p1", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    # Only rounds: no fast pass and no late arrivals, so the gather is what reads it.
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: list(pods),
        metrics=OperatorMetrics(),
        settings=Settings(
            resync_s=60.0, retry_s=0.01, fast_pass_min_gap_s=float("inf"), late_arrivals_s=0
        ),
    )
    d1 = pod("d1", "decode")
    workers.views[d1.endpoint] = worker_of(d1)
    real_evaluate = reconcile_module.evaluate
    seen_while_deciding: list[bool] = []

    def paired() -> bool:
        return workers.peers_of(d1.endpoint) == {"P0", "P1"} and all(
            "D1" in workers.peers_of(p.endpoint) for p in pods[:2]
        )

    def slow_evaluate(obs: Any, now: Any) -> Any:
        if d1.name in obs.workers and not seen_while_deciding:  # the round that gathered it
            deadline = time.monotonic() + 3.0
            while not paired() and time.monotonic() < deadline:
                time.sleep(0.005)
            seen_while_deciding.append(paired())
        return real_evaluate(obs, now)

    monkeypatch.setattr(reconcile_module, "evaluate", slow_evaluate)
    try:
        ended = await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        pods.append(d1)
        loop.poke.set()
        await until("the round that gathered d1", lambda: bool(seen_while_deciding), 6.0)
        assert seen_while_deciding == [True], "the halves waited for the decision"
        assert reconciler.metrics.arrival_handshakes._value.get() == 4
        await until("a round after it", lambda: loop.round_ended > ended)
        await until(
            "the status with every pair",
            lambda: kube.bodies["llama"]["status"]["summary"]["pairs"] == "4/4",
        )
        # Each half once: the decode got one call with both adds, each prefill one add.
        assert workers.calls.count(("change_peers", d1.endpoint)) == 1
    finally:
        await reconciler.stop()


@pytest.mark.asyncio
async def test_the_gather_s_arrivals_are_paired_only_where_the_round_could_vouch_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attacking the pairing while the round decides: beside a good new decode, a worker of
    another pod, a second engine with a live engine's id and a pod being deleted all reach
    the gather; only the good one is paired before the decision ends, and the round then
    says why the others are not (their status lines), pairing none of them."""
    import kvtopo_operator.reconcile as reconcile_module

    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: list(pods),
        metrics=OperatorMetrics(),
        settings=Settings(
            resync_s=60.0, retry_s=0.01, fast_pass_min_gap_s=float("inf"), late_arrivals_s=0
        ),
    )
    good, stranger, twin = pod("d1", "decode"), pod("d2", "decode"), pod("d3", "decode")
    workers.views[good.endpoint] = worker_of(good)
    workers.views[stranger.endpoint] = worker_of(stranger, pod_uid="uid-elsewhere")
    workers.views[twin.endpoint] = worker_of(twin, engine_id="D0")
    going = dataclasses.replace(pod("d4", "decode"), deleting=True)
    workers.views[going.endpoint] = worker_of(going)
    real_evaluate = reconcile_module.evaluate
    during: list[list[tuple[str, str]]] = []

    def slow_evaluate(obs: Any, now: Any) -> Any:
        if good.name in obs.workers and not during:
            deadline = time.monotonic() + 3.0
            while "D1" not in workers.peers_of(pods[0].endpoint) and time.monotonic() < deadline:
                time.sleep(0.005)
            during.append([c for c in workers.calls if c[0] == "change_peers"])
        return real_evaluate(obs, now)

    monkeypatch.setattr(reconcile_module, "evaluate", slow_evaluate)
    try:
        ended = await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        before = len([c for c in workers.calls if c[0] == "change_peers"])
        pods += [good, stranger, twin, going]
        loop.poke.set()
        await until("the round that gathered them", lambda: bool(during), 6.0)
        made = during[0][before:]
        assert sorted(e for _, e in made) == sorted([good.endpoint, pods[0].endpoint])
        assert workers.peers_of(good.endpoint) == {"P0"}
        assert workers.peers_of(pods[0].endpoint) == {"D0", "D1"}
        await until("a round after it", lambda: loop.round_ended > ended)

        def line(name: str) -> dict[str, Any]:
            engines = kube.bodies["llama"]["status"].get("engines") or []
            return next((e for e in engines if e.get("pod") == name), {})

        await until(
            "the status lines of the refused ones",
            lambda: (
                line(stranger.name).get("state") == "Failed"
                and line(twin.name).get("state") == "Failed"
            ),
        )
        assert workers.peers_of(pods[0].endpoint) == {"D0", "D1"}
        assert stranger.endpoint not in {e for k, e in workers.calls if k == "change_peers"}
        assert twin.endpoint not in {e for k, e in workers.calls if k == "change_peers"}
        assert going.endpoint not in {e for k, e in workers.calls if k == "change_peers"}
    finally:
        await reconciler.stop()


def test_a_round_s_act_drops_only_the_halves_held_as_they_are_now() -> None:
    """What a round's act leaves out of a worker's part (`_still_lacking`): a half the
    worker's view holds now at the same incarnation (made since the plan's views were
    read), and an eviction of a peer it no longer holds; a half held at another
    incarnation, held but unhealthy, or held while being evicted is still made, as the
    decision asked."""
    from kvtopo_operator.calls import WorkerPart as _WorkerPart
    from kvtopo_operator.calls import still_lacking as _still_lacking
    from kvtopo_operator.model import Eviction, Handshake

    def half(peer: str, incarnation: str = "i1") -> Handshake:
        return Handshake("p0", "127.0.0.1:9000", peer, "127.0.0.1:1", "decode", "", incarnation)

    view = WorkerView(
        "P0",
        "prefill",
        "h",
        frozenset({"D0", "D1", "D2", "D3"}),
        evicting=frozenset({"D3"}),
        peer_incarnations={"D0": "i1", "D1": "i0", "D2": "i1", "D3": "i1"},
        unhealthy_peers={"D2": "transfers failing"},
    )
    part = _WorkerPart([half("D0"), half("D1"), half("D2"), half("D3"), half("D4")])
    kept = _still_lacking(part, view)
    assert [h.peer_engine_id for h in kept.adds] == ["D1", "D2", "D3", "D4"]
    # Nothing held: the part as it was; no view (unreachable, not read): as it was.
    fresh = WorkerView("P0", "prefill", "h", frozenset())
    assert _still_lacking(part, fresh) is part
    assert _still_lacking(part, None) is part
    # Evictions: of a peer no longer held (evicted by a call since), dropped; of one held,
    # being evicted (deferred) or not, kept.
    gone = [Eviction("p0", "127.0.0.1:9000", eid) for eid in ("D3", "D0", "D9")]
    kept = _still_lacking(_WorkerPart([], gone), view)
    assert [e.engine_id for e in kept.evicts] == ["D3", "D0"]
    assert _still_lacking(_WorkerPart([], gone), None).evicts == gone


@pytest.mark.asyncio
async def test_a_decode_up_during_the_pause_between_rounds_is_paired_in_that_pause() -> None:
    """The pause between rounds begins with the fast pass; an engine that comes up after
    the fast pass looked is read and paired by a pass in the rest of the pause
    (`Settings.passes_between_rounds`, off by default), not at the next round's gather."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    d1 = pod("d1", "decode")
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods([*pods, d1])
    listings: list[int] = []

    def listing() -> list[PodView]:
        listings.append(len(pods))
        return list(pods)

    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: listing(),
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=30.0, retry_s=0.01, passes_between_rounds=True),
    )
    pausing: asyncio.Future[None] | None = None
    try:
        ended = await settled(reconciler, workers, pods)
        loop = reconciler._loops[KEY]
        # No round can run from here: what pairs the new decode is the pause alone.
        loop.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop.task
        listed = len(listings)
        pausing = asyncio.ensure_future(reconciler._between_rounds(KEY, 5.0))
        await until("the fast pass's look at the pods", lambda: len(listings) > listed)
        pods.append(d1)  # after the fast pass looked: only a later pass can see it
        reconciler.poke_namespace("ns")  # the pod watch's news
        await until(
            "the new pair, both ways, within the pause",
            lambda: (
                workers.peers_of(d1.endpoint) == {"P0"}
                and "D1" in workers.peers_of(pods[0].endpoint)
            ),
        )
        assert not pausing.done()
        assert loop.round_ended == ended
        assert reconciler.metrics.arrival_handshakes._value.get() == 2
    finally:
        if pausing is not None:
            pausing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pausing
        await reconciler.stop()
