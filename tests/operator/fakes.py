"""Test fakes for the reconciler's two clients, one copy for every operator unit test.

`FakeKube` stands in for `kube.KubeClient` (the topologies' bodies; records status writes,
Events and pod-condition writes; can fail status writes) and
`RecordingWorkers` for `workers.WorkerClient` (each endpoint's worker state; applies and
records peer changes and idle-TTL calls). Both only answer the calls the reconciler makes;
the `Reconciler` itself is built through its real constructor with them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

from kvtopo_operator.model import (
    PodView,
    WorkerUnreachable,
    WorkerView,
)
from kvtopo_operator.workers import CallResult, PeerAdd


class FakeKube:
    """The topologies' bodies by name; records status writes, Events and pod conditions."""

    def __init__(self, bodies: dict[str, dict[str, Any]]) -> None:
        self.bodies = bodies
        self.events: list[tuple[str, str, str, str]] = []
        self.status_writes = 0
        self.failures = 0  # status writes still to fail (as a 429 would)
        self.conflicts = 0  # status writes refused: the version they named was not current
        self.pod_conditions: list[tuple[str, str, dict[str, str]]] = []  # (pod, uid, cond)

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.bodies.get(name)

    async def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str,
        uid: str = "",
    ) -> str | None:
        self.status_writes += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("(429) Too Many Requests")
        body = self.bodies.get(name)
        if body is None:
            return None
        if resource_version and resource_version != body["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return None
        body["status"] = status
        body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        return str(body["metadata"]["resourceVersion"])

    async def record_event(self, body: dict[str, Any], type_: str, reason: str, msg: str) -> None:
        self.events.append((body["metadata"]["name"], type_, reason, msg))

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> bool:
        self.pod_conditions.append((name, uid, condition))
        return True


class RecordingWorkers:
    """Each pod's worker state by endpoint; applies the peer changes it is asked for and
    records every call: `calls` (kind, endpoint) in order, `reads` (state reads),
    `batches` (the last batch per endpoint: added engine ids, call timeout, handshake
    deadline) and `idle_ttls`."""

    def __init__(
        self, views: dict[str, WorkerView | WorkerUnreachable], settings_ok: bool = True
    ) -> None:
        self.views = views
        self.settings_ok = settings_ok
        self.calls: list[tuple[str, str]] = []
        self.reads: list[str] = []
        self.batches: dict[str, tuple[list[str], float, float | None]] = {}
        self.idle_ttls: list[tuple[str, float]] = []
        self.refused_adds: set[str] = set()  # engine ids whose add every worker refuses

    @classmethod
    def for_pods(cls, pods: Iterable[PodView]) -> RecordingWorkers:
        """A worker per pod, engine id the pod's name upper-cased, in that pod (its uid),
        holding no peer."""
        return cls(
            {
                p.endpoint: WorkerView(p.name.upper(), p.role, "h", frozenset(), pod_uid=p.uid)
                for p in pods
            }
        )

    def peers_of(self, endpoint: str) -> frozenset[str]:
        view = self.views[endpoint]
        assert isinstance(view, WorkerView)
        return view.peers

    async def state(
        self, endpoint: str, timeout_s: float, known: WorkerView | None = None, pod_uid: str = ""
    ) -> WorkerView | WorkerUnreachable:
        self.calls.append(("state", endpoint))
        self.reads.append(endpoint)
        return self.views[endpoint]

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
        self.calls.append(("change_peers", endpoint))
        self.batches[endpoint] = (sorted(a.engine_id for a in adds), timeout_s, handshake_timeout_s)
        view = self.views[endpoint]
        added = {a.engine_id for a in adds} - self.refused_adds
        if isinstance(view, WorkerView):
            peers = (view.peers | added) - set(evicts)
            self.views[endpoint] = dataclasses.replace(view, peers=peers)
        refused = CallResult(False, 502, "fetching metadata: 401 unauthorized")
        return {
            ("add", a.engine_id): CallResult(True, 200, "", "added")
            if a.engine_id in added
            else refused
            for a in adds
        } | {("evict", e): CallResult(True, 200, "", "evicted") for e in evicts}

    async def set_idle_ttl(
        self, endpoint: str, idle_ttl_s: float, timeout_s: float, *, pod_uid: str = ""
    ) -> CallResult:
        self.calls.append(("set_idle_ttl", endpoint))
        self.idle_ttls.append((endpoint, idle_ttl_s))
        return CallResult(True, 200, "") if self.settings_ok else CallResult(False, 0, "refused")

    async def close(self) -> None:
        pass


class HungCalls(RecordingWorkers):
    """`RecordingWorkers` whose peer changes to the endpoints in `hung` are recorded as
    ``change_peers (hung)`` and answer only once `release` is set (a worker that accepted
    a call and froze)."""

    def __init__(
        self, views: dict[str, WorkerView | WorkerUnreachable], settings_ok: bool = True
    ) -> None:
        super().__init__(views, settings_ok)
        self.hung: set[str] = set()
        self.release = asyncio.Event()

    async def change_peers(self, endpoint: str, *args: Any, **kw: Any) -> Any:
        if endpoint in self.hung:
            self.calls.append(("change_peers (hung)", endpoint))
            await self.release.wait()
        return await super().change_peers(endpoint, *args, **kw)
