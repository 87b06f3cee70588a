"""The leader elector's decisions, on virtual time, against an in-memory Lease store.

`LeaderElector` is built through its real constructor with a fake `LeaseStore` (the API
server's semantics: a create of an existing Lease and a write at a stale resourceVersion get
409) and a fake `Clock` whose time moves only when a test moves it. A test advances the clock
event by event (each sleeper wakes at its own deadline) and waits, after each, until every
elector is idle again (asleep on the clock, or stuck in a call its store leaves hanging), so
what is asserted is the state reached, never a guess at how long something takes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from kvtopo_operator.kube import LeaseConflict, LeaseRecord
from kvtopo_operator.leader import ElectionConfig, LeaderElector, default_identity

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
CFG = ElectionConfig()  # client-go's defaults: lease 15 s, renew deadline 10 s, retry 2 s


# --- fakes ---------------------------------------------------------------------------------


class FakeClock:
    """Virtual time: `sleep` returns once `advance`/`run_until` reach its deadline."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleepers: list[tuple[float, asyncio.Future[None], asyncio.Task[object] | None]] = []

    def monotonic(self) -> float:
        return self.t

    def now(self) -> datetime:
        return EPOCH + timedelta(seconds=self.t)

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.t + max(0.0, seconds), fut, asyncio.current_task())
        self.sleepers.append(entry)
        try:
            if seconds <= 0:
                fut.set_result(None)
            await fut
        finally:
            self.sleepers.remove(entry)

    def asleep(self, task: asyncio.Task[object]) -> bool:
        return any(t is task and not f.done() for _, f, t in self.sleepers)

    def next_deadline(self) -> float | None:
        pending = [d for d, f, _ in self.sleepers if not f.done()]
        return min(pending) if pending else None

    def wake_due(self) -> None:
        for deadline, fut, _ in list(self.sleepers):
            if deadline <= self.t and not fut.done():
                fut.set_result(None)


