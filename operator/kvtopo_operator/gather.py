"""The operator's memory of worker state between reconcile rounds (the incremental gather).

Owns `WorkerViews`: the last `/v1/state` read from each engine pod's worker, when it was
read, and which workers must be read again. A round reads, and waits for, only the workers
that are new, moved to another endpoint, unreachable last time or marked dirty (a call to
them failed); the others keep their last view, updated with the outcome of the operator's
own calls (a peer it added is a peer the worker holds). So a pod event in a fleet of a
thousand workers costs the reads of the pods that changed, not a thousand.

Drift the operator did not cause (failures, restarts, a peer gone unhealthy) is still seen
within about the resync age: a worker whose view is older than it is read again in the
background, off the round's path, at the round's concurrency; a re-read that brings a
different view calls `on_change` (the loop's poke), so the next round runs at once on it.
A large topology stretches that age so the re-reads stay within a budget of reads a second
(`refresh_age`): a thousand workers re-read every 1.8 s cost the operator a fifth of its CPU
and each worker a request every 2 s, to confirm, almost always, that nothing changed.
A background answer is dropped when the view changed meanwhile (the operator's own call,
or a read of the round): it could be older than what the operator already knows.
A re-read is conditional: a view exactly as read is sent back by its ETag, and a worker
whose state has not changed answers 304 with no body (the reader then returns that view).
A new worker whose first read fails (a pod can be Ready before its worker listens, when the
readiness probe is on the engine's own port) is tried again in the background at
`NEW_WORKER_RETRY_S`, and a view found pokes the loop: the engine is connected a fraction of
a second later, not a round or a resync later; while those tries run, rounds neither read
it nor wait for it.
A round never waits long for one worker (`gather`'s `wait_s`): a read still out when the
wait ends goes on in the background, bounded by its own deadline, and pokes the loop when it
brings a view; meanwhile the round decides with what it holds (a worker never read is left
out, as not read yet). A worker that is unreachable is read again in the background only, at
most one read at a time: a hung worker (SIGSTOPped, partitioned) costs its own engine and one
request in flight, never every round its timeout.
Called by `reconcile`; the reader, clock and poke are injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtopo_operator.model import (
    PodView,
    WorkerUnreachable,
    WorkerView,
)

# (endpoint, timeout, the view last read from that endpoint or None) -> the view now; the
# reader may answer the known view itself when the worker confirms it unchanged (a 304).
# (endpoint, timeout, the view held, the pod's uid): the worker must be that pod's.
Reader = Callable[[str, float, WorkerView | None, str], Awaitable[WorkerView | WorkerUnreachable]]
Seen = WorkerView | WorkerUnreachable
# When a new worker whose first read failed is tried again (seconds after the try before);
# after the last, the rounds read it, as any unreachable worker.
NEW_WORKER_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8)
# A round's wait for its reads (or calls) ends early once the others have answered and the
# rest are stragglers (`wait_most`): after the last answer it goes on as long again as the
# answers took so far, and at least this long. At 64 x 2,000 on two busy cores, healthy
# reads started together answered up to a tenth of a second apart (the event loop busy
# with the others' answers); at 0.05 s the fast pass left such a read to the next round.
STRAGGLER_MIN_S = 0.2
# While workers arrive (a new one's first read started within the resync age), a stale
# view waits for its background re-read until it is this many times its refresh age. In a
# 64 x 2,000 rollout the re-reads were a fifth of the event loop's work, confirming old
# engines about to go while the new ones waited for the loop; drift is still seen within
# twice the age.
ARRIVALS_STRETCH = 2.0


async def wait_set(event: asyncio.Event, timeout_s: float) -> None:
    """Waits until `event` is set or `timeout_s` has passed, whichever comes first. A
    cancellation always ends the wait cancelled: `asyncio.timeout`, not `wait_for`, which
    on Python 3.11 returns normally when the cancellation lands as the event is set, and a
    round or loop that was stopped would then go on."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


