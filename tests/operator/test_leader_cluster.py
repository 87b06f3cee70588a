"""Leader election against the real kube-apiserver (tier a).

Two `LeaderElector`s in this process, each with its own `kube.LeaseClient` connection, share
one `coordination.k8s.io/v1` Lease: exactly one leads; a leader cut off from the API server
(its calls hang, as when black-holed) stops acting at its renew deadline, before the standby
takes over within a lease duration; a leader that stops cleanly releases the Lease and the
standby takes over within a retry period or so. Then two `kvtopo-operator --leader-elect`
processes: only the holder of the Lease reconciles (its metrics say so, the standby's too),
killing it hands the work to the standby, and a clean stop releases the Lease.

Every wait polls real state (the Lease on the server, the electors' flags, the operators'
/metrics, the KVTopology's status) with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kvtopo import launch
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from kvtopo.ports import free_port
from kvtopo_operator.kube import ClusterApi, LeaseClient, LeaseRecord
from kvtopo_operator.leader import ElectionConfig, LeaderElector
from tests.cluster.kube import apply, create_namespace, get_json
from tests.e2e.replicas import Replica

ROOT = Path(__file__).resolve().parents[2]
LEASE = "kvtopo-operator"
FAST = ElectionConfig(lease_duration_s=4, renew_deadline_s=2.5, retry_period_s=0.5)
# Scheduling slack on a loaded 2-core machine (threads, the API server, etcd).
MARGIN_S = 1.5


# --- two electors in this process ----------------------------------------------------------


class Freezable:
    """A `LeaseStore` in front of a real `LeaseClient`; once `frozen`, every call hangs."""

    def __init__(self, inner: LeaseClient) -> None:
        self.inner = inner
        self.frozen = False

    async def _gate(self) -> None:
        if self.frozen:
            await asyncio.Event().wait()

    async def get(self) -> LeaseRecord | None:
        await self._gate()
        return await self.inner.get()

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        await self._gate()
        return await self.inner.create(record)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        await self._gate()
        return await self.inner.update(record)


@dataclass
class Member:
    elector: LeaderElector
    store: Freezable
    events: list[tuple[float, str, str]]  # shared by both: (monotonic time, identity, what)

    @property
    def name(self) -> str:
        return self.elector.identity

    def times(self, what: str) -> list[float]:
        return [t for t, who, w in self.events if who == self.name and w == what]


@dataclass
class Pair:
    cluster: LocalCluster
    namespace: str
    config: ElectionConfig
    events: list[tuple[float, str, str]] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)

    def member(self, identity: str) -> Member:
        store = Freezable(LeaseClient(ClusterApi(self.cluster.kubeconfig), self.namespace, LEASE))

        def note(what: str) -> Callable[[], None]:
            return lambda: self.events.append((time.monotonic(), identity, what))

        m = Member(
            LeaderElector(
                store,
                on_started_leading=note("started"),
                on_stopped_leading=note("stopped"),
                identity=identity,
                config=self.config,
                name=f"{self.namespace}/{LEASE}",
            ),
            store,
            self.events,
        )
        self.members.append(m)
        return m

    def leaders(self) -> list[str]:
        return [m.name for m in self.members if m.elector.is_leader]

    def lease(self) -> dict[str, Any]:
        spec: dict[str, Any] = get_json(self.cluster, "lease", LEASE, "-n", self.namespace)["spec"]
        return spec

    async def wait(self, what: str, probe: Callable[[], Any], timeout_s: float) -> float:
        """Polls `probe` on the event loop until it is true; returns when (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while not probe():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s:g}s waiting for {what}; events {self.events}"
                )
            await asyncio.sleep(0.02)
        return time.monotonic()


@pytest.fixture
def lease_ns(cluster_a: LocalCluster) -> Iterator[str]:
    ns = create_namespace(cluster_a, "kvt-lease", wait_for_sa=False)
    yield ns
    cluster_a.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def micro_time(text: str) -> datetime:
    assert len(text) == len("2030-01-01T00:00:00.000000Z") and text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.asyncio
