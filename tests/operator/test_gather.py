"""The incremental gather: which workers a round reads again, and what it remembers.

`WorkerViews` built through its real constructor with an injected reader and clock."""

from __future__ import annotations

import asyncio
import contextlib

from kvtopo_operator.gather import WorkerViews, wait_most
from kvtopo_operator.model import (
    PodView,
    WorkerUnreachable,
    WorkerView,
)


class Workers:
    """What each endpoint's worker would answer, and the reads made."""

    def __init__(self) -> None:
        self.answers: dict[str, WorkerView | WorkerUnreachable] = {}
        self.reads: list[str] = []

    async def read(
        self,
        endpoint: str,
        timeout_s: float,
        known: WorkerView | None = None,
        pod_uid: str = "",
    ) -> WorkerView | WorkerUnreachable:
        self.reads.append(endpoint)
        return self.answers[endpoint]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, endpoint: str = "", ready: bool = True, deleting: bool = False) -> PodView:
    return PodView(name, "decode", {}, ready, deleting, endpoint or f"127.0.0.1:{name}")


def view(engine_id: str, *peers: str) -> WorkerView:
    return WorkerView(engine_id, "decode", "h", frozenset(peers))


def gather(views: WorkerViews, pods: list[PodView]) -> dict[str, WorkerView | WorkerUnreachable]:
    return dict(asyncio.run(views.gather(pods, concurrency=4, timeout_s=1.0)))


def refresh(views: WorkerViews, pods: list[PodView]) -> dict[str, WorkerView | WorkerUnreachable]:
    """A round, its background re-reads ended, and what the next round sees."""

    async def both() -> dict[str, WorkerView | WorkerUnreachable]:
        await views.gather(pods, concurrency=4, timeout_s=1.0)
        await views.refreshed()
        return dict(await views.gather(pods, concurrency=4, timeout_s=1.0))

    return asyncio.run(both())


def setup() -> tuple[Workers, Clock, WorkerViews]:
    workers, clock = Workers(), Clock()
    return workers, clock, WorkerViews(workers.read, max_age_s=2.0, clock=clock)


def test_only_new_failed_or_moved_workers_are_read_in_the_round() -> None:
    workers, clock, views = setup()
    a, b = pod("a"), pod("b")
    workers.answers = {a.endpoint: view("ea"), b.endpoint: view("eb")}
    assert gather(views, [a, b]) == {"a": view("ea"), "b": view("eb")}
    assert sorted(workers.reads) == [a.endpoint, b.endpoint]

    # A new pod: only it is read.
    c = pod("c")
    workers.answers[c.endpoint] = WorkerUnreachable("connection refused")
    workers.reads.clear()
    clock.now += 1.0
    got = gather(views, [a, b, c])
    assert workers.reads == [c.endpoint] and got["c"] == WorkerUnreachable("connection refused")

    # An unreachable worker is read again next round; the others are not.
    workers.answers[c.endpoint] = view("ec")
    workers.reads.clear()
    assert gather(views, [a, b, c])["c"] == view("ec") and workers.reads == [c.endpoint]

    # A pod that moved to another endpoint is read again at the new one.
    moved = pod("b", endpoint="127.0.0.1:b2")
    workers.answers[moved.endpoint] = view("eb2")
    workers.reads.clear()
    assert gather(views, [a, moved, c])["b"] == view("eb2") and workers.reads == [moved.endpoint]


