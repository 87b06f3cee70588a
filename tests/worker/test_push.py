"""The push path's contracts: the X1 lock regression, the failure-queue contract, exactly-once
outcomes, deadlines, and the X1 stress test. Threads are real; time is a fake clock."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvtopo_worker.protocol import (
    FailureType,
    PushCancel,
    PushDone,
    PushFail,
    PushRegistration,
    decode_notification,
    encode_notification,
)
from kvtopo_worker.push import PushConfig, PushConnector
from kvtopo_worker.registry import EngineRegistry
from tests.worker.conftest import DECODE, PREFILL, add_engine, make_connector
from tests.worker.fakes import FakeClock, FakeTransport

FAR = 1e12  # a registration valid for ever (wall clock)


def _done(rid: str) -> bytes:
    return encode_notification(PushDone(request_id=rid, prefill_engine_id=PREFILL, num_blocks=2))


def _register(
    transport: FakeTransport, agent: str, rid: str, blocks: list[int], decode: str = DECODE
) -> None:
    reg = PushRegistration(
        request_id=rid,
        decode_engine_id=decode,
        prefill_engine_id=PREFILL,
        block_ids=blocks,
        expires_at=FAR,
        write_timeout_s=30.0,
    )
    transport.deliver(agent, encode_notification(reg))


def _send_waits_for_lock(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """X1 regression in the seeds' style: the registration send needs the registry lock."""
    add_engine(transport, registry, PREFILL)
    sent = threading.Event()
    transport.on_send = lambda agent, payload: sent.set()
    decode.start()
    with registry.lock:
        decode.request_receive("r1", PREFILL, [3, 4])
        assert not sent.wait(timeout=0.2), "registration sent while the registry lock was held"
        assert decode.failed_requests.empty(), "nothing may be failed while the lock is held"
    assert sent.wait(timeout=5), "registration never sent after the lock was released"
    decode.stop()  # cancels the registration, which no prefill answered
    regs = [sent for sent in transport.sent if sent[1].startswith(b"PUSH_REG:")]
    assert len(regs) == 1  # exactly once
    agent, payload = regs[0]
    reg = decode_notification(payload)
    assert agent == f"agent-{PREFILL}"
    assert isinstance(reg, PushRegistration) and reg.block_ids == [3, 4]
    # Only stop() ended it (nothing failed it before): once, as a shutdown.
    assert [(f.request_id, f.reason) for f in decode.get_finished().failed] == [
        ("r1", FailureType.SHUTDOWN)
    ]


