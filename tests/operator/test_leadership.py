"""What leadership does to the operator's loops, without a cluster.

`Reconciler.cancel_all` (built through its real constructor, with a Kubernetes client whose
reads block until released) cancels every loop at once and keeps the shared clients open, so
loops start afresh on the next `ensure`. The kopf handlers remember every KVTopology they hear
of whether or not this replica leads, start no loop as a standby, start a loop for every
known topology (at its latest generation) the moment leadership is gained, cancel them all the
moment it is lost, and keep the `kvtopo_operator_leader` gauge in step. The command line
takes the election's flags as `kvtopo.launch` writes them and refuses settings under which two
replicas could act at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from kvtopo import launch
from kvtopo_operator import handlers
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.main import parse_args
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.stopping import StopCause
from kvtopo_operator.workers import WorkerClient


async def until(what: str, probe: Callable[[], bool], limit: int = 10_000) -> None:
    """Lets the event loop run until `probe()` holds (a bounded number of turns)."""
    for _ in range(limit):
        if probe():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class BlockingKube:
    """`get_topology` records the read and blocks until `release` is set."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self.release = asyncio.Event()

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append((namespace, name))
        await self.release.wait()
        return None


class Workers:
    def __init__(self) -> None:
        self.closed = False

    async def state(self, *_: Any, **__: Any) -> Any:
        raise AssertionError("no worker is read in these tests")

    async def close(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_cancel_all_stops_every_loop_at_once_and_keeps_the_clients() -> None:
    kube, workers = BlockingKube(), Workers()
    r = Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, workers),
        pods=lambda namespace, port: [],
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=60),
    )
    r.ensure(("ns", "a"), 1)
    r.ensure(("ns", "b"), 1)
    await until("both loops reading their topology", lambda: len(kube.reads) == 2)
    assert r.running == 2
    tasks = [loop.task for loop in r._loops.values()]

    r.cancel_all()
    assert r.running == 0 and not r._loops
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(x, asyncio.CancelledError) for x in results), results
    assert kube.reads == [("ns", "a"), ("ns", "b")]
    assert not workers.closed, "the shared clients stay open for the next leadership"

    r.ensure(("ns", "a"), 1)  # leadership regained: a fresh loop
    await until("a fresh loop reading", lambda: len(kube.reads) == 3)
    await r.stop()
    assert workers.closed and r.running == 0


class RecordingReconciler:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def ensure(self, key: tuple[str, str], generation: int | None = None) -> None:
        self.calls.append(("ensure", key, generation))

    def forget(self, key: tuple[str, str]) -> None:
        self.calls.append(("forget", key))

    def poke_namespace(self, namespace: str) -> None:
        self.calls.append(("poke", namespace))

    def cancel_all(self, cause: StopCause = StopCause.LEASE_LOST) -> None:
        self.calls.append(("cancel_all", cause))

    @property
    def running(self) -> int:
        return 0


async def event(kind: str | None, name: str, generation: int) -> None:
    await handlers.topology_changed(
        type=kind,
        namespace="ns",
        name=name,
        meta={"generation": generation},
        kv_topologies={},
    )


@pytest.mark.asyncio
async def test_handlers_remember_topologies_as_standby_and_act_only_while_leading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics = OperatorMetrics()
    rec = RecordingReconciler()
    monkeypatch.setattr(handlers, "_state", {"reconciler": rec, "metrics": metrics, "known": {}})

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("kvtopo_operator_leader")

    handlers._set_leading(False)
    assert gauge() == 0.0
    # A standby hears of topologies (the initial listing has no type) but runs no loop.
    await event(None, "a", 1)
    await event(None, "b", 2)
    await event("MODIFIED", "b", 3)
    await event("ADDED", "c", 1)
    await event("DELETED", "c", 1)
    handlers._pods_changed("ns")  # the pod watch saw a change
    assert handlers._state["known"] == {("ns", "a"): 1, ("ns", "b"): 3}
    assert [c for c in rec.calls if c[0] != "poke"] == []

    # Leadership gained: every known topology at its latest generation, at once.
    handlers._start_leading()
    assert gauge() == 1.0 and handlers._state["leading"] is True
    assert rec.calls[-2:] == [("ensure", ("ns", "a"), 1), ("ensure", ("ns", "b"), 3)]

    # While leading, events act directly; one that may change which pods the namespace's
    # topologies own (one comes, goes or changes its spec) pokes them all, a status write not.
    n = len(rec.calls)
    await event("ADDED", "d", 1)
    await event("DELETED", "a", 1)
    assert rec.calls[n:] == [
        ("ensure", ("ns", "d"), 1),
        ("poke", "ns"),
        ("forget", ("ns", "a")),
        ("poke", "ns"),
    ]
    n = len(rec.calls)
    await event("MODIFIED", "d", 1)
    assert rec.calls[n:] == [("ensure", ("ns", "d"), 1)]
    assert handlers._state["known"] == {("ns", "b"): 3, ("ns", "d"): 1}

    # Leadership lost: every loop cancelled at once; events only update what is known.
    handlers._stop_leading()
    assert gauge() == 0.0 and rec.calls[-1] == ("cancel_all", StopCause.LEASE_LOST)
    n = len(rec.calls)
    await event("MODIFIED", "d", 2)
    assert len(rec.calls) == n and handlers._state["known"][("ns", "d")] == 2

    handlers._start_leading()
    assert rec.calls[n:] == [("ensure", ("ns", "b"), 3), ("ensure", ("ns", "d"), 2)]


# --- the command line ------------------------------------------------------------------------


def operator_argv(*extra: str) -> list[str]:
    return launch.operator_args("llm", Path("/kc"), Path("/operator.key"), 2, *extra)


def test_leader_election_flags_as_the_launcher_writes_them() -> None:
    args = parse_args(
        operator_argv(
            *launch.leader_election_args(
                "op-a", lease_s=4, renew_s=2.5, retry_s=0.5, lease_name="l"
            )
        )
    )
    assert args.leader_elect and args.leader_elect_identity == "op-a"
    assert (args.leader_elect_namespace, args.leader_elect_lease_name) == ("llm", "l")
    assert (
        args.leader_elect_lease_seconds,
        args.leader_elect_renew_seconds,
        args.leader_elect_retry_seconds,
    ) == (4, 2.5, 0.5)
    plain = parse_args(operator_argv())
    assert not plain.leader_elect and plain.leader_elect_namespace is None


def test_the_lease_namespace_defaults_to_the_pods_when_watching_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVTOPO_WORKER_KEY_FILE", "/operator.key")
    monkeypatch.setenv("POD_NAMESPACE", "kvtopo-system")
    assert parse_args(["-A", "--leader-elect"]).leader_elect_namespace == "kvtopo-system"
    assert parse_args(["-n", "a", "-n", "b", "--leader-elect"]).leader_elect_namespace == "a"
    monkeypatch.delenv("POD_NAMESPACE")
    with pytest.raises(SystemExit):
        parse_args(["-A", "--leader-elect"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--peering", "p"], "--leader-elect and --peering exclude each other"),
        (["--leader-elect-renew-seconds", "15"], "must be above 0 and below the lease seconds"),
        (["--leader-elect-retry-seconds", "10"], "must be above 0 and below the renew seconds"),
        (["--leader-elect-lease-seconds", "0"], "must be at least 1"),
    ],
)
def test_leader_election_flags_that_could_overlap_leaders_are_refused(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(operator_argv("--leader-elect", *extra))
    assert message in capsys.readouterr().err