async def test_one_of_two_leads_and_a_frozen_leader_stops_before_the_standby_takes_over(
    cluster_a: LocalCluster, lease_ns: str
) -> None:
    pair = Pair(cluster_a, lease_ns, FAST)
    a, b = pair.member("elector-a"), pair.member("elector-b")
    a.elector.start()
    b.elector.start()
    try:
        await pair.wait("a leader", pair.leaders, 10)
        (first,) = pair.leaders()
        leader, standby = (a, b) if first == a.name else (b, a)

        # The Lease on the server names it, as client-go writes one.
        spec = await asyncio.to_thread(pair.lease)
        assert spec["holderIdentity"] == leader.name
        assert spec["leaseDurationSeconds"] == FAST.lease_duration_s
        assert spec["leaseTransitions"] == 0
        assert micro_time(spec["acquireTime"]) <= micro_time(spec["renewTime"])

        # It renews every retry period; never do both lead meanwhile.
        renewals: set[str] = {spec["renewTime"]}

        def renewed_thrice() -> bool:
            assert len(pair.leaders()) == 1, pair.leaders()
            record = standby.elector.observed  # what the standby reads every retry period
            if record is not None:
                renewals.add(record.renew_time.isoformat() if record.renew_time else "")
            return len(renewals) >= 4

        await pair.wait("three renewals seen by the standby", renewed_thrice, 10)
        assert standby.times("started") == []

        # Cut the leader off: its calls hang from now on.
        frozen_at = time.monotonic()
        leader.store.frozen = True
        took_over = await pair.wait(
            "the standby to take over",
            lambda: standby.elector.is_leader,
            FAST.lease_duration_s + FAST.retry_period_s + MARGIN_S + 2,
        )
        (lost,) = leader.times("stopped")
        (won,) = standby.times("started")
        assert not leader.elector.is_leader
        # The leader stopped acting by its renew deadline (it last renewed before the freeze)...
        assert lost - frozen_at <= FAST.renew_deadline_s + MARGIN_S / 3, lost - frozen_at
        # ...before the standby took over, which waited a lease duration from its last sight
        # of a renewal (at most a retry period before the freeze) and tried every retry period.
        assert lost < won
        assert won - frozen_at >= FAST.lease_duration_s - FAST.retry_period_s - 0.25
        assert took_over - frozen_at <= FAST.lease_duration_s + FAST.retry_period_s + MARGIN_S
        spec = await asyncio.to_thread(pair.lease)
        assert spec["holderIdentity"] == standby.name
        assert spec["leaseTransitions"] == 1
    finally:
        for m in (a, b):
            await m.elector.stop()


@pytest.mark.asyncio
async def test_a_leader_that_stops_releases_and_the_standby_takes_over_at_once(
    cluster_a: LocalCluster, lease_ns: str
) -> None:
    # A long lease: a standby that waited for it to expire would take 8 s, not about 0.5 s.
    config = ElectionConfig(lease_duration_s=8, renew_deadline_s=5, retry_period_s=0.5)
    pair = Pair(cluster_a, lease_ns, config)
    a, b = pair.member("elector-a"), pair.member("elector-b")
    a.elector.start()
    try:
        await pair.wait("a to lead", lambda: a.elector.is_leader, 10)
        b.elector.start()
        await pair.wait("b to see a's lease", lambda: b.elector.holder == a.name, 10)

        stopping = time.monotonic()
        await a.elector.stop()
        (lost,) = a.times("stopped")  # on-lost ran before stop() returned (and released)
        spec = await asyncio.to_thread(pair.lease)
        # Released, unless b was already quick enough to take it.
        assert spec["holderIdentity"] in ("", b.name)
        won = await pair.wait("b to lead", lambda: b.elector.is_leader, 5)
        assert lost < b.times("started")[0]
        assert won - stopping <= config.retry_period_s + MARGIN_S, won - stopping
        spec = await asyncio.to_thread(pair.lease)
        assert spec["holderIdentity"] == b.name and spec["leaseTransitions"] == 1
        assert spec["leaseDurationSeconds"] == 8
    finally:
        for m in (a, b):
            await m.elector.stop()


# --- two operator processes -----------------------------------------------------------------


