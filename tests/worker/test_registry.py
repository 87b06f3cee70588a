"""The registry's rules: snapshots never change, eviction pops under the lock and tears down outside
it, transfers defer eviction, one handshake per engine, the idle backstop."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvtopo_worker.registry import AgentConflict, EngineRegistry
from tests.worker.conftest import add_engine
from tests.worker.fakes import FakeClock, FakeTransport


def test_snapshot_is_read_only_and_never_changes(
    transport: FakeTransport, registry: EngineRegistry
) -> None:
    add_engine(transport, registry, "e1")
    snap = registry.snapshot("e1")
    with pytest.raises(TypeError):
        snap[7] = "intruder"  # type: ignore[index]
    assert registry.snapshot("e1") == {0: "agent-e1"}
    assert registry.snapshot("unknown") == {}
    # The registry replaces an engine's agents, never edits them: a snapshot taken before a
    # rank joins or leaves (or the engine goes) still says what it said.
    registry.add_engine("e1", {1: "agent-e1-r1"})
    assert snap == {0: "agent-e1"} and registry.snapshot("e1") == {0: "agent-e1", 1: "agent-e1-r1"}
    during = registry.begin_transfer("e1")
    assert registry.evict("e1", rank=1) == "deferred"
    assert registry.begin_transfer("e1") == {0: "agent-e1"}
    registry.end_transfer("e1")
    registry.end_transfer("e1")
    assert during == {0: "agent-e1", 1: "agent-e1-r1"}
    assert registry.snapshot("e1") == {0: "agent-e1"}
    registry.evict("e1")
    assert snap == {0: "agent-e1"} and registry.snapshot("e1") == {}


def _eviction_waits_for_lock(registry: EngineRegistry, transport: FakeTransport) -> None:
    """Lock-serialisation regression, in the seeds' style (see reference.md)."""
    removed = threading.Event()
    transport.on_remove = lambda name: removed.set()
    add_engine(transport, registry, "e1")
    results: list[str] = []
    with registry.lock:
        t = threading.Thread(target=lambda: results.append(registry.evict("e1")))
        t.start()
        # While we hold the lock the eviction must not get anywhere.
        assert not removed.wait(timeout=0.2), "eviction ran while the registry lock was held"
        assert "e1" in registry
    assert removed.wait(timeout=5), "eviction never ran after the lock was released"
    t.join(5)
    assert results == ["evicted"]
    assert transport.removed == ["agent-e1"]  # exactly once
    assert "e1" not in registry


def test_eviction_is_serialised_by_the_registry_lock(
    registry: EngineRegistry, transport: FakeTransport
) -> None:
    """The assertions live in `_eviction_waits_for_lock`, shared with the test below that
    proves they fail against a registry whose eviction skips the lock."""
    _eviction_waits_for_lock(registry, transport)


class _LocklessEvictRegistry(EngineRegistry):
    """The bug the regression test exists for: eviction that ignores the lock."""

    def evict(self, engine_id: str, reason: str = "operator") -> str:  # type: ignore[override]
        eng = self._engines.pop(engine_id, None)  # no lock
        if eng is None:
            return "absent"
        self._teardown(engine_id, eng.agents)
        return "evicted"


def test_the_eviction_regression_test_catches_a_lockless_evict(clock: FakeClock) -> None:
    transport = FakeTransport()
    broken = _LocklessEvictRegistry(remove_agent=transport.remove_remote, clock=clock)
    with pytest.raises(AssertionError, match="eviction ran while the registry lock was held"):
        _eviction_waits_for_lock(broken, transport)


def test_teardown_runs_outside_the_lock(registry: EngineRegistry, transport: FakeTransport) -> None:
    add_engine(transport, registry, "e1")
    held: list[bool] = []

    def probe(name: str) -> None:
        # Another thread must be able to take the lock while NIXL teardown runs.
        got = threading.Event()
        threading.Thread(
            target=lambda: (registry.lock.acquire(), got.set(), registry.lock.release())
        ).start()
        held.append(got.wait(2))

    transport.on_remove = probe
    assert registry.evict("e1") == "evicted"
    assert held == [True]


def test_transfer_in_flight_defers_eviction(
    registry: EngineRegistry, transport: FakeTransport
) -> None:
    add_engine(transport, registry, "e1")
    assert registry.begin_transfer("e1") == {0: "agent-e1"}
    assert registry.begin_transfer("e1") is not None
    assert registry.evict("e1") == "deferred"
    assert transport.removed == []
    assert registry.begin_transfer("e1") is None, "no new transfer to an engine being evicted"
    assert registry.snapshot("e1") == {0: "agent-e1"}
    registry.end_transfer("e1")
    assert transport.removed == []
    registry.end_transfer("e1")
    assert transport.removed == ["agent-e1"]
    assert "e1" not in registry
    assert registry.evict("e1") == "absent"


def test_readd_cancels_a_deferred_eviction(
    registry: EngineRegistry, transport: FakeTransport
) -> None:
    add_engine(transport, registry, "e1")
    registry.begin_transfer("e1")
    assert registry.evict("e1") == "deferred"
    assert registry.add_engine("e1", {0: "agent-e1"}) is False
    registry.end_transfer("e1")
    assert "e1" in registry and transport.removed == []


