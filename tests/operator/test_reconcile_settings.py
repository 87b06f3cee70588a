"""What the reconciler sends workers of the spec besides peers: the handshake deadline with
each batch of adds (only to a worker that reports one) and the idle TTL (`PUT /v1/settings`,
only where a worker reports another value), with the outcomes kept in the worker views.

`Reconciler.worker_calls.act` built through its real constructor, with a recording worker client."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

from kvtopo_operator.api import KVTopologySpec, KVTopologyStatus
from kvtopo_operator.gather import WorkerViews
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import evaluate
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import (
    Observed,
    PodView,
    WorkerView,
)
from kvtopo_operator.reconcile import Reconciler
from kvtopo_operator.workers import WorkerClient
from tests.operator.fakes import RecordingWorkers

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SPEC = KVTopologySpec.model_validate(
    {
        "prefill": {"selector": {"matchLabels": {"kvtopo.dev/role": "prefill"}}},
        "decode": {"selector": {"matchLabels": {"kvtopo.dev/role": "decode"}}},
        "handshake": {"timeoutSeconds": 7},
        "eviction": {"idleTTLSeconds": 30},
    }
)


def pod(name: str, role: str) -> PodView:
    return PodView(name, role, {"kvtopo.dev/role": role}, True, False, f"10.0.0.{len(name)}:1")


def view(engine_id: str, role: str, **settings: float) -> WorkerView:
    return WorkerView(engine_id, role, "h", frozenset(), **settings)  # type: ignore[arg-type]


def setup(settings_ok: bool = True) -> tuple[list[PodView], RecordingWorkers, Reconciler]:
    pods = [pod("p0", "prefill"), pod("d00", "decode"), pod("d000", "decode")]
    ep = {p.name: p.endpoint for p in pods}
    workers = RecordingWorkers(
        {
            # Both take settings: the prefill's idle TTL differs from the spec's.
            ep["p0"]: view("P0", "prefill", handshake_timeout_s=5.0, idle_ttl_s=0.0),
            ep["d00"]: view("D0", "decode", handshake_timeout_s=5.0, idle_ttl_s=30.0),
            # A worker that predates both (its state does not report them).
            ep["d000"]: view("D1", "decode"),
        },
        settings_ok,
    )
    reconciler = Reconciler(
        kube=cast(KubeClient, object()),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: pods,
        metrics=OperatorMetrics(),
    )
    return pods, workers, reconciler


async def act(
    pods: list[PodView], workers: RecordingWorkers, reconciler: Reconciler, views: WorkerViews
) -> Any:
    seen = await views.gather(pods, concurrency=4, timeout_s=1.0)
    obs = Observed(3, SPEC, tuple(pods), seen, KVTopologyStatus())
    plan = evaluate(obs, T0)
    await reconciler.worker_calls.act(plan, views, asyncio.Semaphore(4), 7.0, T0)
    return plan


def test_the_handshake_deadline_goes_with_each_batch_to_workers_that_take_it() -> None:
    async def body() -> None:
        pods, workers, reconciler = setup()
        views = WorkerViews(workers.state, max_age_s=60)
        await act(pods, workers, reconciler, views)
        ep = {p.name: p.endpoint for p in pods}
        assert workers.batches == {
            ep["p0"]: (["D0", "D1"], 7.0, 7.0),
            ep["d00"]: (["P0"], 7.0, 7.0),
            ep["d000"]: (["P0"], 7.0, None),  # an older worker refuses the field
        }

    asyncio.run(body())


def test_the_idle_ttl_is_set_where_it_differs_and_remembered() -> None:
    async def body() -> None:
        pods, workers, reconciler = setup()
        views = WorkerViews(workers.state, max_age_s=60)
        await act(pods, workers, reconciler, views)
        assert workers.idle_ttls == [(pods[0].endpoint, 30.0)]
        view = views.view("p0")
        assert isinstance(view, WorkerView) and view.idle_ttl_s == 30.0
        # The next round reads nobody again and sets nothing again.
        reads = len(workers.reads)
        plan = await act(pods, workers, reconciler, views)
        assert plan.idle_ttls == () and len(workers.reads) == reads
        assert workers.idle_ttls == [(pods[0].endpoint, 30.0)]

    asyncio.run(body())


def test_a_failed_idle_ttl_call_has_the_worker_read_again() -> None:
    async def body() -> None:
        pods, workers, reconciler = setup(settings_ok=False)
        views = WorkerViews(workers.state, max_age_s=60)
        await act(pods, workers, reconciler, views)
        reads = list(workers.reads)
        await act(pods, workers, reconciler, views)
        assert workers.reads[len(reads) :] == [pods[0].endpoint]  # marked dirty: read again
        assert workers.idle_ttls == [(pods[0].endpoint, 30.0)] * 2  # and tried again

    asyncio.run(body())


def test_the_status_writes_slow_down_as_the_status_grows() -> None:
    """A status of many engine lines is written less often: the API server's cost per
    second of a large topology's status stays about that of a small one's."""
    from kvtopo_operator.reconcile import Settings

    reconciler = Reconciler(
        kube=cast(KubeClient, object()),
        workers=cast(WorkerClient, object()),
        pods=lambda namespace, port: (),
        metrics=OperatorMetrics(),
        settings=Settings(status_interval_s=1.0, status_engines_per_interval=500),
    )

    def pause(lines: int) -> float:
        return reconciler.status_pause({"engines": [{}] * lines, "conditions": []})

    assert pause(0) == pause(80) == pause(500) == 1.0
    assert pause(1032) == 1032 / 500 and pause(2064) == 2064 / 500
