"""The write fence: the one path by which the operator changes anything, and who may use it.

Owns `Fence`, which says whether this replica may write *now*, and `FencedWrites`, through
which every write goes: to the API server (a KVTopology's status, a pod's kv-connected
condition, an Event) and to workers (peer adds and evictions, the idle TTL). Each write asks
the fence right before it is made; a refused write raises `Fenced`, is counted
(`kvtopo_operator_writes_fenced_total{kind,why}`) and changes nothing.

A replica may write while all of these hold (docs/design.md, "fail-static"):
- it is not stopping (`Fence.stop`: the process got SIGTERM, kopf's clean-up runs);
- under leader election, it holds the Lease and its last successful renewal *started* less
  than the renew deadline ago, on this machine's monotonic clock (`lease_left`; a replica
  paused past its lease, or cut off from the API server, finds its lease stale the moment it
  runs again, before its elector has noticed). The renew deadline is shorter than the
  lease, so a replica's writes stop before any standby can take the Lease;
- it does not doubt its clock (`Fence.doubt_clock`, set while the wall clock is judged
  wrong).
Without leader election (one replica, `--leader-elect` not given) it leads while it runs.

Reads are not fenced: a standby keeps its pod watch and reads, so that it can act at once
when it leads. Used by `reconcile` (and `handlers`, which wires the elector in).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kvtopo_operator.kube import KubeClient
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.workers import CallResult, PeerAdd, WorkerClient

# The kinds of write, as counted.
STATUS, GATE, EVENT, PEERS, SETTINGS = "status", "gate", "event", "peers", "settings"


class Fenced(Exception):
    """A write refused by the fence: this replica may not change anything now."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind} write refused: {why}")
        self.kind = kind
        self.why = why


class Fence:
    """Whether this replica may write now (see the module). Starts leading (one replica);
    `follow` puts it under a lease."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._stopping = False
        self._clock_doubt = ""
        self._clock_source: Callable[[], str] = lambda: ""
        # Seconds of fresh lease left (None: not under leader election).
        self._lease_left: Callable[[], float] | None = None

    def follow(self, lease_left: Callable[[], float]) -> None:
        """Writes only while `lease_left()` (seconds until the lease held goes stale;
        0 or less, or -inf when none is held) is above 0."""
        self._lease_left = lease_left

    def stop(self) -> None:
        """The process is stopping: nothing is written from now on."""
        self._stopping = True

    def doubt_clock(self, why: str) -> None:
        """The wall clock is judged wrong ("" when it is trusted again)."""
        self._clock_doubt = why

    def follow_clock(self, doubt: Callable[[], str]) -> None:
        """Writes only while `doubt()` (why the wall clock cannot be trusted now, e.g.
        `kube.ServerClock.doubt`) is ""."""
        self._clock_source = doubt

    @property
    def stopping(self) -> bool:
        return self._stopping

    def refusal(self) -> tuple[str, str] | None:
        """Why writes are refused now: (why, a sentence for the log); None: allowed."""
        if self._stopping:
            return "stopping", "the operator is stopping"
        if self._lease_left is not None:
            left = self._lease_left()
            if left == float("-inf"):
                return "not_leading", "this replica does not hold the Lease"
            if left <= 0:
                return "lease_stale", (
                    f"the lease was last renewed over the renew deadline ago ({-left:.1f} s "
                    "past it)"
                )
        doubt = self._clock_doubt or self._clock_source()
        if doubt:
            return "clock_doubted", doubt
        return None

    @property
    def open(self) -> bool:
        return self.refusal() is None


class FencedWrites:
    """Every write the operator makes, each made only if the fence allows it right then."""

    def __init__(
        self, kube: KubeClient, workers: WorkerClient, fence: Fence, metrics: OperatorMetrics
    ) -> None:
        self.kube = kube
        self.workers = workers
        self.fence = fence
        self.metrics = metrics

    def check(self, kind: str) -> None:
        """Raises `Fenced` (counted) unless this replica may write now."""
        refused = self.fence.refusal()
        if refused is not None:
            self.metrics.writes_fenced.labels(kind, refused[0]).inc()
            raise Fenced(kind, refused[1])
        self.metrics.writes.labels(kind).inc()

    async def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str,
        uid: str = "",
    ) -> str | None:
        self.check(STATUS)
        return await self.kube.patch_status(namespace, name, status, resource_version, uid)

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> bool:
        self.check(GATE)
        return await self.kube.patch_pod_condition(namespace, name, uid, condition)

    async def record_event(
        self, topology: Mapping[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        self.check(EVENT)
        await self.kube.record_event(topology, event_type, reason, message)

    async def change_peers(
        self,
        endpoint: str,
        adds: list[PeerAdd],
        evicts: list[str],
        timeout_s: float,
        handshake_timeout_s: float | None = None,
        *,
        pod_uid: str = "",
        fetcher: tuple[str, str] = ("", ""),
    ) -> dict[tuple[str, str], CallResult]:
        self.check(PEERS)
        return await self.workers.change_peers(
            endpoint,
            adds,
            evicts,
            timeout_s,
            handshake_timeout_s,
            pod_uid=pod_uid,
            fetcher=fetcher,
        )

    async def set_idle_ttl(
        self, endpoint: str, idle_ttl_s: float, timeout_s: float, *, pod_uid: str = ""
    ) -> CallResult:
        self.check(SETTINGS)
        return await self.workers.set_idle_ttl(endpoint, idle_ttl_s, timeout_s, pod_uid=pod_uid)
