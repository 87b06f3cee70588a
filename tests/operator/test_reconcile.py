"""The reconcile loop itself (`reconcile.Reconciler`, built through its real constructor
with the fakes of `tests.operator.fakes`): a status write that fails is retried off the
round's path (the pair is made meanwhile), one refused because another writer moved the
object on is made again on the latest version, a handshake that keeps failing raises one Event
(not one per round), the readiness gate is written only where it changes, and loops start, stop with
their topology and are cancelled together. Every wait polls the fakes' state against a
deadline far below the resync period, so a pass shows the poke, not the timer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from kvtopo_operator.api import KV_CONNECTED_GATE, KVTopologySpec, dump
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import PodView, WorkerView
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import FakeKube, HungCalls, RecordingWorkers

pytestmark = pytest.mark.asyncio
KEY = ("ns", "llama")
SPEC = KVTopologySpec.model_validate(
    {
        "prefill": {"selector": {"matchLabels": {"app": "llama"}}},
        "decode": {"selector": {"matchLabels": {"app": "llama"}}},
    }
)


def pod(name: str, role: str, *, gated: bool = False, gate: str = "") -> PodView:
    return PodView(
        name=name,
        role=role,
        labels={"app": "llama", "kvtopo.dev/role": role},
        ready=True,
        deleting=False,
        endpoint=f"127.0.0.1:{9000 + int(name[1:]) + (0 if role == 'prefill' else 100)}",
        uid=f"uid-{name}",
        gated=gated,
        gate=gate,
    )


def topology_body() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "llama",
            "namespace": "ns",
            "creationTimestamp": "2026-11-30T11:00:00Z",
            "generation": 1,
            "resourceVersion": "1",
            "uid": "uid-llama",
        },
        "spec": dump(SPEC),
    }


def build(
    pods: Callable[[], list[PodView]],
    kube: FakeKube,
    workers: RecordingWorkers,
    resync_s: float = 30.0,
    **settings: Any,
) -> Reconciler:
    return Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods(),
        metrics=OperatorMetrics(),
        # Only pokes (and the plan's own wake-ups) drive rounds within these tests' deadlines.
        settings=Settings(**{"resync_s": resync_s, "retry_s": 0.01, **settings}),
    )


async def until(what: str, probe: Callable[[], bool], timeout_s: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not probe():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)  # yields to the loop under test; polls its effects


async def test_a_status_write_that_fails_is_retried_off_the_rounds_path() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    kube.failures = 2
    workers = RecordingWorkers.for_pods(pods)
    reconciler = build(lambda: pods, kube, workers)
    try:
        reconciler.ensure(KEY)
        # The pair is connected while the status writes still fail: acting never waits.
        await until("the pair", lambda: workers.peers_of(pods[1].endpoint) == {"P0"})
        await until("a written status", lambda: "status" in kube.bodies["llama"])
        assert kube.status_writes >= 3 and kube.failures == 0
        await until(
            "the newest status written",
            lambda: kube.bodies["llama"]["status"]["summary"]["pairs"] == "1/1",
        )
    finally:
        await reconciler.stop()


async def test_a_status_write_refused_for_a_moved_version_is_made_again_on_the_latest() -> None:
    all_pods = [pod("p0", "prefill"), pod("d0", "decode"), pod("d1", "decode")]
    pods = all_pods[:2]
    kube = FakeKube({"llama": topology_body()})
    reconciler = build(lambda: pods, kube, RecordingWorkers.for_pods(all_pods))
    reconciler.settings.status_interval_s = 0.01
    body = kube.bodies["llama"]

    def pairs() -> str:
        return str(body.get("status", {}).get("summary", {}).get("pairs"))

    try:
        reconciler.ensure(KEY)
        await until("the loop's status", lambda: pairs() == "1/1")
        # Another writer moves the object on (a replaced leader's late write): the loop's
        # next write names the version of its own last one and is refused.
        body["status"] = {"summary": {"pairs": "stale"}}
        body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        pods.append(all_pods[2])
        reconciler.poke_namespace("ns")
        await until("the newest status, written on the latest version", lambda: pairs() == "2/2")
        assert kube.conflicts >= 1
    finally:
        await reconciler.stop()


async def test_a_handshake_failing_round_after_round_raises_one_event() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    workers.refused_adds = {"D0"}  # the prefill can never add the decode
    reconciler = build(lambda: pods, kube, workers, resync_s=0.02)  # a round every 20 ms
    try:
        reconciler.ensure(KEY)
        await until(
            "several rounds", lambda: workers.calls.count(("change_peers", pods[0].endpoint)) >= 5
        )
        await until("the Event posted", lambda: bool(kube.events))
        failed = [e for e in kube.events if e[2] == "HandshakeFailed"]
        assert len(failed) == 1, kube.events
        assert "p0" in failed[0][3] and "D0" in failed[0][3]
        assert workers.peers_of(pods[1].endpoint) == {"P0"}, "the other half was made"
    finally:
        await reconciler.stop()


async def test_the_gate_is_written_once_the_engine_is_connected_and_only_on_change() -> None:
    pods = [pod("p0", "prefill", gated=True), pod("d0", "decode", gated=True), pod("d1", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods([*pods, pod("d2", "decode")])
    reconciler = build(lambda: pods, kube, workers)
    try:
        reconciler.ensure(KEY)
        await until(
            "both gates True",
            lambda: (
                {(n, c["status"]) for n, _, c in kube.pod_conditions}
                >= {("p0", "True"), ("d0", "True")}
            ),
        )
        by_pod = {n: (uid, c) for n, uid, c in kube.pod_conditions}
        assert set(by_pod) == {"p0", "d0"}, "a pod without the gate is never written"
        uid, cond = by_pod["p0"]
        assert uid == "uid-p0" and cond["type"] == KV_CONNECTED_GATE
        assert (cond["reason"], cond["message"]) == ("KVConnected", "2/2 partners connected")
        # The pod watch now shows the conditions written: nothing is written again.
        pods[:2] = [
            pod("p0", "prefill", gated=True, gate="True"),
            pod("d0", "decode", gated=True, gate="True"),
        ]
        written = len(kube.pod_conditions)
        rounds = kube.status_writes
        reconciler.poke_namespace("ns")
        await until("a round", lambda: True)
        pods.append(pod("d2", "decode", gated=True))  # a new gated decode: written alone
        reconciler.poke_namespace("ns")
        await until("d2's gate", lambda: len(kube.pod_conditions) > written)
        await until("d2 connected", lambda: kube.pod_conditions[-1][2]["status"] == "True")
        assert {n for n, _, _ in kube.pod_conditions[written:]} <= {"d2", "p0"}
        assert kube.status_writes >= rounds
    finally:
        await reconciler.stop()


async def test_loops_stop_with_their_topology_and_are_cancelled_together() -> None:
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body(), "other": topology_body()})
    kube.bodies["other"]["metadata"]["name"] = "other"
    reconciler = build(lambda: pods, kube, RecordingWorkers.for_pods(pods))
    try:
        reconciler.ensure(KEY)
        reconciler.ensure(("ns", "other"))
        assert reconciler.running == 2
        reconciler.ensure(KEY)  # already running: no second loop
        assert reconciler.running == 2
        del kube.bodies["other"]  # deleted: its next round ends its loop
        reconciler.poke_namespace("ns")
        await until("the deleted topology's loop ended", lambda: reconciler.running == 1)
        reconciler.cancel_all()
        await until("every loop cancelled", lambda: reconciler.running == 0)
        reconciler.ensure(KEY)  # as a new leader does: a fresh loop
        assert reconciler.running == 1
    finally:
        await reconciler.stop()


@pytest.mark.parametrize("round_wait_s", [0.05, 30.0])
async def test_a_worker_whose_calls_hang_costs_its_own_engine_only(round_wait_s: float) -> None:
    """A worker that accepts a call and never answers (SIGSTOPped after its last read)
    holds no round past its wait, nor (a long wait) much past the other calls' answers: a
    decode that comes meanwhile is connected while the hung call is out; the hung worker is
    not called again while its call is out, and when it answers, what it did is counted and
    the loop runs on it at once."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = HungCalls.for_pods([*pods, pod("d1", "decode")])
    workers.hung = {pods[1].endpoint}
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: list(pods),
        metrics=OperatorMetrics(),
        settings=Settings(
            resync_s=60.0, retry_s=0.01, round_wait_s=round_wait_s, status_interval_s=0
        ),
    )
    try:
        reconciler.ensure(KEY)
        await until("p0 holds D0", lambda: workers.peers_of(pods[0].endpoint) == {"D0"})
        await until(
            "d0's call out", lambda: ("change_peers (hung)", pods[1].endpoint) in workers.calls
        )
        pods.append(pod("d1", "decode"))
        reconciler.poke_namespace("ns")
        await until("d1 connected", lambda: workers.peers_of(pods[2].endpoint) == {"P0"})
        await until("p0 holds D1", lambda: workers.peers_of(pods[0].endpoint) == {"D0", "D1"})
        assert workers.calls.count(("change_peers (hung)", pods[1].endpoint)) == 1
        assert workers.peers_of(pods[1].endpoint) == frozenset()
        workers.release.set()
        await until("d0 holds P0", lambda: workers.peers_of(pods[1].endpoint) == {"P0"})
        await until(
            "every pair connected in the status",
            lambda: (
                (kube.bodies["llama"].get("status") or {}).get("summary", {}).get("pairs") == "2/2"
            ),
        )
        assert workers.calls.count(("change_peers (hung)", pods[1].endpoint)) == 1
    finally:
        workers.release.set()
        await reconciler.stop()