def test_registration_send_is_serialised_by_the_registry_lock(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """The assertions live in `_send_waits_for_lock`, shared with the test below that
    proves they fail against a registry whose snapshot skips the lock."""
    _send_waits_for_lock(decode, registry, transport)


class _LocklessSnapshotRegistry(EngineRegistry):
    """The X1 bug: the writer reads the agent map without the lock."""

    def snapshot(self, engine_id: str) -> dict[int, str]:
        eng = self._engines.get(engine_id)
        return dict(eng.agents) if eng is not None else {}

    def use(self, engine_id: str, rank: int) -> str | None:
        eng = self._engines.get(engine_id)
        return eng.agents.get(rank) if eng is not None else None


def test_the_send_regression_test_catches_a_lockless_snapshot(clock: FakeClock) -> None:
    transport = FakeTransport()
    broken = _LocklessSnapshotRegistry(remove_agent=transport.remove_remote, clock=clock)
    conn = make_connector("decode", transport, broken, clock)
    try:
        with pytest.raises(AssertionError, match="registration sent while the registry lock"):
            _send_waits_for_lock(conn, broken, transport)
    finally:
        conn.stop()


def test_no_agents_goes_to_the_failed_queue_once_and_sends_nothing(
    decode: PushConnector, transport: FakeTransport
) -> None:
    """The failure-queue contract (second source PR)."""
    writer_thread = threading.current_thread()
    decode.request_receive("r1", PREFILL, [1])
    reg = PushRegistration(
        request_id="r1",
        decode_engine_id=DECODE,
        prefill_engine_id=PREFILL,
        block_ids=[1],
        expires_at=FAR,
        write_timeout_s=30.0,
    )
    decode.send_registration(reg)  # what the writer thread runs
    failed = decode.failed_requests.get_nowait()
    assert decode.failed_requests.empty()
    assert failed.request_id == "r1" and failed.reason is FailureType.PUSH_REG_NOTIF_FAILED
    assert "No remote agents for engine" in failed.message
    assert transport.sent == []
    # The writer only enqueued: the request has not ended until the engine thread drains.
    assert decode.requests_failed == 0 and decode.in_flight() == 0
    assert threading.current_thread() is writer_thread
    decode.failed_requests.put(failed)  # hand it back for the engine thread to drain
    fin = decode.get_finished()
    assert [f.request_id for f in fin.failed] == ["r1"]
    assert decode.requests_failed == 1
    assert decode.get_finished().failed == []


def test_writer_thread_fails_through_the_queue(
    decode: PushConnector, transport: FakeTransport
) -> None:
    decode.start()
    decode.request_receive("r1", PREFILL, [1])
    failed = decode.failed_requests.get(timeout=5)
    assert failed.request_id == "r1" and transport.sent == []


def test_send_to_an_agent_evicted_after_the_snapshot_fails_cleanly(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """The residual window of the X1 fix: a snapshot naming an agent evicted a moment later."""
    add_engine(transport, registry, PREFILL)
    snapshot = registry.snapshot

    def snapshot_then_evict(eid: str) -> dict[int, str]:
        snap = snapshot(eid)
        registry.evict(eid)
        return snap

    registry.snapshot = snapshot_then_evict  # type: ignore[method-assign]
    decode.request_receive("r1", PREFILL, [1])
    decode.send_registration(
        PushRegistration(
            request_id="r1",
            decode_engine_id=DECODE,
            prefill_engine_id=PREFILL,
            block_ids=[1],
            expires_at=FAR,
            write_timeout_s=30.0,
        )
    )
    fin = decode.get_finished()
    assert [(f.request_id, f.reason) for f in fin.failed] == [
        ("r1", FailureType.PUSH_REG_NOTIF_FAILED)
    ]
    assert decode.metrics.failure_counts() == {"push_reg_notif_failed": 1}


def test_completion_after_timeout_is_dropped_exactly_once(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    add_engine(transport, registry, PREFILL)
    decode.request_receive("r2", PREFILL, [3, 4])
    assert decode.flush_registrations() == 1
    decode.request_receive("r1", PREFILL, [1, 2])  # its registration never leaves
    transport.deliver(f"agent-{PREFILL}", _done("r2"))
    decode.progress_once()
    clock.advance(5.01)
    decode.progress_once()  # r1 times out, never sent: it ends at once
    transport.deliver(f"agent-{PREFILL}", _done("r1"))  # too late (and never asked for)
    decode.progress_once()
    fin = decode.get_finished()
    assert fin.done_receiving == ["r2"]
    assert [(f.request_id, f.reason) for f in fin.failed] == [
        ("r1", FailureType.REGISTRATION_TIMEOUT)
    ]
    assert decode.get_finished() == type(fin)()
    assert decode.metrics.duplicate_outcomes_total._value.get() == 0


def test_prefill_matches_registration_and_writes(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    reg = PushRegistration(
        request_id="r1",
        decode_engine_id=DECODE,
        prefill_engine_id=PREFILL,
        block_ids=[7, 8],
        expires_at=FAR,
        write_timeout_s=30.0,
    )
    transport.deliver(agent, encode_notification(reg))  # registration first
    prefill.progress_once()
    assert transport.writes == []
    prefill.request_send("r1", [0, 1])
    prefill.progress_once()
    assert len(transport.writes) == 1
    w_agent, local, remote, notif = transport.writes[0]
    assert (w_agent, local, remote) == (agent, [0, 1], [7, 8])
    assert decode_notification(notif) == PushDone(
        request_id="r1", prefill_engine_id=PREFILL, num_blocks=2
    )
    prefill.progress_once()
    assert prefill.get_finished().done_sending == ["r1"]
    assert registry.peer_states()[0].transfers_in_flight == 0


def test_a_write_that_finishes_inside_its_post_ends_at_once_and_exactly_once(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.post_state = "DONE"
    transport.write_state = "ERR"  # a poll would fail it: there must be none
    for i in range(3):
        prefill.request_send(f"r{i}", [i])
        _register(transport, agent, f"r{i}", [10 + i])
    prefill.progress_once()
    assert len(transport.released) == len(transport.writes) == 1  # one WRITE carried all three
    prefill.progress_once()
    fin = prefill.get_finished()
    assert sorted(fin.done_sending) == ["r0", "r1", "r2"] and fin.failed == []
    assert prefill.get_finished().done_sending == []
    assert registry.peer_states()[0].transfers_in_flight == 0
    assert prefill.metrics.transfer_bytes_total._value.get() == 3 * transport.block_len
    assert prefill.in_flight() == 0


def test_requests_matched_together_share_a_write_per_decode_rank_within_bounds(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock
) -> None:
    prefill = make_connector("prefill", transport, registry, clock, max_requests_per_write=3)
    transport.write_state = "PROC"
    a = add_engine(transport, registry, DECODE)
    b = add_engine(transport, registry, "decode-b")
    for i in range(5):
        prefill.request_send(f"a{i}", [i])
        _register(transport, a, f"a{i}", [20 + i])
    prefill.request_send("b0", [9])
    _register(transport, b, "b0", [30], decode="decode-b")
    prefill.progress_once()
    writes = [(w[0], w[1], w[2], decode_notification(w[3])) for w in transport.writes]
    assert [(agent, local, remote) for agent, local, remote, _ in writes] == [
        (a, [0, 1, 2], [20, 21, 22]),
        (a, [3, 4], [23, 24]),
        (b, [9], [30]),
    ]
    assert [d.request_ids for *_, d in writes] == [["a0", "a1", "a2"], ["a3", "a4"], ["b0"]]  # type: ignore[union-attr]
    assert [d.num_blocks for *_, d in writes] == [3, 2, 1]  # type: ignore[union-attr]
    # In flight: each request counts, a registration repeated for one of them is a duplicate.
    assert prefill.in_flight() == 6
    _register(transport, a, "a1", [21])
    prefill.progress_once()
    assert len(transport.writes) == 3
    assert prefill.metrics.rejected_total.labels("notification")._value.get() == 1
    # A failed WRITE fails each of its requests once and tells decode about each.
    transport.write_state = "ERR"
    prefill.progress_once()
    fin = prefill.get_finished()
    assert sorted(f.request_id for f in fin.failed) == ["a0", "a1", "a2", "a3", "a4", "b0"]
    told = sorted(decode_notification(p).request_id for _, p in transport.sent)
    assert told == ["a0", "a1", "a2", "a3", "a4", "b0"]
    assert len(transport.released) == 3 and prefill.in_flight() == 0
    assert all(s.transfers_in_flight == 0 for s in registry.peer_states())
    prefill.stop()


def test_decode_ends_every_request_a_completion_names_once(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, PREFILL)
    for rid in ("r1", "r2"):
        decode.request_receive(rid, PREFILL, [1])
    assert decode.flush_registrations() == 2
    done = PushDone(
        request_id="r1", more_request_ids=["r2", "unknown"], prefill_engine_id=PREFILL, num_blocks=2
    )
    transport.deliver(agent, encode_notification(done))
    transport.deliver(agent, encode_notification(done))  # again: nothing ends twice
    decode.progress_once()
    assert sorted(decode.get_finished().done_receiving) == ["r1", "r2"]
    assert decode.metrics.rejected_total.labels("notification")._value.get() == 2
    assert decode.metrics.duplicate_outcomes_total._value.get() == 0


def test_prefill_transfer_error_fails_once_and_tells_decode(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "ERR"
    prefill.request_send("r1", [0])
    _register(transport, agent, "r1", [5])
    prefill.progress_once()
    prefill.progress_once()
    fin = prefill.get_finished()
    assert [(f.request_id, f.reason) for f in fin.failed] == [("r1", FailureType.TRANSFER_FAILED)]
    told = [decode_notification(p) for a, p in transport.sent]
    assert told == [
        PushFail(
            request_id="r1",
            prefill_engine_id=PREFILL,
            reason=FailureType.TRANSFER_FAILED,
            message="WRITE failed",
        )
    ]
    assert len(transport.released) == 1


def test_eviction_waits_for_the_prefill_write(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "PROC"
    prefill.request_send("r1", [0])
    _register(transport, agent, "r1", [5])
    prefill.progress_once()
    assert registry.evict(DECODE) == "deferred"
    assert transport.removed == []
    transport.write_state = "DONE"
    prefill.progress_once()
    assert transport.removed == [agent]
    assert prefill.get_finished().done_sending == ["r1"]


def test_kv_lease_expires_unmatched_sends(prefill: PushConnector, clock: FakeClock) -> None:
    prefill.request_send("r1", [0])
    clock.advance(5.01)
    prefill.progress_once()
    fin = prefill.get_finished()
    assert [(f.request_id, f.reason) for f in fin.failed] == [("r1", FailureType.KV_EXPIRED)]


@pytest.mark.parametrize(
    "garbage",
    [b"", b"PUSH_REG:", b"PUSH_REG:\xff\xff", b"HELLO", b"PUSH_DONE:\x91\x01", b"\x00" * 64],
)
def test_malformed_notifications_are_counted_and_dropped(
    decode: PushConnector, transport: FakeTransport, garbage: bytes
) -> None:
    transport.deliver("someone", garbage)
    decode.progress_once()
    assert decode.metrics.failure_counts() == {"malformed_message": 1}
    assert decode.get_finished() == type(decode.get_finished())()


def test_x1_stress_eviction_churn_never_fails_a_present_engine(
    registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    """>= 10,000 registrations while another thread evicts and re-adds the prefill engine.

    `epoch` is bumped before each eviction starts and after each re-add completes, so an
    even epoch unchanged across a send means the engine was present for the whole send:
    such a request must never fail. Every request must end exactly once.
    """
    decode = make_connector("decode", transport, registry, clock, registration_timeout_s=5.0)
    add_engine(transport, registry, PREFILL)
    epoch = [0]
    stop = threading.Event()
    # The churn is paced by the writer (one evict/re-add cycle per send, running while the
    # next send happens) and the GIL is handed over often, so the two really interleave and
    # neither starves the other on a loaded machine.
    sends_done = threading.Semaphore(0)
    cycles = [0]

    def churn() -> None:
        while not stop.is_set():
            if not sends_done.acquire(timeout=1):
                continue
            cycles[0] += 1
            epoch[0] += 1  # about to go
            registry.evict(PREFILL)
            add_engine(transport, registry, PREFILL)
            epoch[0] += 1  # back

    # A send is NIXL's slow path and releases the GIL: every other send yields inside it,
    # so some sends are overlapped by the churn and others run clean, on any machine load.
    def slow_send(agent: str, payload: bytes) -> None:
        if int(decode_notification(payload).request_id[1:]) % 2:
            time.sleep(0)

    transport.on_send = slow_send
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    churner = threading.Thread(target=churn)
    churner.start()
    n = 10_000
    ids = [f"r{i}" for i in range(n)]
    present_whole_send: set[str] = set()
    try:
        for rid in ids:
            decode.request_receive(rid, PREFILL, [1])
            reg = PushRegistration(
                request_id=rid,
                decode_engine_id=DECODE,
                prefill_engine_id=PREFILL,
                block_ids=[1],
                expires_at=FAR,
                write_timeout_s=30.0,
            )
            before = epoch[0]
            decode.send_registration(reg)
            if before % 2 == 0 and epoch[0] == before:
                present_whole_send.add(rid)
            sends_done.release()
    finally:
        stop.set()
        churner.join()
        sys.setswitchinterval(switch_interval)
    first = decode.get_finished()  # the engine thread drains the failures
    failed = [f.request_id for f in first.failed]
    sent_ids = {decode_notification(p).request_id for _, p in transport.sent}
    assert not (set(failed) & present_whole_send), (
        "a request failed although its engine was present"
    )
    assert len(failed) == len(set(failed)), "a request was failed twice"
    assert sent_ids.isdisjoint(failed) and sent_ids | set(failed) == set(ids)
    assert len(present_whole_send) >= 100, "the churn left too few clean sends to judge"
    assert len(present_whole_send) < n, (
        "no eviction ever overlapped a send: the test proved nothing"
    )
    assert cycles[0] >= n // 2, f"only {cycles[0]} evict/re-add cycles ran"
    print(
        f"x1 stress: {cycles[0]} churn cycles, {len(present_whole_send)} clean sends, "
        f"{len(failed)} failed during churn"
    )
    # Complete the sent ones; every request then has ended exactly once.
    for rid in sent_ids:
        transport.deliver(f"agent-{PREFILL}", _done(rid))
    decode.progress_once()
    while decode.queued_notifications():  # a sender's notifications, a budget per pass
        decode.progress_once()
    second = decode.get_finished()
    ended = failed + second.done_receiving + [f.request_id for f in second.failed]
    assert sorted(ended) == sorted(ids)
    assert decode.metrics.duplicate_outcomes_total._value.get() == 0
    assert decode.in_flight() == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"max_requests_per_write": 65},  # a completion names at most 64 requests
        {"max_requests_per_write": 0},
        {"max_bytes_per_write": 0},
        {"registration_timeout_s": 0},
        {"kv_lease_s": -1},
        {"transfer_timeout_s": float("inf")},
    ],
)
def test_a_configuration_the_protocol_cannot_carry_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        PushConfig(**bad)  # type: ignore[arg-type]


def test_arriving_registrations_count_as_use_for_the_idle_backstop(
    transport: FakeTransport, clock: FakeClock
) -> None:
    # A decode engine that only sends registrations (the prefill has not written to it yet)
    # is in use: the idle-TTL backstop must not evict it while its registrations arrive.
    registry = EngineRegistry(remove_agent=transport.remove_remote, clock=clock, idle_ttl_s=60)
    prefill = make_connector("prefill", transport, registry, clock, kv_lease_s=600.0)
    try:
        agent = add_engine(transport, registry, DECODE)
        for i in range(3):
            clock.advance(50)
            _register(transport, agent, f"r{i}", [i])
            prefill.progress_once()
            assert registry.evict_idle() == [], f"evicted after registration r{i}"
        assert DECODE in registry
        clock.advance(61)  # nothing arrives any more: now it is idle
        assert registry.evict_idle() == [DECODE]
    finally:
        prefill.stop()


def test_an_idle_ttl_set_at_runtime_is_applied_by_the_running_progress_loop(
    transport: FakeTransport, clock: FakeClock
) -> None:
    # The operator sets the TTL while the engine runs (PUT /v1/settings assigns
    # registry.idle_ttl_s): the progress loop's backstop check reads it on every pass, so
    # turning it on, from off, evicts an idle peer without a restart.
    registry = EngineRegistry(remove_agent=transport.remove_remote, clock=clock)
    decode = make_connector("decode", transport, registry, clock)
    add_engine(transport, registry, PREFILL)
    decode.start()
    try:
        clock.advance(120)
        time.sleep(0.3)  # several passes with the backstop off
        assert PREFILL in registry
        registry.idle_ttl_s = 60
        clock.advance(1)  # the loop checks the TTL once per (its clock's) second
        deadline = time.monotonic() + 5
        while PREFILL in registry and time.monotonic() < deadline:
            time.sleep(0.02)
        assert PREFILL not in registry
        assert transport.removed == [f"agent-{PREFILL}"]
    finally:
        decode.stop()


def _deliver_waits_for_lock(
    conn: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """The registration writer's own path (`deliver_registration`, the registry benchmark's):
    it reads its peer's agent under the registry lock too."""
    add_engine(transport, registry, PREFILL)
    sent = threading.Event()
    transport.on_send = lambda agent, payload: sent.set()
    reg = PushRegistration(
        request_id="w1",
        decode_engine_id=DECODE,
        prefill_engine_id=PREFILL,
        block_ids=[1],
        expires_at=FAR,
        write_timeout_s=30.0,
    )
    writer = threading.Thread(target=conn.deliver_registration, args=(reg,))  # type: ignore[attr-defined]
    with registry.lock:
        writer.start()
        assert not sent.wait(timeout=0.2), "registration sent while the registry lock was held"
    writer.join(5)
    assert sent.is_set(), "registration never sent after the lock was released"


def test_the_writer_reads_its_peer_under_the_registry_lock(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """The assertions live in `_deliver_waits_for_lock` (a delivery waits while the registry
    lock is held, and is sent once it is released), shared with the next test, which proves
    they fail against a registry whose writer path skips the lock."""
    _deliver_waits_for_lock(decode, registry, transport)


def test_the_writer_lock_test_catches_a_lockless_read(clock: FakeClock) -> None:
    transport = FakeTransport()
    broken = _LocklessSnapshotRegistry(remove_agent=transport.remove_remote, clock=clock)
    conn = make_connector("decode", transport, broken, clock)
    try:
        with pytest.raises(AssertionError, match="registration sent while the registry lock"):
            _deliver_waits_for_lock(conn, broken, transport)
    finally:
        conn.stop()


@pytest.mark.parametrize("ending", ["evicted", "timed-out"])
def test_registrations_parked_for_a_prefill_that_never_greets_are_freed(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock, ending: str
) -> None:
    """Issue 55, defect 8: registrations wait (parked) for the prefill agent's greeting; a
    prefill that never greets left them held for ever (20,000 after all had ended and the
    prefill was evicted). They leave with the prefill's agents, or with their requests."""
    decode = make_connector(
        "decode", transport, registry, clock, registration_timeout_s=5.0, greet_peers=True
    )
    try:
        add_engine(transport, registry, PREFILL)
        for i in range(100):
            decode.request_receive(f"r{i}", PREFILL, [i % 8])
        decode.flush_registrations()  # type: ignore[attr-defined]  # what the writer runs
        assert decode.parked() == 100  # type: ignore[attr-defined]
        assert all(msg.startswith(b"PUSH_HELLO") for _, msg in transport.sent), transport.sent
        if ending == "evicted":
            registry.evict(PREFILL, "operator")
        else:
            clock.advance(6.0)
            decode.progress_once()
            assert len(decode.get_finished().failed) == 100
            clock.advance(1.0)
            decode.progress_once()
        assert decode.parked() == 0  # type: ignore[attr-defined]
    finally:
        decode.stop()


def test_a_stopped_kv_both_connector_takes_no_request(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock
) -> None:
    """Issue 55, defect 8: after stop(), a kv_both connector still took requests on either
    half, and they never ended. Now both halves refuse, as a prefill's or a decode's does."""
    both = make_connector("both", transport, registry, clock, registration_timeout_s=5.0)
    add_engine(transport, registry, PREFILL)
    both.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        both.request_send("s1", [1])
    with pytest.raises(RuntimeError, match="stopped"):
        both.request_receive("r1", PREFILL, [2])
    assert both.in_flight() == 0


def _cancel(rid: str, decode: str) -> bytes:
    return encode_notification(
        PushCancel(request_id=rid, decode_engine_id=decode, prefill_engine_id=PREFILL)
    )


def test_a_flooding_decode_waits_its_turn_behind_another_decode_s_registration(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """Issue 55, defect 3: a paired decode's burst of valid cancels is handled a budget per
    pass; another decode's registration, queued behind 10,000 of them, is written in the
    first pass, before the flooder's hundredth cancel is answered."""
    flooder = add_engine(transport, registry, "decode-flooder")
    honest = add_engine(transport, registry, DECODE)
    for i in range(10_000):
        transport.deliver(flooder, _cancel(f"nothing-{i}", "decode-flooder"))
    prefill.request_send("r1", [0, 1])
    _register(transport, honest, "r1", [7, 8])
    answered_before_write: list[int] = []
    original = transport.write_blocks

    def write_blocks(*args: object, **kwargs: object) -> object:
        answered_before_write.append(sum(1 for a, _ in transport.sent if a == flooder))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    transport.write_blocks = write_blocks  # type: ignore[method-assign]
    prefill.progress_once()
    assert answered_before_write, "the other decode's registration waited for the flood"
    assert answered_before_write[0] < 100, answered_before_write
    assert prefill.queued_notifications() > 9_000  # the flood waits in its own queue
    while prefill.queued_notifications():
        prefill.progress_once()
    answers = sum(1 for a, _ in transport.sent if a == flooder)
    # Cancels that found nothing get rate-limited answers (the decode's deadline ends them).
    assert answers <= 300, answers
    assert prefill.metrics.rejected_total.labels("unanswered_courtesy")._value.get() > 9_000


def test_a_sender_s_backlog_is_bounded_and_the_rest_counted(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    from kvtopo_worker.push.core import MAX_QUEUED_PER_SENDER

    flooder = add_engine(transport, registry, "decode-flooder")
    for i in range(MAX_QUEUED_PER_SENDER + 500):
        transport.deliver(flooder, _cancel(f"nothing-{i}", "decode-flooder"))
    prefill.progress_once()
    assert prefill.queued_notifications() <= MAX_QUEUED_PER_SENDER
    assert prefill.metrics.rejected_total.labels("notification_backlog")._value.get() >= 500
