"""Leader election on a `coordination.k8s.io/v1` Lease: one acting replica, hot standbys.

Owns the election, the way client-go's `leaderelection` does it. Every candidate reads the
Lease each retry period. It takes the Lease when there is none (create), when its holder
released it (empty holderIdentity), or when its record has not changed for the record's
leaseDurationSeconds as observed *locally* (the time this candidate last saw the record
change, never the holder's renewTime: clocks of different machines are not compared). Every
write is conditional on the resourceVersion read, so of two candidates writing at once one
gets HTTP 409 and stays a candidate.

The leader renews every retry period. When it has not renewed successfully for
`renew_deadline_s` (measured from when the last successful attempt *started*), or a write of
the Lease is refused with 409, or the Lease names another holder, it stops leading at once
and calls `on_stopped_leading`. `renew_deadline_s < lease_duration_s`, so the callback has
run before any other candidate can see the Lease expire. It then goes back to being a
candidate. On `stop()` a leader stops leading first, then releases the Lease (empty holder,
leaseDurationSeconds 1) so that a standby takes over within a retry period.

The Lease calls go through a `LeaseStore` (`kube.LeaseClient` in the operator, an
in-memory fake in the unit tests); time through a `Clock` (injected by the tests). Used by
`handlers`, which starts and stops the reconcile loops from the callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from kvtopo_operator.kube import LeaseConflict, LeaseRecord

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ElectionConfig:
    """client-go's defaults: a 15 s lease, a 10 s renew deadline, a 2 s retry period."""

    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.lease_duration_s < 1:
            raise ValueError("the lease duration must be at least 1 s")
        if not 0 < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("the renew deadline must be shorter than the lease duration")
        if not 0 < self.retry_period_s < self.renew_deadline_s:
            raise ValueError("the retry period must be shorter than the renew deadline")


class LeaseStore(Protocol):
    """The Lease calls the elector makes (`kube.LeaseClient`)."""

    async def get(self) -> LeaseRecord | None: ...

    async def create(self, record: LeaseRecord) -> LeaseRecord: ...

    async def update(self, record: LeaseRecord) -> LeaseRecord: ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Real time: `time.monotonic` for deadlines and observations, UTC wall time for the
    Lease's timestamps."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def default_identity(name: str | None = None) -> str:
    """`name` (default: the host name) + "_" + a random suffix, unique per process."""
    return f"{name or socket.gethostname()}_{secrets.token_hex(4)}"


def _spec(record: LeaseRecord) -> LeaseRecord:
    return replace(record, resource_version="")