async def test_a_forgotten_topology_leaves_no_gauges_and_gone_engines_are_not_remembered() -> None:
    """The per-topology gauges go with the loop (a deleted topology, a lost lead): they
    would otherwise report its last pair counts forever. And the memory of when each engine
    first connected keeps only engines still there."""
    pods = [
        dataclasses.replace(pod(name, role), ready_since=time.time())
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    ]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = build(lambda: list(pods), kube, workers)
    sample = reconciler.metrics.registry.get_sample_value
    labels = {"namespace": "ns", "name": "llama"}
    try:
        reconciler.ensure(KEY)
        await until("the gauges", lambda: sample("kvtopo_operator_pairs_connected", labels) == 2)
        loop = reconciler._loops[KEY]
        await until("both decodes remembered", lambda: {"D0", "D1"} <= set(loop.connected_at))
        pods.pop()  # d1 goes (and, after the grace, is evicted and unlisted)
        reconciler.poke_namespace("ns")
        await until(
            "d1 forgotten",
            lambda: (
                "D1" not in loop.connected_at
                and sample("kvtopo_operator_pairs_connected", labels) == 1
            ),
            timeout_s=10.0,
        )
        reconciler.forget(KEY)
        assert sample("kvtopo_operator_pairs_connected", labels) is None
        assert sample("kvtopo_operator_pairs_expected", labels) is None
    finally:
        await reconciler.stop()


