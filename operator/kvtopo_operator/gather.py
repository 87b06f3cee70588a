"""The operator's memory of worker state between reconcile rounds (the incremental gather).

Owns `WorkerViews`: the last `/v1/state` read from each engine pod's worker, when it was
read, and which workers must be read again. A round re-reads only the workers that are new,
moved to another endpoint, unreachable last time, marked dirty (a call to them failed), or
older than the full-resync age; the others keep their last view, updated with the outcome
of the operator's own calls (a peer it added is a peer the worker holds). So a pod event in
a fleet of a thousand workers costs the reads of the pods that changed, not a thousand, and
drift the operator did not cause (failures, restarts) is still seen within the resync age.
A re-read is conditional: a view exactly as read is sent back by its ETag, and a worker
whose state has not changed answers 304 with no body (the reader then returns that view).
Called by `reconcile`; the reader and clock are injected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from kvtopo_operator.model import (
    PodView,
    WorkerUnreachable,
    WorkerView,
)

# (endpoint, timeout, the view last read from that endpoint or None) -> the view now; the
# reader may answer the known view itself when the worker confirms it unchanged (a 304).
Reader = Callable[[str, float, WorkerView | None], Awaitable[WorkerView | WorkerUnreachable]]
Seen = WorkerView | WorkerUnreachable


@dataclass
class _Entry:
    endpoint: str
    view: Seen
    read_at: float
    dirty: bool = False


class WorkerViews:
    """The workers of one topology, as last read, and which to read again."""

    def __init__(
        self, read: Reader, *, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read = read
        self._max_age_s = max_age_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # by pod name
        self.reads = 0  # state reads made so far (for metrics and tests)
        self.unchanged = 0  # of which the worker confirmed the view kept (304)

    def _due(self, pod: PodView, now: float) -> bool:
        entry = self._entries.get(pod.name)
        return (
            entry is None
            or entry.dirty
            or entry.endpoint != pod.endpoint
            or isinstance(entry.view, WorkerUnreachable)
            or now - entry.read_at >= self._max_age_s
        )

    async def gather(
        self, pods: Iterable[PodView], *, concurrency: int, timeout_s: float
    ) -> Mapping[str, Seen]:
        """The view of every usable pod's worker (Ready, not deleting, with an endpoint),
        reading again those that are due; forgets pods that are no longer usable."""
        usable = {p.name: p for p in pods if p.ready and not p.deleting and p.endpoint}
        for name in [n for n in self._entries if n not in usable]:
            del self._entries[name]
        now = self._clock()
        due = [p for p in usable.values() if self._due(p, now)]
        sem = asyncio.Semaphore(max(1, concurrency))

        async def read(pod: PodView) -> None:
            entry = self._entries.get(pod.name)
            known = (
                entry.view
                if entry is not None
                and entry.endpoint == pod.endpoint
                and isinstance(entry.view, WorkerView)
                else None
            )
            async with sem:
                started = self._clock()
                view = await self._read(pod.endpoint, timeout_s, known)
            if view is known:
                self.unchanged += 1
            self._entries[pod.name] = _Entry(pod.endpoint, view, started)

        await asyncio.gather(*(read(p) for p in due))
        self.reads += len(due)
        return {name: self._entries[name].view for name in usable}

    def _update(self, pod: str, change: Callable[[WorkerView], WorkerView]) -> None:
        entry = self._entries.get(pod)
        if entry is not None and isinstance(entry.view, WorkerView):
            # No longer the view as read: the worker's ETag no longer vouches for it.
            entry.view = dataclasses.replace(change(entry.view), etag="")

    def peer_added(self, pod: str, engine_id: str, incarnation: str = "") -> None:
        """The worker of `pod` answered that it holds `engine_id` (added, renewed or
        present), of its process `incarnation`, healthy."""
        self.peers_changed(pod, {engine_id: incarnation}, {})

    def peer_evicted(self, pod: str, engine_id: str, result: str) -> None:
        """The worker of `pod` answered an eviction of `engine_id` with `result`."""
        self.peers_changed(pod, {}, {engine_id: result})

    def peers_changed(self, pod: str, added: Mapping[str, str], evicted: Mapping[str, str]) -> None:
        """The worker of `pod` answered a batch: it holds each engine of `added` (engine id
        -> its incarnation; added, renewed or present, healthy), and each of `evicted`
        (engine id -> the result) is evicted or absent, or "deferred" (held until its
        transfers finish). One new view per batch, not one per peer (a prefill's view holds
        a thousand peers)."""
        if not added and not evicted:
            return

        def change(v: WorkerView) -> WorkerView:
            peers, evicting = set(v.peers), set(v.evicting)
            incarnations = dict(v.peer_incarnations)
            unhealthy = v.unhealthy_peers
            if any(eid in unhealthy for eid in added):
                unhealthy = {k: w for k, w in unhealthy.items() if k not in added}
            peers.update(added)
            incarnations.update(added)
            for eid, result in evicted.items():
                if result == "deferred":
                    evicting.add(eid)
                else:
                    peers.discard(eid)
                    evicting.discard(eid)
            return dataclasses.replace(
                v,
                peers=frozenset(peers),
                evicting=frozenset(evicting),
                peer_incarnations=incarnations,
                unhealthy_peers=unhealthy,
            )

        self._update(pod, change)

    def view(self, pod: str) -> Seen | None:
        """The last view of the worker of `pod` (None when it was never read)."""
        entry = self._entries.get(pod)
        return entry.view if entry is not None else None

    def idle_ttl_set(self, pod: str, idle_ttl_s: float) -> None:
        """The worker of `pod` answered that its idle TTL is now `idle_ttl_s`."""
        self._update(pod, lambda v: dataclasses.replace(v, idle_ttl_s=idle_ttl_s))

    def mark_dirty(self, pod: str) -> None:
        """A call to the worker of `pod` failed: read it again next round."""
        entry = self._entries.get(pod)
        if entry is not None:
            entry.dirty = True