async def wait_most(tasks: Iterable[asyncio.Future[Any]], wait_s: float | None) -> None:
    """Waits for `tasks` until all have ended, `wait_s` has passed (None: no bound), or the
    rest are stragglers: since the last one ended, as long again as the wait took up to it
    (at least `STRAGGLER_MIN_S`) passed without another ending. One hung worker among a
    rollout's new ones (its read or call never answers) then holds the round for a fraction
    of what the healthy ones took, not its whole wait; healthy ones queued behind a
    concurrency bound keep ending, so they keep the wait going."""
    pending = [t for t in tasks if not t.done()]
    if not pending:
        return
    if wait_s is None:
        await asyncio.wait(pending)
        return
    loop = asyncio.get_running_loop()
    began = loop.time()
    end = began + wait_s
    left = len(pending)
    last: float | None = None
    woken = asyncio.Event()

    def ended(_: asyncio.Future[Any]) -> None:
        nonlocal left, last
        left -= 1
        last = loop.time()
        woken.set()

    for t in pending:
        t.add_done_callback(ended)
    try:
        while left:
            deadline = end
            if last is not None:
                deadline = min(end, last + max(STRAGGLER_MIN_S, last - began))
            timeout = deadline - loop.time()
            if timeout <= 0:
                return
            woken.clear()
            await wait_set(woken, timeout)
    finally:
        for t in pending:
            t.remove_done_callback(ended)


@dataclass
class _Entry:
    endpoint: str
    view: Seen
    read_at: float
    dirty: bool = False
    changes: int = 0  # the operator's own changes to the view since it was read


def _same(a: Seen, b: Seen) -> bool:
    """Whether two views say the same (an ETag alone is no difference)."""
    if isinstance(a, WorkerView) and isinstance(b, WorkerView):
        return a is b or dataclasses.replace(a, etag="") == dataclasses.replace(b, etag="")
    return a == b