def test_at_most_one_handshake_per_engine(registry: EngineRegistry) -> None:
    started: list[Future[dict[int, str]]] = []

    def start() -> Future[dict[int, str]]:
        f: Future[dict[int, str]] = Future()
        started.append(f)
        return f

    f1 = registry.handshake("e1", start)
    f2 = registry.handshake("e1", start)
    f3 = registry.handshake("e2", start)
    assert f1 is f2 and f1 is not f3
    assert len(started) == 2 and registry.handshakes_in_flight() == 2
    f1.set_result({0: "a"})
    assert registry.handshakes_in_flight() == 1
    f4 = registry.handshake("e1", start)
    assert f4 is not f1 and len(started) == 3


def test_idle_ttl_backstop(transport: FakeTransport, clock: FakeClock) -> None:
    reg = EngineRegistry(remove_agent=transport.remove_remote, clock=clock, idle_ttl_s=60)
    add_engine(transport, reg, "idle")
    add_engine(transport, reg, "busy")
    add_engine(transport, reg, "used")
    reg.begin_transfer("busy")
    clock.advance(59)
    reg.touch("used")
    assert reg.evict_idle() == []
    clock.advance(2)
    assert reg.evict_idle() == ["idle"]
    assert reg.engine_ids() == ["busy", "used"]


def test_idle_ttl_zero_is_off(transport: FakeTransport, clock: FakeClock) -> None:
    reg = EngineRegistry(remove_agent=transport.remove_remote, clock=clock, idle_ttl_s=0)
    add_engine(transport, reg, "e1")
    clock.advance(1e9)
    assert reg.evict_idle() == [] and "e1" in reg
    with pytest.raises(ValueError):
        EngineRegistry(remove_agent=transport.remove_remote, idle_ttl_s=-1)


def test_concurrent_evictions_tear_down_once(
    registry: EngineRegistry, transport: FakeTransport
) -> None:
    for _ in range(200):
        add_engine(transport, registry, "e1")
        transport.removed.clear()
        barrier = threading.Barrier(4)
        results: list[str] = []

        def evict(barrier: threading.Barrier = barrier, results: list[str] = results) -> None:
            barrier.wait()
            results.append(registry.evict("e1"))

        threads = [threading.Thread(target=evict) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["absent", "absent", "absent", "evicted"]
        assert transport.removed == ["agent-e1"]


def test_failed_teardown_is_counted_not_raised(registry: EngineRegistry) -> None:
    def boom(name: str) -> None:
        raise RuntimeError("nixl said no")

    reg = EngineRegistry(remove_agent=boom)
    reg.add_engine("e1", {0: "a", 1: "b"})
    assert reg.evict("e1") == "evicted"
    assert reg.teardown_errors == 2 and "e1" not in reg


def test_a_rank_evicts_alone_deferred_while_a_transfer_is_in_flight() -> None:
    removed: list[str] = []
    reg = EngineRegistry(remove_agent=removed.append)
    reg.add_engine("e", {0: "e-r0", 1: "e-r1"})
    assert reg.begin_transfer("e") == {0: "e-r0", 1: "e-r1"}
    assert reg.evict("e", rank=1) == "deferred"
    assert reg.begin_transfer("e") == {0: "e-r0"}  # no new WRITE to the rank on its way out
    reg.end_transfer("e")
    assert removed == []
    reg.end_transfer("e")  # the last transfer ends: rank 1 goes, rank 0 stays
    assert removed == ["e-r1"] and reg.snapshot("e") == {0: "e-r0"}
    assert reg.evict("e", rank=1) == "absent"
    assert reg.evict("e", rank=0) == "evicted"  # its last rank: the engine goes
    assert "e" not in reg and removed == ["e-r1", "e-r0"]


def test_an_agent_belongs_to_one_engine_until_its_teardown_ends() -> None:
    reg = EngineRegistry(remove_agent=lambda name: None)
    reg.add_engine("e1", {0: "shared"})
    with pytest.raises(AgentConflict):
        reg.add_engine("e2", {0: "shared"})
    assert reg.owner_of("shared") == ("e1", 0)
    reg.evict("e1")
    assert reg.owner_of("shared") == ("e1", 0)  # still attributed (late completions)
    assert reg.agent_owner("shared") is None
    reg.add_engine("e2", {0: "shared"})  # torn down: free to be another engine's
    assert reg.owner_of("shared") == ("e2", 0)


def test_a_handshake_waits_for_the_teardown_of_an_agent_it_would_load_again() -> None:
    """An agent popped by an eviction is reserved until its teardown has removed it from
    NIXL: `wait_released` blocks until then (the Event is made only when someone waits),
    times out while the teardown hangs, and returns at once for an agent not being torn
    down."""
    in_teardown = threading.Event()
    finish = threading.Event()

    def remove(name: str) -> None:
        in_teardown.set()
        finish.wait(10)

    registry = EngineRegistry(remove_agent=remove)
    registry.add_engine("e1", {0: "a0", 1: "a1"})
    assert registry.wait_released("a0", 0.01)  # not popped: nothing to wait for
    evicting = threading.Thread(target=registry.evict, args=("e1",))
    evicting.start()
    assert in_teardown.wait(5)
    assert not registry.wait_released("a1", 0.05)  # still being torn down
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(registry.wait_released("a1", 10)))
    waiter.start()
    finish.set()
    evicting.join(10)
    waiter.join(10)
    assert waited == [True]
    assert registry.wait_released("a0", 0.01) and registry.wait_released("a1", 0.01)
    registry.add_engine("e1", {0: "a0", 1: "a1"})  # loadable again
    assert registry.snapshot("e1") == {0: "a0", 1: "a1"}