def test_a_stale_worker_is_read_again_in_the_background_and_a_change_pokes_the_loop() -> None:
    """Past the resync age a worker is re-read off the round's path: the round decides on
    the view held, and only a re-read that brings a different view pokes the loop."""
    workers, clock = Workers(), Clock()
    pokes: list[float] = []
    views = WorkerViews(
        workers.read, max_age_s=2.0, clock=clock, on_change=lambda: pokes.append(clock.now)
    )
    a, b = pod("a"), pod("b")
    workers.answers = {a.endpoint: view("ea", "p1"), b.endpoint: view("eb")}

    async def scenario() -> None:
        await views.gather([a, b], concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert pokes == [] and views.reads == 2  # nothing was stale

        clock.now += 1.0
        workers.reads.clear()
        await views.gather([a, b], concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert workers.reads == [] and pokes == []  # young views: no read at all

        # Both stale; a's worker now holds another peer, b's is as it was.
        clock.now += 1.0
        workers.answers[a.endpoint] = view("ea", "p1", "p2")
        got = await views.gather([a, b], concurrency=4, timeout_s=1.0)
        assert got["a"] == view("ea", "p1"), "the round does not wait for a stale re-read"
        await views.refreshed()
        assert sorted(workers.reads) == [a.endpoint, b.endpoint]
        assert len(pokes) == 1 and views.refreshed_changed == 1
        got = await views.gather([a, b], concurrency=4, timeout_s=1.0)
        assert got["a"] == view("ea", "p1", "p2")
        await views.refreshed()
        assert sorted(workers.reads) == [a.endpoint, b.endpoint], "both are young again"

    asyncio.run(scenario())


def test_a_background_read_never_overwrites_what_the_operator_learnt_meanwhile() -> None:
    """A stale re-read in flight while the operator's own call changes the view (or a call
    fails) is dropped: its answer may predate the call."""
    release = asyncio.Event()

    class Slow(Workers):
        async def read(
            self,
            endpoint: str,
            timeout_s: float,
            known: WorkerView | None = None,
            pod_uid: str = "",
        ) -> WorkerView | WorkerUnreachable:
            self.reads.append(endpoint)
            answer = self.answers[endpoint]
            if len(self.reads) > 1:
                await release.wait()
            return answer

    workers, clock = Slow(), Clock()
    pokes: list[int] = []
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock, on_change=lambda: pokes.append(1))
    p = pod("p")
    workers.answers[p.endpoint] = view("ep", "d1")

    async def reads_reach(n: int) -> None:
        for _ in range(100):  # the background task's steps, not time
            if len(workers.reads) >= n:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{len(workers.reads)} reads, not {n}")

    async def scenario() -> None:
        await views.gather([p], concurrency=4, timeout_s=1.0)
        clock.now += 2.0
        await views.gather([p], concurrency=4, timeout_s=1.0)  # the re-read starts, waits
        await reads_reach(2)
        views.peer_added("p", "d2")  # the operator's call lands while the read is out
        release.set()
        await views.refreshed()
        held = views.view("p")
        assert isinstance(held, WorkerView) and held.peers == {"d1", "d2"} and pokes == []
        # Stale still (the dropped answer did not count as a read), so it is read again.
        release.clear()
        clock.now += 0.1
        workers.answers[p.endpoint] = view("ep", "d1", "d2", "d3")
        await views.gather([p], concurrency=4, timeout_s=1.0)
        await reads_reach(3)
        views.mark_dirty("p")  # a call fails meanwhile: the round must read it itself
        release.set()
        await views.refreshed()
        got = await views.gather([p], concurrency=4, timeout_s=1.0)
        assert got["p"] == view("ep", "d1", "d2", "d3") and len(workers.reads) == 4
        views.close()

    asyncio.run(scenario())


def test_the_operators_own_calls_update_the_views_and_a_failed_call_forces_a_read() -> None:
    workers, _, views = setup()
    p = pod("p")
    workers.answers[p.endpoint] = view("ep", "d1", "d2")
    gather(views, [p])
    views.peer_added("p", "d3")
    views.peer_evicted("p", "d1", "evicted")
    views.peer_evicted("p", "d2", "deferred")
    views.peer_added("nobody", "d9")  # a pod it does not know: ignored
    workers.reads.clear()
    got = gather(views, [p])["p"]
    assert workers.reads == []  # nothing was due: the views carry the calls' outcomes
    assert isinstance(got, WorkerView)
    assert got.peers == {"d2", "d3"} and got.evicting == {"d2"}

    views.peer_evicted("p", "d2", "absent")
    got = gather(views, [p])["p"]
    assert isinstance(got, WorkerView) and got.peers == {"d3"} and got.evicting == frozenset()

    views.mark_dirty("p")
    workers.answers[p.endpoint] = view("ep", "d3", "d4")  # what the worker really holds
    assert gather(views, [p])["p"] == view("ep", "d3", "d4")
    assert workers.reads == [p.endpoint]


def test_pods_that_are_not_usable_are_forgotten_and_read_afresh_when_back() -> None:
    workers, _, views = setup()
    a = pod("a")
    workers.answers[a.endpoint] = view("ea")
    gather(views, [a])
    for gone in ([pod("a", ready=False)], [pod("a", deleting=True)], []):
        assert gather(views, gone) == {}
        # Back (a restarted worker is a new engine): read at once, not from memory.
        workers.answers[a.endpoint] = view("ea-restarted")
        workers.reads.clear()
        assert gather(views, [a]) == {"a": view("ea-restarted")}
        assert workers.reads == [a.endpoint]
        workers.answers[a.endpoint] = view("ea")
        views.mark_dirty("a")
        gather(views, [a])


def test_a_re_read_offers_the_view_as_read_and_keeps_it_when_the_worker_confirms_it() -> None:
    """A stale worker is read again with the view last read from its endpoint (so the
    reader can send its ETag); when the reader answers that same view (a 304) it is kept and
    counted unchanged. A view changed here since (the operator's own calls) carries no ETag:
    only the worker's answer can vouch for it."""
    offered: list[WorkerView | None] = []

    class Conditional(Workers):
        async def read(
            self,
            endpoint: str,
            timeout_s: float,
            known: WorkerView | None = None,
            pod_uid: str = "",
        ) -> WorkerView | WorkerUnreachable:
            offered.append(known)
            if known is not None and known.etag == "t1":
                return known  # the worker answered 304
            return await super().read(endpoint, timeout_s, known)

    workers, clock = Conditional(), Clock()
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock)
    a = pod("a")
    first = WorkerView("ea", "decode", "h", frozenset({"p1"}), etag="t1")
    workers.answers[a.endpoint] = first
    assert gather(views, [a])["a"] is first and offered == [None]

    clock.now += 2.0  # stale: read again (in the background), offering the view as read
    assert refresh(views, [a])["a"] is first
    assert offered[-1] is first and (views.reads, views.unchanged) == (2, 1)

    # The operator added a peer: the view is its own now, with no ETag to offer.
    views.peer_added("a", "p2")
    mine = views.view("a")
    assert isinstance(mine, WorkerView) and mine.peers == {"p1", "p2"} and mine.etag == ""
    now = WorkerView("ea", "decode", "h", frozenset({"p1", "p2"}), etag="t2")
    workers.answers[a.endpoint] = now
    clock.now += 2.0
    got = refresh(views, [a])["a"]
    assert offered[-1] is mine and isinstance(got, WorkerView) and got.etag == "t2"
    assert views.unchanged == 1

    # A pod at a new endpoint offers nothing: that view was read from somewhere else.
    moved = pod("a", endpoint="127.0.0.1:a2")
    workers.answers[moved.endpoint] = view("ea2")
    gather(views, [moved])
    assert offered[-1] is None