async def test_a_part_planned_while_a_worker_s_calls_are_out_goes_as_soon_as_they_end() -> None:
    """A worker whose calls of an earlier round are still out gets nothing new from a
    later plan at once (one call out per worker); its part is queued and made by the same
    task as soon as those calls end, not a round later: here no round runs after it (the
    loop is stopped), and the prefill still takes the decode that came meanwhile, once, and
    not the adds its first call already made."""
    p0, d0, d1, d2 = (
        pod("p0", "prefill"),
        pod("d0", "decode"),
        pod("d1", "decode"),
        pod("d2", "decode"),
    )
    pods = [p0, d0]
    kube = FakeKube({"llama": topology_body()})
    workers = HungCalls.for_pods([p0, d0, d1, d2])
    reconciler = build(lambda: list(pods), kube, workers)
    try:
        reconciler.ensure(KEY)
        await until("p0 holds D0", lambda: workers.peers_of(p0.endpoint) == {"D0"})
        loop = reconciler._loops[KEY]
        workers.hung = {p0.endpoint}
        pods.append(d1)
        reconciler.poke_namespace("ns")
        await until("p0's call out", lambda: ("change_peers (hung)", p0.endpoint) in workers.calls)
        ended = loop.round_ended
        pods.append(d2)
        reconciler.poke_namespace("ns")
        await until("d2 holds P0", lambda: workers.peers_of(d2.endpoint) == {"P0"})
        await until("the round that planned it ended", lambda: loop.round_ended > ended)
        loop.task.cancel()  # no round runs from here on
        with contextlib.suppress(asyncio.CancelledError):
            await loop.task
        workers.hung = set()
        workers.release.set()
        await until(
            "p0 holds every decode", lambda: workers.peers_of(p0.endpoint) == {"D0", "D1", "D2"}
        )
        await until("p0's calls ended", lambda: p0.name not in loop.calls.out)
        adds = [c for c in workers.calls if c[0] == "change_peers" and c[1] == p0.endpoint]
        assert len(adds) == 3, adds  # D0, the released D1 call, then the queued part
        assert workers.batches[p0.endpoint][0] == ["D2"]  # D1, made meanwhile, left out
    finally:
        workers.release.set()
        await reconciler.stop()