@dataclass
class FakeLeaseServer:
    """The API server's view of one Lease: resourceVersions, 409s, every accepted write."""

    record: LeaseRecord | None = None
    version: int = 0
    writes: list[tuple[float, LeaseRecord]] = field(default_factory=list)
    clock: FakeClock | None = None

    def put(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        self.writes.append((self.clock.t if self.clock else 0.0, self.record))
        return self.record


class FakeStore:
    """One candidate's connection to the fake server. `mode`: "ok", "fail" (every call
    raises, like a refused connection) or "hang" (every call waits forever, like a
    black-holed one). `before_write` runs between a candidate's read and its write."""

    def __init__(self, server: FakeLeaseServer) -> None:
        self.server = server
        self.mode = "ok"
        self.hanging = 0
        self.calls = 0
        self.before_write: Callable[[], None] | None = None

    async def _gate(self) -> None:
        self.calls += 1
        if self.mode == "fail":
            raise ConnectionRefusedError("partitioned")
        if self.mode == "hang":
            self.hanging += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.hanging -= 1

    def _hook(self) -> None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook()

    async def get(self) -> LeaseRecord | None:
        await self._gate()
        return self.server.record

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        await self._gate()
        self._hook()
        if self.server.record is not None:
            raise LeaseConflict("exists")
        return self.server.put(record)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        await self._gate()
        self._hook()
        current = self.server.record
        if current is None or current.resource_version != record.resource_version:
            raise LeaseConflict("stale resourceVersion")
        return self.server.put(record)


@dataclass
class Candidate:
    """An elector with its store, and what its callbacks saw: (time, "started"/"stopped")."""

    elector: LeaderElector
    store: FakeStore
    events: list[tuple[float, str]]
    task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.elector.identity


class World:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.server = FakeLeaseServer(clock=self.clock)
        self.log: list[tuple[float, str, str]] = []  # (time, identity, started/stopped)
        self.candidates: list[Candidate] = []

    def candidate(self, identity: str, config: ElectionConfig = CFG) -> Candidate:
        store = FakeStore(self.server)
        events: list[tuple[float, str]] = []

        def note(what: str) -> Callable[[], None]:
            def callback() -> None:
                events.append((self.clock.t, what))
                self.log.append((self.clock.t, identity, what))

            return callback

        elector = LeaderElector(
            store,
            on_started_leading=note("started"),
            on_stopped_leading=note("stopped"),
            identity=identity,
            config=config,
            clock=self.clock,
            name="ns/lease",
        )
        c = Candidate(elector, store, events)
        self.candidates.append(c)
        return c

    async def start(self, c: Candidate) -> None:
        c.task = c.elector.start()
        await self.settle()

    def idle(self, c: Candidate) -> bool:
        task = c.task
        return task is None or task.done() or self.clock.asleep(task) or c.store.hanging > 0

    async def settle(self) -> None:
        """Lets the event loop run until every started elector is idle and nothing at all is
        ready to run (the fakes do no I/O, so then nothing moves until the clock does)."""
        loop = asyncio.get_running_loop()
        for _ in range(10_000):
            await asyncio.sleep(0)
            # `_ready`: the loop's queue of callbacks to run next (CPython's BaseEventLoop).
            if not loop._ready and all(self.idle(c) for c in self.candidates):  # type: ignore[attr-defined]
                return
        raise AssertionError("the electors never went idle")

    async def run_until(self, t: float) -> None:
        """Moves time to `t`, waking each sleeper at its own deadline on the way."""
        while True:
            await self.settle()
            nxt = self.clock.next_deadline()
            if nxt is None or nxt > t:
                break
            self.clock.t = max(self.clock.t, nxt)
            self.clock.wake_due()
        self.clock.t = t
        await self.settle()

    def leaders(self) -> list[str]:
        return [c.name for c in self.candidates if c.elector.is_leader]

    async def close(self) -> None:
        for c in self.candidates:
            if c.task is not None:
                c.task.cancel()
        await asyncio.gather(
            *(c.task for c in self.candidates if c.task is not None), return_exceptions=True
        )


def held_by(holder: str, *, renew: datetime = EPOCH, transitions: int = 0) -> LeaseRecord:
    return LeaseRecord(holder, 15, renew, renew, transitions)


# --- configuration and identity ------------------------------------------------------------


def test_defaults_are_client_gos() -> None:
    assert (CFG.lease_duration_s, CFG.renew_deadline_s, CFG.retry_period_s) == (15, 10.0, 2.0)


@pytest.mark.parametrize(
    ("lease", "renew", "retry", "message"),
    [
        (15, 15.0, 2.0, "renew deadline must be shorter than the lease duration"),
        (15, 20.0, 2.0, "renew deadline must be shorter than the lease duration"),
        (15, 10.0, 10.0, "retry period must be shorter than the renew deadline"),
        (15, 10.0, 0.0, "retry period must be shorter than the renew deadline"),
        (0, 0.5, 0.1, "at least 1 s"),
    ],
)
def test_config_refuses_deadlines_that_could_overlap_leaders(
    lease: int, renew: float, retry: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ElectionConfig(lease, renew, retry)


def test_default_identity_is_host_and_random_suffix() -> None:
    a, b = default_identity(), default_identity()
    assert a != b
    assert a.startswith(socket.gethostname() + "_") and len(a) > len(socket.gethostname()) + 4
    assert default_identity("kvtopo-operator-7d9f-abcde").startswith("kvtopo-operator-7d9f-abcde_")


# --- single attempts -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_acquires_an_absent_lease_by_creating_it() -> None:
    w = World()
    a = w.candidate("a")
    w.clock.t = 3.0
    assert await a.elector.try_acquire_or_renew()
    rec = w.server.record
    assert rec is not None
    assert rec.holder_identity == "a" and rec.lease_duration_seconds == 15
    assert rec.acquire_time == rec.renew_time == EPOCH + timedelta(seconds=3)
    assert rec.lease_transitions == 0
    assert a.elector.holder == "a"


@pytest.mark.asyncio
async def test_a_fresh_lease_of_another_holder_is_left_alone_until_it_expires() -> None:
    w = World()
    w.server.put(held_by("other", transitions=4))
    b = w.candidate("b")
    assert not await b.elector.try_acquire_or_renew()  # first seen at t=0
    w.clock.t = 15.0  # not yet *past* 15 s since the record was seen to change
    assert not await b.elector.try_acquire_or_renew()
    assert [r.holder_identity for _, r in w.server.writes] == ["other"], "nothing written"
    w.clock.t = 15.01
    assert await b.elector.try_acquire_or_renew()
    rec = w.server.record
    assert rec is not None and rec.holder_identity == "b"
    assert rec.lease_transitions == 5
    assert rec.acquire_time == rec.renew_time == EPOCH + timedelta(seconds=15.01)


@pytest.mark.asyncio
async def test_expiry_is_judged_by_local_observation_not_by_the_renew_time() -> None:
    w = World()
    # The record claims a renewal ten years ago (a holder whose clock is wrong): a candidate
    # that sees it for the first time still waits a whole lease duration.
    w.server.put(held_by("skewed", renew=EPOCH - timedelta(days=3650)))
    b = w.candidate("b")
    w.clock.t = 100.0
    assert not await b.elector.try_acquire_or_renew()
    w.clock.t = 114.9
    assert not await b.elector.try_acquire_or_renew()
    w.clock.t = 115.1
    assert await b.elector.try_acquire_or_renew()


@pytest.mark.asyncio
async def test_every_renewal_restarts_the_standbys_expiry_clock() -> None:
    w = World()
    w.server.put(held_by("other"))
    b = w.candidate("b")
    assert not await b.elector.try_acquire_or_renew()  # seen at t=0
    w.clock.t = 10.0
    w.server.put(held_by("other", renew=EPOCH + timedelta(seconds=10)))
    assert not await b.elector.try_acquire_or_renew()  # the change is seen at t=10
    w.clock.t = 20.0  # 20 s after the first sight, 10 s after the last change
    assert not await b.elector.try_acquire_or_renew()
    w.clock.t = 25.01
    assert await b.elector.try_acquire_or_renew()


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_once() -> None:
    w = World()
    w.server.put(LeaseRecord("", 1, EPOCH, EPOCH, 7))
    b = w.candidate("b")
    assert await b.elector.try_acquire_or_renew()
    rec = w.server.record
    assert rec is not None and rec.holder_identity == "b" and rec.lease_transitions == 8


@pytest.mark.asyncio
async def test_renewing_keeps_acquire_time_and_transitions() -> None:
    w = World()
    a = w.candidate("a")
    assert await a.elector.try_acquire_or_renew()
    w.clock.t = 2.0
    assert await a.elector.try_acquire_or_renew()
    rec = w.server.record
    assert rec is not None
    assert rec.acquire_time == EPOCH and rec.renew_time == EPOCH + timedelta(seconds=2)
    assert rec.lease_transitions == 0 and rec.resource_version == "2"


@pytest.mark.asyncio
async def test_a_write_at_a_stale_version_does_not_get_the_lease() -> None:
    w = World()
    w.server.put(LeaseRecord("", 1, EPOCH, EPOCH, 0))  # released: both may take it
    a = w.candidate("a")
    # b writes between a's read and a's write: a's write carries a stale resourceVersion.
    a.store.before_write = lambda: w.server.put(held_by("b", transitions=1))
    assert not await a.elector.try_acquire_or_renew()
    rec = w.server.record
    assert rec is not None and rec.holder_identity == "b"
    assert "409" in a.elector._why
    assert [r.holder_identity for _, r in w.server.writes] == ["", "b"]


@pytest.mark.asyncio
async def test_two_candidates_creating_at_once_get_one_lease() -> None:
    w = World()
    a = w.candidate("a")
    a.store.before_write = lambda: w.server.put(held_by("b"))  # b's create lands first
    assert not await a.elector.try_acquire_or_renew()
    assert [r.holder_identity for _, r in w.server.writes] == ["b"]
    assert not await a.elector.try_acquire_or_renew()  # and a fresh lease is b's


# --- the election loop on virtual time ------------------------------------------------------


@pytest.mark.asyncio
async def test_exactly_one_of_two_leads_and_renews_every_retry_period() -> None:
    w = World()
    a, b = w.candidate("a"), w.candidate("b")
    try:
        await w.start(a)
        await w.start(b)
        for t in (1.0, 5.0, 30.0, 61.0):
            await w.run_until(t)
            assert w.leaders() == ["a"], t
        renewals = [t for t, r in w.server.writes if r.holder_identity == "a"]
        assert renewals == [float(x) for x in range(0, 61, 2)]
        assert b.events == [] and a.events == [(0.0, "started")]
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_standby_takes_over_a_dead_leaders_lease_after_the_lease_duration() -> None:
    w = World()
    w.server.put(held_by("dead"))  # a leader that crashed right after renewing at t=0
    b = w.candidate("b")
    try:
        await w.start(b)
        await w.run_until(14.0)
        assert w.leaders() == []
        await w.run_until(17.0)
        assert w.leaders() == ["b"]
        # Tries every 2 s: seen at 0, expired after 15, taken at the first try past it.
        assert b.events == [(16.0, "started")]
    finally:
        await w.close()


@pytest.mark.parametrize("partition", ["fail", "hang"])
@pytest.mark.asyncio
async def test_a_leader_cut_off_stops_acting_before_the_standby_can_take_over(
    partition: str,
) -> None:
    w = World()
    a, b = w.candidate("a"), w.candidate("b")
    try:
        await w.start(a)
        await w.start(b)
        await w.run_until(5.0)  # a renewed at 0, 2, 4
        a.store.mode = partition  # from now on a reaches nothing
        await w.run_until(40.0)
        last_renew = max(t for t, r in w.server.writes if r.holder_identity == "a")
        assert last_renew == 4.0
        stopped = [t for t, what in a.events if what == "stopped"]
        started_b = [t for t, what in b.events if what == "started"]
        # a stops acting exactly at its renew deadline, counted from its last renewal...
        assert stopped == [last_renew + CFG.renew_deadline_s], a.events
        # ...while b, which saw that renewal no earlier than it was written, waits a whole
        # lease duration from then, and takes over at its first try after that.
        assert len(started_b) == 1, b.events
        assert last_renew + CFG.lease_duration_s < started_b[0]
        assert started_b[0] <= last_renew + CFG.lease_duration_s + 2 * CFG.retry_period_s
        assert stopped[0] < started_b[0]
        assert w.log.index((stopped[0], "a", "stopped")) < w.log.index(
            (started_b[0], "b", "started")
        )
        assert w.leaders() == ["b"]
        assert not a.elector.is_leader
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_a_leader_whose_write_gets_409_stops_at_once() -> None:
    w = World()
    a = w.candidate("a")
    try:
        await w.start(a)
        await w.run_until(3.0)
        assert w.leaders() == ["a"]
        # Someone writes the Lease between a's read and its renewal at t=4.
        a.store.before_write = lambda: w.server.put(held_by("thief"))
        await w.run_until(4.0)
        assert a.events == [(0.0, "started"), (4.0, "stopped")]
        assert not a.elector.is_leader
        # Back to being a candidate: the thief's fresh lease is left alone.
        await w.run_until(18.0)
        assert a.events[-1] == (4.0, "stopped")
        rec = w.server.record
        assert rec is not None and rec.holder_identity == "thief"
        # ...until it expires (seen to change at 4, so past 19): taken back at 20.
        await w.run_until(21.0)
        assert a.events[-1] == (20.0, "started")
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_a_leader_that_sees_another_holder_stops_at_once() -> None:
    w = World()
    a = w.candidate("a")
    try:
        await w.start(a)
        await w.run_until(3.0)
        w.server.put(held_by("usurper"))  # e.g. written by hand
        await w.run_until(4.0)
        assert a.events == [(0.0, "started"), (4.0, "stopped")]
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_a_leader_that_got_through_again_in_time_keeps_leading() -> None:
    w = World()
    a = w.candidate("a")
    try:
        await w.start(a)
        await w.run_until(1.0)
        a.store.mode = "fail"
        await w.run_until(7.0)  # renewals at 2, 4, 6 fail; the deadline is at 10
        assert a.elector.is_leader
        a.store.mode = "ok"
        await w.run_until(11.0)
        assert a.events == [(0.0, "started")]
        assert a.elector.is_leader
        assert [t for t, r in w.server.writes] == [0.0, 8.0, 10.0]
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_stop_stops_acting_then_releases_so_the_standby_takes_over_at_once() -> None:
    w = World()
    a, b = w.candidate("a"), w.candidate("b")
    try:
        await w.start(a)
        await w.start(b)
        await w.run_until(6.5)

        order: list[str] = []
        original_update = a.store.update

        async def update(record: LeaseRecord) -> LeaseRecord:
            order.append(f"write holder={record.holder_identity!r} leading={a.elector.is_leader}")
            return await original_update(record)

        a.store.update = update  # type: ignore[method-assign]
        await a.elector.stop()
        a.task = None
        assert a.events == [(0.0, "started"), (6.5, "stopped")]
        assert order == ["write holder='' leading=False"], "released after it stopped acting"
        rec = w.server.record
        assert rec is not None
        assert (rec.holder_identity, rec.lease_duration_seconds) == ("", 1)
        assert rec.lease_transitions == 0
        await w.run_until(8.5)  # b's next try (b tries every 2 s from 0)
        assert b.events == [(8.0, "started")]
        rec = w.server.record
        assert rec is not None and rec.holder_identity == "b" and rec.lease_transitions == 1
    finally:
        await w.close()


@pytest.mark.asyncio
async def test_a_standby_stops_without_writing() -> None:
    w = World()
    a, b = w.candidate("a"), w.candidate("b")
    try:
        await w.start(a)
        await w.start(b)
        await w.run_until(3.0)
        writes = len(w.server.writes)
        await b.elector.stop()
        b.task = None
        assert len(w.server.writes) == writes and b.events == []
        assert w.leaders() == ["a"]
    finally:
        await w.close()