class LeaderElector:
    """Campaigns for the Lease behind `store` and holds it while it can (see the module).

    `on_started_leading` and `on_stopped_leading` are plain callables, called in the event
    loop the moment leadership is gained or lost; `is_leader` is already updated when they
    run. `start()` runs the election as a task, `stop()` ends it (and releases a Lease held).
    """

    def __init__(
        self,
        store: LeaseStore,
        *,
        on_started_leading: Callable[[], None],
        on_stopped_leading: Callable[[], None],
        identity: str | None = None,
        config: ElectionConfig | None = None,
        clock: Clock | None = None,
        name: str = "lease",
    ) -> None:
        self.store = store
        self.identity = identity or default_identity()
        self.config = config or ElectionConfig()
        self.clock: Clock = clock or SystemClock()
        self.name = name  # for the logs: e.g. "namespace/lease-name"
        self._on_started = on_started_leading
        self._on_stopped = on_stopped_leading
        self._observed: LeaseRecord | None = None  # the record as last read or written
        self._observed_at = 0.0  # monotonic time the record was last seen to change
        self._renewed_at = 0.0  # monotonic start of the last successful acquire/renew
        self._leading = False
        self._why = ""  # why the last attempt did not get or keep the Lease
        self._task: asyncio.Task[None] | None = None

    # --- state ---------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._leading

    def lease_left(self) -> float:
        """Seconds until the lease this replica holds goes stale: its last successful
        renewal *started* `renew_deadline_s` ago then (on this machine's monotonic clock).
        -inf when it does not lead. A replica whose process was paused past that finds
        this at or below 0 the moment it runs again, before its election notices; the
        operator's writes are fenced on it (`fence.Fence`)."""
        if not self._leading:
            return float("-inf")
        return self._left()

    @property
    def observed(self) -> LeaseRecord | None:
        """The Lease's record as this candidate last read or wrote it."""
        return self._observed

    @property
    def holder(self) -> str:
        """The holder named by the record last seen ("" when none)."""
        return self._observed.holder_identity if self._observed else ""

    # --- one attempt -----------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """One read and, where this candidate may, one write of the Lease: creates it when
        absent, takes it when released or expired, renews it when held by us. True when we
        hold it afterwards; False (reason in `_why`) when another holds it or a write got a
        409. Other API errors propagate (the caller retries)."""
        started = self.clock.monotonic()
        now = self.clock.now()
        duration = self.config.lease_duration_s
        current = await self.store.get()
        if current is None:
            fresh = LeaseRecord(self.identity, duration, now, now, 0)
            try:
                created = await self.store.create(fresh)
            except LeaseConflict:
                self._why = "another candidate created the lease first"
                return False
            self._saw(created)
            self._renewed_at = started
            return True
        self._saw(current)
        holder = current.holder_identity
        if holder != self.identity:
            if self._leading:
                self._why = f"the lease names {holder or 'no holder'}"
                return False
            if holder and not self._expired(current):
                self._why = f"held by {holder}"
                return False
        if holder == self.identity:
            acquired, transitions = current.acquire_time, current.lease_transitions
        else:
            acquired, transitions = now, current.lease_transitions + 1
        wanted = LeaseRecord(
            self.identity, duration, acquired, now, transitions, current.resource_version
        )
        try:
            written = await self.store.update(wanted)
        except LeaseConflict:
            self._why = "the lease changed since it was read (409)"
            return False
        self._saw(written)
        self._renewed_at = started
        return True

    def _saw(self, record: LeaseRecord) -> None:
        """Remembers the record; restarts the local expiry clock when its spec changed."""
        previous = self._observed
        if previous is None or _spec(previous) != _spec(record):
            self._observed_at = self.clock.monotonic()
            holder = record.holder_identity
            if holder != self.identity and (previous is None or previous.holder_identity != holder):
                log.info(
                    "%s: lease %s is held by %s",
                    self.identity,
                    self.name,
                    record.holder_identity or "nobody",
                )
        self._observed = record

    def _expired(self, record: LeaseRecord) -> bool:
        return self.clock.monotonic() > self._observed_at + record.lease_duration_seconds

    # --- the election ----------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Runs the election in a task (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"leader-election-{self.name}")
        return self._task

    async def stop(self, *, release: bool = True) -> None:
        """Ends the election: a leader stops leading (`on_stopped_leading`) first, then the
        Lease it holds is released so that a standby takes over at once."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._leading:  # run() was never started as a task
            self._lose("stopping", clean=True)
        if release:
            await self._release()

    async def run(self) -> None:
        """Campaign, lead until leadership is lost, campaign again; until cancelled."""
        try:
            while True:
                await self._acquire()
                self._lead()
                self._lose(await self._hold())
        finally:
            if self._leading:
                self._lose("the election stopped", clean=True)

    async def _acquire(self) -> None:
        """Tries every retry period until this candidate holds the Lease."""
        while True:
            try:
                if await self._within(self.try_acquire_or_renew(), self.config.renew_deadline_s):
                    return
                log.debug("%s: not the leader: %s", self.identity, self._why)
            except TimeoutError:
                log.warning("%s: reading lease %s timed out", self.identity, self.name)
            except Exception as exc:
                log.warning("%s: reading lease %s failed: %s", self.identity, self.name, exc)
            await self.clock.sleep(self.config.retry_period_s)

    async def _hold(self) -> str:
        """Renews every retry period; returns why leadership was lost. Never waits past the
        renew deadline: a call still hanging then counts as failed."""
        cfg = self.config
        while True:
            await self.clock.sleep(min(cfg.retry_period_s, max(0.0, self._left())))
            left = self._left()
            if left <= 0:
                return f"not renewed within the {cfg.renew_deadline_s:g}s renew deadline"
            try:
                if await self._within(self.try_acquire_or_renew(), left):
                    continue
            except TimeoutError:
                return f"not renewed within the {cfg.renew_deadline_s:g}s renew deadline"
            except Exception as exc:
                log.warning("%s: renewing lease %s failed: %s", self.identity, self.name, exc)
                continue
            return self._why

    def _left(self) -> float:
        return self._renewed_at + self.config.renew_deadline_s - self.clock.monotonic()

    def _lead(self) -> None:
        self._leading = True
        transitions = self._observed.lease_transitions if self._observed else 0
        log.info(
            "%s: became the leader (lease %s, transitions %d)",
            self.identity,
            self.name,
            transitions,
        )
        try:
            self._on_started()
        except Exception:
            log.exception("%s: on_started_leading failed", self.identity)

    def _lose(self, why: str, *, clean: bool = False) -> None:
        self._leading = False
        level = logging.INFO if clean else logging.WARNING
        log.log(level, "%s: stopped leading (lease %s): %s", self.identity, self.name, why)
        try:
            self._on_stopped()
        except Exception:
            log.exception("%s: on_stopped_leading failed", self.identity)

    async def _release(self) -> None:
        """Hands the Lease back when the record last seen names us: empty holder, a 1 s
        duration, conditional on the version seen (a 409 means it is someone else's now)."""
        seen = self._observed
        if seen is None or seen.holder_identity != self.identity:
            return
        now = self.clock.now()
        released = LeaseRecord("", 1, now, now, seen.lease_transitions, seen.resource_version)
        try:
            self._saw(await self._within(self.store.update(released), self.config.retry_period_s))
            log.info("%s: released lease %s", self.identity, self.name)
        except Exception as exc:  # it will expire instead
            log.warning("%s: releasing lease %s failed: %r", self.identity, self.name, exc)

    async def _within(self, work: Awaitable[T], seconds: float) -> T:
        """`work`'s result, or TimeoutError after `seconds` on the elector's clock (the work
        is cancelled; a call already in a worker thread finishes there, unheeded)."""
        job = asyncio.ensure_future(work)
        timer = asyncio.ensure_future(self.clock.sleep(seconds))
        try:
            done, _ = await asyncio.wait({job, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not job.done():
                job.cancel()
        if job in done:
            return job.result()
        raise TimeoutError(f"no answer within {seconds:g}s")