async def test_a_queued_part_does_not_evict_again_what_the_calls_out_evicted() -> None:
    """A gone decode's eviction from a prefill is out (slow) when the next round plans it
    again (the prefill's view still holds it) and queues it behind that call. Once the
    call has evicted it, the queued part must not send the eviction again: in a 64 x 2,000
    rollout such parts re-sent whole waves of evictions to every prefill, each answered
    "absent"."""

    class Recording(HungCalls):
        evicted: dict[str, list[str]]

        async def change_peers(self, endpoint: str, *args: Any, **kw: Any) -> Any:
            self.evicted.setdefault(endpoint, []).extend(args[1])
            return await super().change_peers(endpoint, *args, **kw)

    p0, d0, d1, d2 = (
        pod("p0", "prefill"),
        pod("d0", "decode"),
        pod("d1", "decode"),
        pod("d2", "decode"),
    )
    pods = [p0, d0, d1]
    body = topology_body()
    body["spec"]["eviction"] = {"graceSeconds": 0}  # a gone engine is evicted at once
    kube = FakeKube({"llama": body})
    workers = cast(Recording, Recording.for_pods([p0, d0, d1, d2]))
    workers.evicted = {}
    reconciler = build(lambda: list(pods), kube, workers)
    try:
        reconciler.ensure(KEY)
        await until("p0 holds D0 and D1", lambda: workers.peers_of(p0.endpoint) == {"D0", "D1"})
        loop = reconciler._loops[KEY]
        workers.hung = {p0.endpoint}
        pods.remove(d1)  # gone: evicted from p0 after the grace, by a call that hangs
        reconciler.poke_namespace("ns")
        await until(
            "p0's eviction out",
            lambda: ("change_peers (hung)", p0.endpoint) in workers.calls,
        )
        ended = loop.round_ended
        pods.append(d2)  # the next round plans D1's eviction again (p0's view holds it)
        reconciler.poke_namespace("ns")
        await until("d2 holds P0", lambda: workers.peers_of(d2.endpoint) == {"P0"})
        await until("the round that planned it ended", lambda: loop.round_ended > ended)
        assert p0.name in loop.calls.queued  # D1's eviction again, and D2's half
        loop.task.cancel()  # no round runs from here on
        with contextlib.suppress(asyncio.CancelledError):
            await loop.task
        workers.hung = set()
        workers.release.set()
        await until("p0 holds D0 and D2", lambda: workers.peers_of(p0.endpoint) == {"D0", "D2"})
        await until("p0's calls ended", lambda: p0.name not in loop.calls.out)
        assert workers.evicted[p0.endpoint] == ["D1"], workers.calls  # once, by the call out
    finally:
        workers.release.set()
        await reconciler.stop()