class WorkerViews:
    """The workers of one topology, as last read, and which to read again."""

    def __init__(
        self,
        read: Reader,
        *,
        max_age_s: float,
        reads_per_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
        sharing: Callable[[], int] = lambda: 0,
    ) -> None:
        self._read = read
        self._max_age_s = max_age_s
        self._reads_per_s = reads_per_s
        # How many workers share the re-read budget with this topology's (its namespace's
        # engines): the budget is the namespace's, so 100 topologies of 10 engines re-read
        # as often as one of 1,000 (each of its own budget re-read 5 times as much).
        self._sharing = sharing
        self._workers = 0  # the usable workers the last gather looked at
        self._clock = clock
        self._on_change = on_change
        self._entries: dict[str, _Entry] = {}  # by pod name
        self._refreshing: set[str] = set()  # pods whose background re-read is under way
        self._reading: dict[str, asyncio.Future[None]] = {}  # pods whose round read is out
        self._refreshers: set[asyncio.Task[None]] = set()
        self.reads = 0  # state reads made so far (for metrics and tests)
        self.unchanged = 0  # of which the worker confirmed the view kept (304)
        self.refreshed_changed = 0  # background re-reads that brought a different view
        self._arrived_at = -float("inf")  # when the last new worker's first read started

    def _due(self, pod: PodView) -> bool:
        """Whether the round must read `pod`'s worker before it decides (unless a read of
        it is already out)."""
        entry = self._entries.get(pod.name)
        return (
            entry is None
            or entry.dirty
            or entry.endpoint != pod.endpoint
            # An unreachable worker, unless its background tries (a new one's) are running.
            or (isinstance(entry.view, WorkerUnreachable) and pod.name not in self._refreshing)
        )

    def _waited_for(self, pod: PodView) -> bool:
        """Whether the round waits (up to its `wait_s`) for its read of `pod`'s worker: not
        when the worker was unreachable at its last read at this endpoint (a hung or dead
        worker is read in the background; its answer pokes the loop)."""
        entry = self._entries.get(pod.name)
        return not (
            entry is not None
            and entry.endpoint == pod.endpoint
            and isinstance(entry.view, WorkerUnreachable)
        )

    def _known_at(self, pod: PodView) -> _Entry | None:
        """The entry held for `pod` at its endpoint (None: a worker new to this one)."""
        entry = self._entries.get(pod.name)
        return entry if entry is not None and entry.endpoint == pod.endpoint else None

    def _known(self, pod: PodView) -> WorkerView | None:
        """The view to offer a conditional read of `pod`'s worker (None: read it whole)."""
        entry = self._known_at(pod)
        return entry.view if entry is not None and isinstance(entry.view, WorkerView) else None

    async def gather(
        self,
        pods: Iterable[PodView],
        *,
        concurrency: int,
        timeout_s: float,
        wait_s: float | None = None,
    ) -> Mapping[str, Seen]:
        """The view of every usable pod's worker (Ready, not deleting, with an endpoint),
        reading again those that are due; forgets pods that are no longer usable.

        `wait_s`: how long the round waits for its reads (None: until each has answered or
        reached `timeout_s`, an unreachable worker's too). A read still out then goes on in
        the background; when it ends, its view is kept and the loop poked. The read of a
        worker unreachable at its last read is not waited for at all. A worker whose read
        is out and that has no view yet is left out of the answer (not read yet)."""
        usable = {p.name: p for p in pods if p.ready and not p.deleting and p.endpoint}
        for name in [n for n in self._entries if n not in usable]:
            del self._entries[name]
        await self._read_due(usable.values(), concurrency, timeout_s, wait_s)
        now = self._clock()
        self._workers = len(usable)
        age = self.refresh_age(max(len(usable), self._sharing()))
        if now - self._arrived_at < self._max_age_s:
            age *= ARRIVALS_STRETCH  # the arrivals first (`ARRIVALS_STRETCH`)
        old = now - age
        stale = [
            p
            for p in usable.values()
            if p.name not in self._refreshing
            and p.name not in self._reading
            and p.name in self._entries
            and self._entries[p.name].read_at <= old
        ]
        if stale:
            self._refreshing.update(p.name for p in stale)
            self._background(self._refresh(stale, concurrency, timeout_s))
        return {name: self._entries[name].view for name in usable if name in self._entries}

    def is_new(self, pod: PodView) -> bool:
        """Whether `pod`'s worker was never read at its endpoint (nor is being read): an
        engine that came up since the last round (`read_new`)."""
        return pod.name not in self._reading and self._known_at(pod) is None

    def arriving(self, pod: PodView) -> bool:
        """Whether `pod`'s worker was never read at its endpoint, its first read out or
        not (`read_new` waits for one that is out)."""
        return self._known_at(pod) is None

    async def read_new(
        self,
        pods: Iterable[PodView],
        *,
        concurrency: int,
        timeout_s: float,
        wait_s: float | None = None,
    ) -> Mapping[str, Seen]:
        """Reads the workers of `pods` that are new (`arriving`) and usable, as `gather`
        would, but forgets nothing: the fast pass between rounds reads only the engines
        that came up since the last round. A first read already out (`prefetch`) is waited
        for with the others, not started again. Returns the views of `pods` held now.
        `wait_s=0` starts the reads and returns at once: each pokes the loop when it ends."""
        usable = [p for p in pods if p.ready and not p.deleting and p.endpoint and self.arriving(p)]
        out = [self._reading[p.name] for p in usable if p.name in self._reading]
        await self._read_due(usable, concurrency, timeout_s, wait_s, also=out)
        return {p.name: self._entries[p.name].view for p in usable if p.name in self._entries}

    async def _read_due(
        self,
        usable: Iterable[PodView],
        concurrency: int,
        timeout_s: float,
        wait_s: float | None,
        also: Iterable[asyncio.Future[None]] = (),
    ) -> None:
        """Reads the workers of `usable` that are due (`_due`, unless a read of one is
        already out) and waits for them, and for the reads `also` (already out), up to
        `wait_s` (not for one unreachable at its last read: `_waited_for`). A read that
        ends after that wait pokes the loop: what it found is the next round's."""
        late = [False]
        due = [p for p in usable if p.name not in self._reading and self._due(p)]
        if any(self._known_at(p) is None for p in due):
            self._arrived_at = self._clock()
        sem = asyncio.Semaphore(max(1, concurrency))

        async def read(pod: PodView) -> None:
            try:
                async with sem:
                    held = self._entries.get(pod.name)
                    fresh = await self._read_entry(pod, timeout_s)
                if self._entries.get(pod.name) is not held:
                    return  # replaced while out (the operator's own call, a re-read)
                self._entries[pod.name] = fresh
                if late[0]:  # the round is over: what it found is the next round's
                    self._on_change()
                new = held is None or held.endpoint != pod.endpoint
                failed = isinstance(fresh.view, WorkerUnreachable)
                if new and failed and pod.name not in self._refreshing:
                    self._refreshing.add(pod.name)
                    self._background(self._retry(pod, timeout_s))
            finally:
                self._reading.pop(pod.name, None)

        waited: list[asyncio.Future[None]] = list(also)
        for p in due:
            task = asyncio.ensure_future(read(p))
            self._reading[p.name] = task
            self._refreshers.add(task)
            task.add_done_callback(self._refreshers.discard)
            if wait_s is None or self._waited_for(p):
                waited.append(task)
        try:
            await wait_most(waited, wait_s)
        finally:  # a cancelled wait too: a read ending later pokes the loop
            late[0] = True

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._refreshers.add(task)
        task.add_done_callback(self._refreshers.discard)

    async def _retry(self, pod: PodView, timeout_s: float) -> None:
        """Tries a new worker that failed its first read again (`NEW_WORKER_RETRY_S`) until
        it answers (or a round's read did) or it goes; a view found pokes the loop."""
        try:
            for delay in NEW_WORKER_RETRY_S:
                await asyncio.sleep(delay)
                entry = self._entries.get(pod.name)
                if (
                    entry is None
                    or entry.endpoint != pod.endpoint
                    or not isinstance(entry.view, WorkerUnreachable)
                ):
                    return  # gone, moved, or read by a round meanwhile
                fresh = await self._reread(pod, entry, timeout_s)
                if fresh is None:
                    continue  # a round read it meanwhile: what it found is looked at next
                if not isinstance(fresh.view, WorkerUnreachable):
                    self._on_change()
                    return
        finally:
            self._refreshing.discard(pod.name)

    async def _reread(self, pod: PodView, entry: _Entry, timeout_s: float) -> _Entry | None:
        """A background read of `pod`'s worker, kept unless `entry` was replaced (a round
        read it) or changed (the operator's own call, or a failed one) while it was out: the
        answer may predate what the operator learnt. None when it was not kept."""
        changes = entry.changes
        fresh = await self._read_entry(pod, timeout_s)
        if self._entries.get(pod.name) is not entry or entry.changes != changes:
            return None
        self._entries[pod.name] = fresh
        return fresh

    async def _read_entry(self, pod: PodView, timeout_s: float) -> _Entry:
        """One read of `pod`'s worker (conditional on the view held), counted."""
        known = self._known(pod)
        started = self._clock()
        view = await self._read(pod.endpoint, timeout_s, known, pod.uid)
        self.reads += 1
        if view is known:
            self.unchanged += 1
        return _Entry(pod.endpoint, view, started)

    def idle_wake_s(self) -> float:
        """How long a loop with nothing to do may wait before its next round, which starts
        the re-reads due: the resync period (`max_age_s` is 0.9 of it), or half the re-read
        age where the namespace's budget stretches it (a round finds nothing to re-read
        until then: 100 topologies of 10 engines each ran a round every 2 s for re-reads
        due every 10 s)."""
        resync = self._max_age_s / 0.9
        return max(resync, self.refresh_age(max(self._workers, self._sharing())) / 2)

    def refresh_age(self, workers: int) -> float:
        """How old a view of one of `workers` workers gets before it is re-read: the
        resync age, or longer where re-reading every worker that often would take more than
        `reads_per_s` reads a second (0: no such bound)."""
        if self._reads_per_s <= 0:
            return self._max_age_s
        return max(self._max_age_s, workers / self._reads_per_s)

    async def _refresh(self, pods: list[PodView], concurrency: int, timeout_s: float) -> None:
        """Re-reads the workers of `pods` (their views are stale) in the background; a view
        that differs from the one held is kept and pokes the loop at once (not at the end of
        the batch: a thousand re-reads take a second or two)."""
        sem = asyncio.Semaphore(max(1, concurrency))

        async def read(pod: PodView) -> None:
            try:
                entry = self._entries.get(pod.name)
                if entry is None or entry.endpoint != pod.endpoint:
                    return  # gone or moved since: a round reads it
                async with sem:
                    if self._entries.get(pod.name) is not entry:
                        return
                    fresh = await self._reread(pod, entry, timeout_s)
                if fresh is not None and not _same(fresh.view, entry.view):
                    self.refreshed_changed += 1
                    self._on_change()
            finally:
                self._refreshing.discard(pod.name)

        await asyncio.gather(*(read(p) for p in pods))

    async def refreshed(self) -> None:
        """Returns once the background re-reads started so far have ended."""
        while self._refreshers:
            await asyncio.gather(*self._refreshers, return_exceptions=True)

    def close(self) -> None:
        """Cancels the background re-reads (the loop is gone)."""
        for task in self._refreshers:
            task.cancel()

    def _update(self, pod: str, change: Callable[[WorkerView], WorkerView]) -> None:
        """The view of the worker of `pod` changed here by `change` (which must derive it,
        `WorkerView.derive`: no longer the view as read, so the worker's ETag no longer
        vouches for it)."""
        entry = self._entries.get(pod)
        if entry is not None and isinstance(entry.view, WorkerView):
            entry.view = change(entry.view)
            entry.changes += 1

    def peer_added(self, pod: str, engine_id: str, incarnation: str = "") -> None:
        """The worker of `pod` answered that it holds `engine_id` (added, renewed or
        present), of its process `incarnation`, healthy."""
        self.peers_changed(pod, {engine_id: incarnation}, {})

    def peer_evicted(self, pod: str, engine_id: str, result: str) -> None:
        """The worker of `pod` answered an eviction of `engine_id` with `result`."""
        self.peers_changed(pod, {}, {engine_id: result})

    def peers_changed(self, pod: str, added: Mapping[str, str], evicted: Mapping[str, str]) -> None:
        """The worker of `pod` answered a batch (`WorkerView.answered`). One new view per
        batch, not one per peer (a prefill's view holds a thousand peers)."""
        if added or evicted:
            self._update(pod, lambda v: v.answered(added, evicted))

    def view(self, pod: str) -> Seen | None:
        """The last view of the worker of `pod` (None when it was never read)."""
        entry = self._entries.get(pod)
        return entry.view if entry is not None else None

    def idle_ttl_set(self, pod: str, idle_ttl_s: float) -> None:
        """The worker of `pod` answered that its idle TTL is now `idle_ttl_s`."""
        self._update(pod, lambda v: v.derive((), idle_ttl_s=idle_ttl_s))

    def mark_dirty(self, pod: str) -> None:
        """A call to the worker of `pod` failed: read it again next round."""
        entry = self._entries.get(pod)
        if entry is not None:
            entry.dirty = True
            entry.changes += 1  # a background read under way may predate the failed call
