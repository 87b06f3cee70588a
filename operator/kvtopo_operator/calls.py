"""A loop's calls to its workers: each worker's part of a plan, one call out at a time.

Owns `WorkerCalls.act`, which makes a plan's handshakes and evictions (one batched call per
worker, at most `BATCH_LIMIT` items a call, bounded concurrency, the handshake deadline) and
sets idle TTLs, every call through the fence (`fence.FencedWrites`: a replica that does not
lead sends nothing); `Calls`, a loop's calls still out and what they ended with since a
round last took it; and the rules that keep a worker to one call out (`queue`: a later
plan's part waits behind the calls out, `still_lacking`: less what those made). Each
worker's calls are a task of their own: a round waits for them at most its wait, less once
the rest are stragglers (`gather.wait_most`), and what a call still out ends with is the
next round's. So a hung or slow worker costs its own engine only. Used by `reconcile`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from kvtopo_operator.api import LastFailure
from kvtopo_operator.fence import Fenced, FencedWrites
from kvtopo_operator.gather import WorkerViews, wait_most
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import (
    Event,
    Eviction,
    Handshake,
    Plan,
    SetIdleTTL,
    WorkerView,
    rfc3339,
)
from kvtopo_operator.workers import CallResult, PeerAdd

log = logging.getLogger(__name__)

BATCH_LIMIT = 512  # adds plus evictions per worker call (the worker takes up to 1,024)


@dataclass
class Outcome:
    """What acting on a plan did (and the calls of earlier rounds that ended since)."""

    acted: bool  # something changed (run again soon)
    events: list[Event]
    failures: list[tuple[str, LastFailure]]  # seen by the operator itself (unreachable)
    made: list[Handshake]
    failed: dict[Handshake, str]  # handshake -> why it failed
    # The plan's handshakes left to a later round: their worker's calls were still out.
    deferred: list[Handshake] = field(default_factory=list)


@dataclass
class WorkerPart:
    """One worker's part of a plan."""

    adds: list[Handshake] = field(default_factory=list)
    evicts: list[Eviction] = field(default_factory=list)
    ttl: SetIdleTTL | None = None


@dataclass
class Calls:
    """A loop's worker calls still out (pod name -> the task making them), and what calls
    ended with since a round last took it."""

    out: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    outcome: Outcome = field(default_factory=lambda: Outcome(False, [], [], [], {}))
    # A worker's part of a later plan, made by its task as soon as its calls out end (pod
    # name -> endpoint and part): at most one per worker, the latest round's (a pass's
    # part joins it). See `WorkerCalls.act`.
    queued: dict[str, tuple[str, WorkerPart]] = field(default_factory=dict)

    def cancel(self) -> None:
        for task in self.out.values():
            task.cancel()


def queue(calls: Calls, pod: str, endpoint: str, part: WorkerPart, *, join: bool) -> None:
    """Queues `part` behind the worker's calls out (`Calls.queued`). A round's part
    replaces what was queued (its plan was made from fresher views and holds everything
    still lacking); a pass's part (`join`) is added to it."""
    held = calls.queued.get(pod)
    if join and held is not None and held[0] == endpoint:
        old = held[1]
        seen = {(h.peer_engine_id, h.peer_incarnation) for h in old.adds}
        adds = old.adds + [
            h for h in part.adds if (h.peer_engine_id, h.peer_incarnation) not in seen
        ]
        part = WorkerPart(adds, old.evicts + part.evicts, part.ttl or old.ttl)
    calls.queued[pod] = (endpoint, part)


def still_lacking(part: WorkerPart, view: object) -> WorkerPart:
    """`part` less what calls that ended since the plan's views were read have done: the
    adds the worker's view now holds as they are (a peer held but unhealthy or being
    evicted is still added, `logic.holds`), and the evictions of peers it no longer holds
    (evicted again, the worker would answer "absent": a round's part queued behind the
    calls evicting the same gone engines from every prefill sent them all again)."""
    if not isinstance(view, WorkerView) or not (part.adds or part.evicts):
        return part
    held = view.peer_incarnations
    peers, evicting, unhealthy = view.peers, view.evicting, view.unhealthy_peers
    adds = [
        h
        for h in part.adds
        if h.peer_engine_id not in peers
        or held.get(h.peer_engine_id) != h.peer_incarnation
        or h.peer_engine_id in evicting
        or h.peer_engine_id in unhealthy
    ]
    evicts = [e for e in part.evicts if e.engine_id in peers]
    if len(adds) == len(part.adds) and len(evicts) == len(part.evicts):
        return part
    return WorkerPart(adds, evicts, part.ttl)