@dataclass
class Operators:
    cluster: LocalCluster
    namespace: str
    tmp: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    def start(self, identity: str) -> Replica:
        token = Credentials.beside(self.tmp / "token").operator_key
        port = free_port()
        args = launch.operator_args(
            self.namespace,
            self.cluster.kubeconfig,
            token,
            1,
            f"--metrics-port={port}",
            *launch.leader_election_args(
                identity,
                lease_s=FAST.lease_duration_s,
                renew_s=FAST.renew_deadline_s,
                retry_s=FAST.retry_period_s,
                lease_name=LEASE,
            ),
        )
        log = self.tmp / f"{identity}.log"
        r = Replica(identity, port, log, launch.start_operator(args, log, cwd=ROOT))
        self.replicas[identity] = r
        return r

    def holder(self) -> str:
        """The Lease's holderIdentity ("" while there is no Lease or no holder)."""
        got = self.cluster.kubectl(
            "get", "lease", LEASE, "-n", self.namespace, "-o", "json", check=False
        )
        if got.returncode != 0:
            return ""
        return str(json.loads(got.stdout)["spec"].get("holderIdentity", ""))

    def observed_generation(self) -> int:
        obj = get_json(self.cluster, "kvt", "llama", "-n", self.namespace)
        return int((obj.get("status") or {}).get("observedGeneration") or 0)

    def logs(self) -> str:
        return "\n".join(
            f"--- {r.identity} ---\n{log_tail(r.log, 30)}" for r in self.replicas.values()
        )

    def wait(self, what: str, probe: Callable[[], Any], timeout_s: float) -> Any:
        return wait_until(probe, timeout_s, what, describe_last=self.logs)


@pytest.fixture
def operators(cluster_a: LocalCluster, tmp_path: Path) -> Iterator[Operators]:
    cluster_a.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    cluster_a.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    ops = Operators(cluster_a, create_namespace(cluster_a, "kvt-le", wait_for_sa=False), tmp_path)
    try:
        yield ops
    finally:
        for r in ops.replicas.values():
            launch.stop_process(r.proc, 10)
        cluster_a.kubectl("delete", "namespace", ops.namespace, "--wait=false", check=False)


def test_two_operator_replicas_only_the_lease_holder_reconciles(operators: Operators) -> None:
    ops = operators
    apply(ops.cluster, manifests.topology("llama", app="llama", namespace=ops.namespace))
    a, b = ops.start("op-a"), ops.start("op-b")
    holder = ops.wait(
        "a Lease holder", lambda: ops.holder() in ("op-a", "op-b") and ops.holder(), 60
    )
    leader, standby = (a, b) if holder == "op-a" else (b, a)
    ops.wait(
        "both replicas serving /metrics, the leader's gauge 1, the standby's 0",
        lambda: leader.leading() == 1.0 and standby.leading() == 0.0,
        30,
    )
    ops.wait("the leader to reconcile generation 1", lambda: ops.observed_generation() == 1, 30)
    ops.wait("a few rounds by the leader", lambda: leader.rounds() >= 3, 30)
    assert standby.rounds() == 0.0, "the standby ran a round"
    assert standby.leading() == 0.0 and ops.holder() == leader.identity

    # The leader dies without a word (no release): the standby takes over within a lease
    # duration (plus a retry period and slack for starting the loops).
    killed = time.monotonic()
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(10)
    ops.wait("the standby to hold the Lease", lambda: ops.holder() == standby.identity, 15)
    ops.wait("the standby's gauge to say it leads", lambda: standby.leading() == 1.0, 10)
    took = time.monotonic() - killed
    assert took <= FAST.lease_duration_s + FAST.retry_period_s + 2 * MARGIN_S + 1, took
    # It starts a loop for the topology it knew as a standby, at once: a spec change is
    # reconciled by it now.
    ops.wait("the new leader to reconcile", lambda: standby.rounds() >= 1, 10)
    ops.cluster.kubectl(
        "patch",
        "kvt",
        "llama",
        "-n",
        ops.namespace,
        "--type=merge",
        "-p",
        '{"spec": {"eviction": {"graceSeconds": 7}}}',
    )
    ops.wait(
        "generation 2 reconciled by the new leader", lambda: ops.observed_generation() == 2, 15
    )

    # A clean stop releases the Lease (kopf's clean-up stops the loops, then releases).
    assert launch.stop_process(standby.proc, 15) == 0, log_tail(standby.log, 40)
    ops.wait("the Lease released", lambda: ops.holder() == "", 5)
    text = standby.log.read_text(errors="replace")
    assert "released lease" in text and "Traceback" not in text, log_tail(standby.log, 60)