def test_a_large_topology_stretches_the_resync_age_to_stay_within_the_read_budget() -> None:
    workers, clock = Workers(), Clock()
    views = WorkerViews(workers.read, max_age_s=1.8, reads_per_s=250.0, clock=clock)
    assert views.refresh_age(80) == 1.8 and views.refresh_age(450) == 1.8
    assert views.refresh_age(1000) == 4.0 and views.refresh_age(2000) == 8.0
    assert WorkerViews(workers.read, max_age_s=1.8).refresh_age(2000) == 1.8  # no budget

    # Three workers and a budget of one read a second: each is re-read after 3 s, not 1.8.
    views = WorkerViews(workers.read, max_age_s=1.8, reads_per_s=1.0, clock=clock)
    pods = [pod(n) for n in "abc"]
    workers.answers = {p.endpoint: view(f"e{p.name}") for p in pods}

    async def scenario() -> None:
        await views.gather(pods, concurrency=4, timeout_s=1.0)
        for age, reads in ((2.0, 3), (2.999, 3), (3.0, 6)):
            clock.now = 100.0 + age
            await views.gather(pods, concurrency=4, timeout_s=1.0)
            await views.refreshed()
            assert len(workers.reads) == reads, age

    asyncio.run(scenario())


def test_background_re_reads_wait_while_workers_arrive_but_not_past_twice_their_age() -> None:
    """While new workers are being read (a rollout's surge), a stale view is re-read only
    once it is twice the refresh age: the re-reads, most of the operator's reads, yield the
    event loop to the arrivals, and drift is still seen within twice the age."""
    workers, clock = Workers(), Clock()
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock)
    old = [pod(n) for n in "abc"]
    workers.answers = {p.endpoint: view(f"e{p.name}") for p in old}

    async def scenario() -> None:
        await views.gather(old, concurrency=4, timeout_s=1.0)
        assert len(workers.reads) == 3

        # 3 s later (stale at 2 s) a new worker comes up: only it is read.
        clock.now = 103.0
        d = pod("d")
        workers.answers[d.endpoint] = view("ed")
        workers.reads.clear()
        await views.gather([*old, d], concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert workers.reads == [d.endpoint], "the stale views wait while workers arrive"

        # Still arriving 1 s later (e), the old views now 4 s old: twice the age, re-read.
        clock.now = 104.0
        e = pod("e")
        workers.answers[e.endpoint] = view("ee")
        workers.reads.clear()
        await views.gather([*old, d, e], concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert sorted(workers.reads) == sorted([e.endpoint, *(p.endpoint for p in old)])

        # Arrivals over (none within the resync age): every stale view is re-read.
        clock.now = 110.5
        workers.reads.clear()
        await views.gather([*old, d, e], concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert len(workers.reads) == 5, workers.reads

    asyncio.run(scenario())

    # Without arrivals the same stale views are re-read at their age.
    workers, clock = Workers(), Clock()
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock)
    workers.answers = {p.endpoint: view(f"e{p.name}") for p in old}

    async def quiet() -> None:
        await views.gather(old, concurrency=4, timeout_s=1.0)
        clock.now = 103.0
        workers.reads.clear()
        await views.gather(old, concurrency=4, timeout_s=1.0)
        await views.refreshed()
        assert len(workers.reads) == 3

    asyncio.run(quiet())


def test_a_change_found_by_a_re_read_pokes_the_loop_before_the_rest_of_the_batch_ends() -> None:
    """One slow worker in a batch of stale re-reads does not hold back the news of another
    worker's change: the loop is poked as soon as that answer is in."""
    release = asyncio.Event()
    pokes: list[int] = []

    class OneSlow(Workers):
        async def read(
            self,
            endpoint: str,
            timeout_s: float,
            known: WorkerView | None = None,
            pod_uid: str = "",
        ) -> WorkerView | WorkerUnreachable:
            self.reads.append(endpoint)
            if endpoint.endswith(":slow") and known is not None:
                await release.wait()
            return self.answers[endpoint]

    workers, clock = OneSlow(), Clock()
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock, on_change=lambda: pokes.append(1))
    fast, slow = pod("fast"), pod("slow")
    workers.answers = {fast.endpoint: view("ef"), slow.endpoint: view("es")}

    async def scenario() -> None:
        await views.gather([fast, slow], concurrency=4, timeout_s=1.0)
        clock.now += 2.0
        workers.answers[fast.endpoint] = view("ef", "p1")  # the fast one changed
        await views.gather([fast, slow], concurrency=4, timeout_s=1.0)
        for _ in range(100):  # the background task's steps, not time
            if pokes:
                break
            await asyncio.sleep(0)
        assert pokes == [1], "poked while the slow worker's re-read is still out"
        assert not release.is_set()
        release.set()
        await views.refreshed()
        assert pokes == [1]

    asyncio.run(scenario())


def test_a_new_worker_that_refused_its_first_read_is_read_again_shortly_and_pokes() -> None:
    """A pod can be Ready before its worker listens (a readiness probe on the engine's own
    port): its first read is refused. It is read again in the background within a fraction
    of a second, not a round or a resync later, and a view found pokes the loop; a worker
    that stays unreachable is left to the rounds after a few tries."""
    workers, clock = Workers(), Clock()
    pokes: list[float] = []
    poked = asyncio.Event()

    def poke() -> None:
        pokes.append(clock.now)
        poked.set()

    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock, on_change=poke)
    a, dead = pod("a"), pod("dead")
    refused = WorkerUnreachable("connection refused")
    workers.answers = {a.endpoint: refused, dead.endpoint: refused}

    async def scenario() -> None:
        got = await views.gather([a, dead], concurrency=4, timeout_s=1.0)
        assert got == {"a": refused, "dead": refused} and pokes == []
        workers.answers[a.endpoint] = view("ea")  # a's worker is listening now
        try:
            await asyncio.wait_for(poked.wait(), timeout=5.0)
        except TimeoutError:
            raise AssertionError("no background read of the refused new worker poked") from None
        assert views.view("a") == view("ea")
        # The round after the poke decides on it without reading it again.
        reads, dead_reads = workers.reads.count(a.endpoint), workers.reads.count(dead.endpoint)
        got = await views.gather([a, dead], concurrency=4, timeout_s=1.0)
        assert got["a"] == view("ea") and workers.reads.count(a.endpoint) == reads
        # While the dead worker's tries run, the round neither reads it nor waits for it.
        assert got["dead"] == refused and workers.reads.count(dead.endpoint) == dead_reads
        await views.refreshed()  # the dead worker's tries end
        assert 2 <= workers.reads.count(dead.endpoint) <= 8 and len(pokes) == 1

    asyncio.run(scenario())