class WorkerCalls:
    """Makes a loop's worker calls (see the module); `writes`: the fenced path to workers."""

    def __init__(self, writes: FencedWrites, metrics: OperatorMetrics) -> None:
        self.writes = writes
        self.metrics = metrics

    async def act(
        self,
        plan: Plan,
        views: WorkerViews,
        sem: asyncio.Semaphore,
        call_timeout: float,
        now: datetime,
        failing_before: set[Handshake] | None = None,
        *,
        calls: Calls | None = None,
        wait_s: float | None = None,
        on_late: Callable[[], None] = lambda: None,
        take: bool = True,
    ) -> Outcome:
        """Makes the plan's handshakes and evictions: one call per worker (a batch of its
        adds and evictions, the adds bounded by `call_timeout`, the handshake deadline), and
        sets the idle TTL of the workers the plan names, at most `sem` calls at once; records
        each outcome in `views`.

        Each worker's calls are a task of their own (`calls`, the loop's: at most one per
        worker; a worker whose calls of an earlier round are still out gets nothing new
        now, its part of the plan waits for the next round). The round waits for them up to
        `wait_s` (None: until each has answered or reached its deadline), less once the
        rest are stragglers (`gather.wait_most`); those still out go on, and what they
        end with is the next round's (`calls.outcome`), which `on_late` (the loop's poke)
        starts. So a hung or slow worker costs its own engine only.
        `take=False` (the fast pass): what every call ends with is left to the next round,
        which takes it with its own (the answer is then empty)."""
        calls = calls if calls is not None else Calls()
        by_worker: dict[tuple[str, str], WorkerPart] = {}
        for h in plan.handshakes:  # a surge's tens of thousands: no part made per half
            part = by_worker.get((h.pod, h.endpoint))
            if part is None:
                part = by_worker[(h.pod, h.endpoint)] = WorkerPart()
            part.adds.append(h)
        for e in plan.evictions:
            by_worker.setdefault((e.pod, e.endpoint), WorkerPart()).evicts.append(e)
        for change in plan.idle_ttls:
            by_worker.setdefault((change.pod, change.endpoint), WorkerPart()).ttl = change
        for (pod, endpoint), part in by_worker.items():
            # Less what calls made since the plan's views were read (the gather's
            # arrivals, paired while the round decided: `_admit_gathered`).
            by_worker[(pod, endpoint)] = still_lacking(part, views.view(pod))
        failing_before = failing_before or set()
        round_over = [False]

        async def work(pod: str, endpoint: str, part: WorkerPart) -> None:
            try:
                while True:
                    try:
                        await self._worker_calls(
                            pod,
                            endpoint,
                            part,
                            views,
                            sem,
                            call_timeout,
                            now,
                            failing_before,
                            calls,
                        )
                    except Fenced:  # counted; not leading now, so nothing more is sent
                        views.mark_dirty(pod)
                        break
                    # What a later plan queued meanwhile goes now, not a round later.
                    queued = calls.queued.pop(pod, None)
                    if queued is None:
                        break
                    endpoint, part = queued[0], still_lacking(queued[1], views.view(pod))
            finally:
                calls.out.pop(pod, None)
                calls.queued.pop(pod, None)
                if round_over[0]:
                    on_late()

        started: list[asyncio.Task[None]] = []
        deferred: list[Handshake] = []
        for (pod, endpoint), part in by_worker.items():
            if pod in calls.out:  # its calls of an earlier round are still out
                deferred.extend(part.adds)  # the next round's to count; made when they end
                queue(calls, pod, endpoint, part, join=not take)
                continue
            task = asyncio.create_task(work(pod, endpoint, part), name=f"kvtopo-calls-{pod}")
            calls.out[pod] = task
            started.append(task)
        await wait_most(started, wait_s)
        round_over[0] = True
        if not take:
            return Outcome(False, [], [], [], {}, deferred)
        out, calls.outcome = calls.outcome, Outcome(False, [], [], [], {})
        out.deferred = deferred
        return out

    async def _worker_calls(
        self,
        pod: str,
        endpoint: str,
        part: WorkerPart,
        views: WorkerViews,
        sem: asyncio.Semaphore,
        call_timeout: float,
        now: datetime,
        failing_before: set[Handshake],
        calls: Calls,
    ) -> None:
        """One worker's part of a plan: its batches of adds and evictions, then its idle
        TTL; each outcome is recorded in `views` and in `calls.outcome` as it comes."""

        def handshake_failed(h: Handshake, res: CallResult) -> None:
            out = calls.outcome
            views.mark_dirty(h.pod)
            out.failed[h] = res.message[:300]
            msg = f"{h.pod}: adding {h.peer_role} engine {h.peer_engine_id}: {res.message}"
            if h not in failing_before:  # an Event when it starts failing only
                out.events.append(Event("Warning", "HandshakeFailed", msg))
            if res.status == 0:  # the worker never saw it, so it could not count it
                out.failures.append(
                    (
                        "handshake_failed",
                        LastFailure(
                            time=rfc3339(now),
                            type="handshake_failed",
                            engine_id=h.peer_engine_id,
                            pod=h.pod,
                            message=res.message[:512],
                        ),
                    )
                )

        def eviction_done(
            e: Eviction, res: CallResult, evicted: dict[str, str], outcomes: Counter[str]
        ) -> bool:
            outcomes[res.result or ("unreachable" if res.status == 0 else "failed")] += 1
            if res.ok:
                evicted[e.engine_id] = res.result
                return True
            views.mark_dirty(e.pod)
            failed_evictions.append(f"{e.engine_id[:64]}: {res.message[:120]}")
            return False

        failed_evictions: list[str] = []  # one log line per call, not one per engine

        # The batch's handshake deadline goes only to a worker that reports one (an older
        # worker refuses the field, and keeps its own default).
        view = views.view(pod)
        takes_deadline = isinstance(view, WorkerView) and view.handshake_timeout_s is not None
        # Calls are signed for the worker's pod (the identity the round checked), and each
        # add carries a ticket minted for this worker's engine and incarnation.
        pod_uid = view.pod_uid if isinstance(view, WorkerView) else ""
        fetcher = (view.engine_id, view.incarnation) if isinstance(view, WorkerView) else ("", "")
        items: list[Handshake | Eviction] = [*part.adds, *part.evicts]
        for start in range(0, len(items), BATCH_LIMIT):
            batch = items[start : start + BATCH_LIMIT]
            add_part = [x for x in batch if isinstance(x, Handshake)]
            ev_part = [x for x in batch if isinstance(x, Eviction)]
            async with sem:
                results = await self.writes.change_peers(
                    endpoint,
                    [
                        PeerAdd(
                            h.peer_engine_id,
                            h.peer_endpoint,
                            h.peer_role,
                            h.peer_pod_uid,
                            h.peer_incarnation,
                        )
                        for h in add_part
                    ],
                    [e.engine_id for e in ev_part],
                    call_timeout,
                    handshake_timeout_s=call_timeout if takes_deadline else None,
                    pod_uid=pod_uid,
                    fetcher=fetcher,
                )
            added: dict[str, str] = {}
            evicted: dict[str, str] = {}
            made = calls.outcome.made
            outcomes: Counter[str] = Counter()
            for h in add_part:  # a prefill's batch in a surge: hundreds
                res = results[("add", h.peer_engine_id)]
                if res.ok:
                    added[h.peer_engine_id] = h.peer_incarnation
                    made.append(h)
                    outcomes["ok"] += 1
                else:
                    handshake_failed(h, res)
                    outcomes["unreachable" if res.status == 0 else "failed"] += 1
            for outcome, n in outcomes.items():
                self.metrics.handshakes.labels(outcome).inc(n)
            evictions: Counter[str] = Counter()
            done = [
                eviction_done(e, results[("evict", e.engine_id)], evicted, evictions)
                for e in ev_part
            ]
            for outcome, n in evictions.items():  # a rollout's round: thousands
                self.metrics.evictions.labels(outcome).inc(n)
            if failed_evictions:
                log.warning(
                    "%s: %d evictions failed: %s%s",
                    pod,
                    len(failed_evictions),
                    "; ".join(failed_evictions[:3]),
                    " ..." if len(failed_evictions) > 3 else "",
                )
                failed_evictions.clear()
            views.peers_changed(pod, added, evicted)
            if added or any(done):
                calls.outcome.acted = True
        change = part.ttl
        if change is not None:
            async with sem:
                res = await self.writes.set_idle_ttl(
                    change.endpoint, change.idle_ttl_s, call_timeout, pod_uid=pod_uid
                )
            if res.ok:
                views.idle_ttl_set(change.pod, change.idle_ttl_s)
                log.info("%s: idle TTL set to %gs", change.pod, change.idle_ttl_s)
            else:
                views.mark_dirty(change.pod)
                log.warning("%s: setting the idle TTL: %s", change.pod, res.message)
