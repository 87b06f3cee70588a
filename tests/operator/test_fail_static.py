"""Fail-static, without a cluster: the stop policy's table, the write fence, and what the
real `Reconciler` (built through its constructor with the fakes of `tests.operator.fakes`)
writes when its loops stop for each cause. The same faults against the real API server and
real workers are `tests/e2e/test_fail_static.py`."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import cast

import pytest

from kvtopo_operator.fence import Fence, Fenced, FencedWrites
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import PodView, TopologyView
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.stopping import STOP_WRITES, StopCause, StopWrites, on_loop_stop
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import FakeKube, RecordingWorkers
from tests.operator.test_reconcile import KEY, SPEC, pod, topology_body, until


@pytest.mark.parametrize(
    ("cause", "others", "writes"),
    [
        (StopCause.DELETED, False, StopWrites.UNGATE_HERE),
        (StopCause.DELETED, True, StopWrites.UNGATE_BY_OLDEST),
        (StopCause.LEASE_LOST, False, StopWrites.NOTHING),
        (StopCause.LEASE_LOST, True, StopWrites.NOTHING),
        (StopCause.PROCESS_STOP, False, StopWrites.NOTHING),
        (StopCause.PROCESS_STOP, True, StopWrites.NOTHING),
        (StopCause.API_UNREACHABLE, False, StopWrites.NOTHING),
        (StopCause.API_UNREACHABLE, True, StopWrites.NOTHING),
    ],
)
def test_only_a_deletion_makes_a_stopping_loop_write(
    cause: StopCause, others: bool, writes: StopWrites
) -> None:
    assert on_loop_stop(cause, others) is writes


def test_the_stop_table_covers_every_cause_both_ways() -> None:
    assert set(STOP_WRITES) == {(c, o) for c in StopCause for o in (False, True)}


class Lease:
    def __init__(self, left: float) -> None:
        self.left = left

    def __call__(self) -> float:
        return self.left


def test_the_fence_opens_only_for_a_fresh_lease_and_never_after_stop() -> None:
    fence = Fence()
    assert fence.refusal() is None  # one replica: it leads while it runs
    lease = Lease(float("-inf"))
    fence.follow(lease)
    assert fence.refusal() is not None and fence.refusal()[0] == "not_leading"  # type: ignore[index]
    lease.left = 3.0
    assert fence.refusal() is None
    lease.left = -0.01  # paused past the renew deadline: stale before the election notices
    assert fence.refusal()[0] == "lease_stale"  # type: ignore[index]
    lease.left = 3.0
    fence.doubt_clock("the wall clock is 90 s ahead of the API server's")
    assert fence.refusal()[0] == "clock_doubted"  # type: ignore[index]
    fence.doubt_clock("")
    fence.stop()
    assert fence.refusal()[0] == "stopping"  # type: ignore[index]


@pytest.mark.asyncio
async def test_a_fenced_write_reaches_neither_the_api_server_nor_a_worker() -> None:
    kube, workers, metrics = FakeKube({}), RecordingWorkers({}), OperatorMetrics()
    fence = Fence()
    writes = FencedWrites(cast(KubeClient, kube), cast(WorkerClient, workers), fence, metrics)
    fence.follow(lambda: -1.0)
    with pytest.raises(Fenced):
        await writes.patch_pod_condition("ns", "p0", "uid", {"type": "x"})
    with pytest.raises(Fenced):
        await writes.change_peers("127.0.0.1:1", [], ["E"], 1.0)
    with pytest.raises(Fenced):
        await writes.record_event({"metadata": {}}, "Normal", "R", "m")
    assert kube.pod_conditions == [] and workers.calls == [] and kube.events == []
    sample = metrics.registry.get_sample_value
    assert sample("kvtopo_operator_writes_fenced_total", {"kind": "gate", "why": "lease_stale"})
    assert sample("kvtopo_operator_writes_total", {"kind": "gate"}) is None


def gated(name: str, role: str) -> PodView:
    return pod(name, role, gated=True, gate="True")


async def connected(
    cause: StopCause | None, topologies: list[TopologyView]
) -> tuple[FakeKube, Reconciler]:
    pods = [gated("p0", "prefill"), gated("d0", "decode")]
    kube = FakeKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods(pods)
    reconciler = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods,
        topologies=lambda namespace: topologies,
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=30.0, retry_s=0.01),
    )
    reconciler.ensure(KEY)
    await until("the pair", lambda: workers.peers_of(pods[1].endpoint) == {"P0"})
    await until("the status written", lambda: "status" in kube.bodies["llama"])
    assert kube.pod_conditions == [], "the gates are True already"
    return kube, reconciler


@pytest.mark.asyncio
@pytest.mark.parametrize("cause", [StopCause.LEASE_LOST, StopCause.PROCESS_STOP])
async def test_loops_stopped_by_a_lost_lease_or_a_stopping_process_write_nothing(
    cause: StopCause,
) -> None:
    """On 7314fe4 `cancel_all` un-gated every pod (it read "my loops stop" as "the topology
    was deleted")."""
    kube, reconciler = await connected(cause, [TopologyView("llama", "", SPEC)])
    writes = kube.status_writes
    if cause is StopCause.PROCESS_STOP:
        await reconciler.stop()
    else:
        reconciler.cancel_all(cause)
    for _ in range(50):  # every task the stop could have started gets to run
        await asyncio.sleep(0.001)
    assert kube.pod_conditions == [] and kube.status_writes == writes
    await reconciler.stop()


@pytest.mark.asyncio
async def test_a_deleted_topology_ungates_the_pods_only_it_selected() -> None:
    kube, reconciler = await connected(StopCause.DELETED, [])
    reconciler.forget(KEY)
    await until("both gates False", lambda: len(kube.pod_conditions) == 2)
    assert {(name, c["status"], c["reason"]) for name, _, c in kube.pod_conditions} == {
        ("p0", "False", "NotSelected"),
        ("d0", "False", "NotSelected"),
    }
    await reconciler.stop()


@pytest.mark.asyncio
async def test_a_deletion_seen_by_a_replica_that_does_not_lead_writes_nothing() -> None:
    kube, reconciler = await connected(StopCause.DELETED, [])
    reconciler.fence.follow(lambda: float("-inf"))
    reconciler.forget(KEY)
    for _ in range(50):
        await asyncio.sleep(0.001)
    assert kube.pod_conditions == []
    await reconciler.stop()


def test_the_server_clock_takes_the_api_server_s_time_and_doubts_a_stepped_clock() -> None:
    """`kube.ServerClock`: the `Date` of the API server's answers against the local wall
    clock. An offset within the slack is noise (0); beyond it the operator writes the API
    server's time. A wall clock stepped since the last answer is doubted (the fence shuts)
    until the next answer measures it again."""
    from email.utils import format_datetime

    from kvtopo_operator.kube import ServerClock

    wall, mono = [1_800_000_000.0], [100.0]
    clock = ServerClock(wall=lambda: wall[0], mono=lambda: mono[0])

    def answer(server: float) -> None:
        date = format_datetime(datetime.fromtimestamp(server, UTC), usegmt=True)
        clock.observe(date, wall[0] - 0.05, wall[0] + 0.05)

    answer(wall[0] + 0.6)
    assert clock.offset == 0.0 and clock.doubt() == ""
    answer(wall[0] - 90)  # this node is 90 s ahead of the API server
    assert clock.offset == pytest.approx(-90, abs=1)
    assert abs(clock.time() - (wall[0] - 90)) < 1.5
    wall[0] += 30  # stepped by 30 s while 1 s passed
    mono[0] += 1
    assert "stepped" in clock.doubt()
    fence = Fence()
    fence.follow_clock(clock.doubt)
    assert fence.refusal()[0] == "clock_doubted"  # type: ignore[index]
    answer(wall[0] - 60)
    assert clock.doubt() == "" and fence.refusal() is None