class Hung(Workers):
    """Workers whose reads at `hung` endpoints wait until released (a SIGSTOPped process:
    the connection is accepted, nothing answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.hung: set[str] = set()
        self.release = asyncio.Event()
        self.out = 0  # reads waiting now

    async def read(
        self,
        endpoint: str,
        timeout_s: float,
        known: WorkerView | None = None,
        pod_uid: str = "",
    ) -> WorkerView | WorkerUnreachable:
        self.reads.append(endpoint)
        if endpoint in self.hung:
            self.out += 1
            try:
                await self.release.wait()
            finally:
                self.out -= 1
        return self.answers[endpoint]


def test_a_round_waits_for_a_hung_worker_only_its_wait_and_its_answer_pokes_later() -> None:
    """A round waits for its reads at most `wait_s`: a worker that does not answer is left
    out (not read yet) while the others are decided on; its read goes on, is never made
    twice while out, and what it brings is kept and pokes the loop. Once a worker was found
    unreachable, a round does not wait for it at all."""
    workers, clock = Hung(), Clock()
    pokes: list[int] = []
    views = WorkerViews(workers.read, max_age_s=2.0, clock=clock, on_change=lambda: pokes.append(1))
    a, h = pod("a"), pod("h")
    workers.answers = {a.endpoint: view("ea"), h.endpoint: view("eh")}
    workers.hung = {h.endpoint}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        got = await views.gather([a, h], concurrency=4, timeout_s=30.0, wait_s=0.05)
        assert loop.time() - began < 1.0  # its wait, not the read's deadline
        assert got == {"a": view("ea")} and workers.out == 1
        got = await views.gather([a, h], concurrency=4, timeout_s=30.0, wait_s=0.05)
        assert got == {"a": view("ea")} and workers.reads.count(h.endpoint) == 1, workers.reads
        assert pokes == []
        workers.release.set()
        for _ in range(100):  # the read's own steps, not time
            if pokes:
                break
            await asyncio.sleep(0)
        assert pokes == [1] and views.view("h") == view("eh")
        got = await views.gather([a, h], concurrency=4, timeout_s=30.0, wait_s=0.05)
        assert got == {"a": view("ea"), "h": view("eh")}

        # Found unreachable: read again in the background, never waited for.
        workers.release.clear()
        workers.answers[h.endpoint] = WorkerUnreachable("timed out")
        views.mark_dirty("h")
        workers.hung = set()
        await views.gather([a, h], concurrency=4, timeout_s=30.0, wait_s=0.05)
        assert views.view("h") == WorkerUnreachable("timed out")
        workers.hung = {h.endpoint}
        began = loop.time()
        got = await views.gather([a, h], concurrency=4, timeout_s=30.0, wait_s=5.0)
        assert loop.time() - began < 1.0, "waited for a worker known unreachable"
        assert got["h"] == WorkerUnreachable("timed out")
        for _ in range(100):  # its background read's own steps
            if workers.out:
                break
            await asyncio.sleep(0)
        assert workers.out == 1
        workers.release.set()
        await views.refreshed()

    asyncio.run(scenario())


def test_a_hung_new_worker_holds_back_the_others_reads_only_briefly() -> None:
    """The engines that came up together are read together; one of them hung (its first
    read never answers) must not hold the round, or the fast pass, for its whole `wait_s`:
    once the others have answered, the wait goes on only as long again as theirs took (at
    least `STRAGGLER_MIN_S`), then the round decides on what answered, and the hung read goes
    on in the background. Healthy reads queued behind the concurrency bound keep the wait
    going while they keep answering."""
    workers = Hung()
    views = WorkerViews(workers.read, max_age_s=60.0)
    healthy = [pod(f"a{i}") for i in range(40)]
    h = pod("h")
    workers.answers = {p.endpoint: view(f"e{p.name}") for p in [*healthy, h]}
    workers.hung = {h.endpoint}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        # wait_s far above anything the test allows: before the straggler rule, this
        # returned only after the full 30 s.
        got = await asyncio.wait_for(
            views.read_new([*healthy, h], concurrency=4, timeout_s=60.0, wait_s=30.0), 5.0
        )
        assert loop.time() - began < 5.0
        assert set(got) == {p.name for p in healthy}, sorted(got)
        assert workers.out == 1  # the hung read goes on
        more = [pod(f"b{i}") for i in range(8)]
        workers.answers.update({p.endpoint: view(f"e{p.name}") for p in more})
        got = await asyncio.wait_for(
            views.gather([*healthy, *more, h], concurrency=4, timeout_s=60.0, wait_s=30.0),
            5.0,
        )
        assert set(got) == {p.name for p in [*healthy, *more]}
        workers.release.set()
        await views.refreshed()

    asyncio.run(scenario())


def test_a_prefetched_first_read_is_waited_for_not_started_again() -> None:
    """`read_new` with no wait starts a new worker's first read and returns at once (the
    read pokes when it ends); a later `read_new` of that pod waits for the read already
    out rather than start another, and a round leaves it out until it ends."""
    answered = asyncio.Event()
    pokes: list[int] = []

    class Slow(Workers):
        async def read(
            self,
            endpoint: str,
            timeout_s: float,
            known: WorkerView | None = None,
            pod_uid: str = "",
        ) -> WorkerView | WorkerUnreachable:
            self.reads.append(endpoint)
            await answered.wait()
            return self.answers[endpoint]

    workers = Slow()
    views = WorkerViews(workers.read, max_age_s=2.0, on_change=lambda: pokes.append(1))
    a = pod("a")
    workers.answers = {a.endpoint: view("ea")}

    async def run() -> None:
        assert await views.read_new([a], concurrency=4, timeout_s=1.0, wait_s=0.0) == {}
        await asyncio.sleep(0.01)  # the read's task starts
        assert workers.reads == [a.endpoint] and not views.is_new(a) and views.arriving(a)
        assert await views.gather([a], concurrency=4, timeout_s=1.0, wait_s=0.1) == {}
        waiting = asyncio.ensure_future(
            views.read_new([a], concurrency=4, timeout_s=1.0, wait_s=5.0)
        )
        await asyncio.sleep(0.05)
        assert not waiting.done()  # it waits for the read that is out
        answered.set()
        assert await asyncio.wait_for(waiting, 5.0) == {"a": view("ea")}
        assert workers.reads == [a.endpoint]  # one read in all
        assert pokes == [1]  # the prefetched read ended after its (no) wait: it poked
        assert not views.arriving(a)

    asyncio.run(run())


def test_a_wait_cancelled_as_a_task_ends_ends_cancelled_at_every_step_of_the_loop() -> None:
    """A round stopped while it waits for its calls must stop, whichever of the event loop's
    steps the cancellation lands on relative to the call that ends. (On Python 3.11,
    `asyncio.wait_for` returned normally when the cancellation came in the step after its
    awaited future completed, and the stopped round went on.) Every offset from the call's end
    is tried; each cancellation that was accepted must end the wait cancelled."""

    async def cancel_after(steps: int) -> tuple[bool, bool]:
        call: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        other: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(wait_most([call, other], 30.0))
        for _ in range(3):  # the wait reaches its await
            await asyncio.sleep(0)
        assert not waiting.done()
        call.set_result(None)
        for _ in range(steps):
            await asyncio.sleep(0)
        accepted = waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        other.cancel()
        return accepted, waiting.cancelled()

    outcomes = [asyncio.run(cancel_after(steps)) for steps in range(8)]
    swallowed = [
        steps for steps, (accepted, cancelled) in enumerate(outcomes) if accepted and not cancelled
    ]
    assert swallowed == [], f"a cancellation {swallowed} steps after the call ended was lost"
    assert all(accepted for accepted, _ in outcomes), "the wait ended before it was stopped"