@pytest.mark.parametrize("stop", ["replaced", "leadership lost and won again"])
async def test_a_loop_stopped_as_its_poke_arrives_stops_at_every_step_of_the_event_loop(
    stop: str,
) -> None:
    """A loop stopped while it is being poked, by its topology deleted and created again
    (`replaced`) or by leadership lost and won again (`cancel_all`, then `ensure` as a new
    leader does): the old loop must stop, whichever of the event loop's steps the stop lands
    on relative to the poke, or two loops would run rounds for the one topology. (On Python
    3.11, `asyncio.wait_for` returned normally when the cancellation came in the step after
    the poke, and the old loop went on with the new loop's state.) Every offset is tried."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    name = f"kvtopo-{KEY[0]}/{KEY[1]}"

    def loops_running() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == name and not t.done()]

    async def goes_on(steps: int) -> bool:
        # No pause between rounds and no quick retry: a round that ended waits for its poke.
        reconciler = build(
            lambda: pods,
            FakeKube({"llama": topology_body()}),
            RecordingWorkers.for_pods(pods),
            retry_s=30.0,
            max_gap_s=0.0,
        )
        try:
            reconciler.ensure(KEY)
            await until("the first round ended", lambda: bool(reconciler.since_success()))
            (old,) = loops_running()
            reconciler.poke_namespace(KEY[0])
            for _ in range(steps):
                await asyncio.sleep(0)
            if stop == "replaced":
                reconciler.replaced(KEY)
            else:
                reconciler.cancel_all()
                reconciler.ensure(KEY)
            await asyncio.wait({old}, timeout=3.0)  # a stopped loop ends at its next await
            if not old.cancelled():
                return True
            assert len(loops_running()) == 1  # the new one
            return False
        finally:
            await reconciler.stop()
            left = loops_running()
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    lost = [steps for steps in range(10) if await goes_on(steps)]
    assert lost == [], f"the old loop went on when stopped {lost} steps after its poke"


async def test_a_round_that_finds_nothing_changed_keeps_the_last_decision() -> None:
    """A topology with nothing to do decides once: the rounds after it (for the periodic
    re-reads) find the same claim, spec and worker views and skip the decision
    (`kvtopo_operator_quiet_rounds`); a worker that says something new brings a full round
    that acts on it (its lost peer is added again)."""
    pods = [pod("p0", "prefill"), pod("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods,
        pods_version=lambda namespace: 1,
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=30.0, retry_s=0.01, state_reads_per_s=0),
    )
    quiet = reconciler.metrics.quiet_rounds
    try:
        reconciler.ensure(KEY)
        await until("the pair", lambda: workers.peers_of(pods[1].endpoint) == {"P0"})
        loop = reconciler._loops[KEY]
        await until("a quiet round's signature", lambda: loop.quiet is not None)
        for _ in range(3):
            loop.poke.set()
            before = quiet._value.get()
            await until("a quiet round", lambda b=before: quiet._value.get() > b)
        calls = len(workers.calls)
        view = workers.views[pods[1].endpoint]
        assert isinstance(view, WorkerView)
        workers.views[pods[1].endpoint] = dataclasses.replace(view, peers=frozenset())
        loop.views.mark_dirty("d0")  # as a failed call or a re-read would
        loop.poke.set()
        await until("P0 added again", lambda: workers.peers_of(pods[1].endpoint) == {"P0"})
        assert ("change_peers", pods[1].endpoint) in workers.calls[calls:]
    finally:
        await reconciler.stop()
