"""One outcome per request, agreed by both sides, whatever peers do and whatever raises:
the cancel protocol (a decode gives a request up only when no WRITE can land), a
registration's validity, notifications tied to their sender, exceptions inside a progress
pass, and stop(). Real PushConnector and EngineRegistry; fake transport and clock."""

from __future__ import annotations

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
from kvtopo_worker.push import PushConnector
from kvtopo_worker.registry import EngineRegistry
from tests.worker.conftest import DECODE, PREFILL, add_engine, make_connector
from tests.worker.fakes import FakeClock, FakeTransport

FAR = 1e12


def _reg(rid: str, blocks: list[int], expires_at: float = FAR, decode: str = DECODE) -> bytes:
    return encode_notification(
        PushRegistration(
            request_id=rid,
            decode_engine_id=decode,
            prefill_engine_id=PREFILL,
            block_ids=blocks,
            expires_at=expires_at,
            write_timeout_s=30.0,
        )
    )


def _cancel(rid: str, decode: str = DECODE) -> bytes:
    return encode_notification(
        PushCancel(request_id=rid, decode_engine_id=decode, prefill_engine_id=PREFILL)
    )


def _sent(transport: FakeTransport, kind: type) -> list[object]:
    msgs = [decode_notification(p) for _, p in transport.sent]
    return [m for m in msgs if isinstance(m, kind)]


def _failed(conn: PushConnector) -> list[tuple[str, FailureType]]:
    return [(f.request_id, f.reason) for f in conn.get_finished().failed]


# --- decode: giving a request up ---------------------------------------------------------


def _timed_out_decode(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> str:
    agent = add_engine(transport, registry, PREFILL)
    decode.request_receive("r1", PREFILL, [1, 2])
    assert decode.flush_registrations() == 1
    clock.advance(5.01)  # past the registration timeout
    decode.progress_once()
    return agent


def test_a_decode_that_gives_up_cancels_and_waits_for_the_answer(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    agent = _timed_out_decode(decode, registry, transport, clock)
    assert [c.request_id for c in _sent(transport, PushCancel)] == ["r1"]  # type: ignore[attr-defined]
    # Not ended yet: a WRITE of r1 may still land.
    assert decode.get_finished().failed == [] and decode.in_flight() == 1
    fail = PushFail(request_id="r1", prefill_engine_id=PREFILL, reason=FailureType.REMOTE_REJECTED)
    transport.deliver(agent, encode_notification(fail))
    decode.progress_once()
    assert _failed(decode) == [("r1", FailureType.REGISTRATION_TIMEOUT)]


def test_a_completion_answering_the_cancel_ends_the_request_done(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    agent = _timed_out_decode(decode, registry, transport, clock)
    done = PushDone(request_id="r1", prefill_engine_id=PREFILL, num_blocks=2)
    transport.deliver(agent, encode_notification(done))
    decode.progress_once()
    fin = decode.get_finished()
    assert fin.done_receiving == ["r1"] and fin.failed == []


def test_an_unanswered_cancel_ends_the_request_only_past_the_last_possible_write(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    _timed_out_decode(decode, registry, transport, clock)
    cfg = decode.config
    clock.advance(cfg.transfer_timeout_s + cfg.cancel_margin_s - 0.1)
    decode.progress_once()
    assert decode.get_finished().failed == []
    clock.advance(0.2)
    decode.progress_once()  # overdue: decided at the next look, after one more pass
    assert decode.get_finished().failed == []
    clock.advance(0.1)
    decode.progress_once()
    assert _failed(decode) == [("r1", FailureType.REGISTRATION_TIMEOUT)]


def test_completions_and_failures_count_only_from_the_paired_engines_agent(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    add_engine(transport, registry, PREFILL)
    other = add_engine(transport, registry, "prefill-other")
    decode.request_receive("r1", PREFILL, [1])
    decode.request_receive("r2", PREFILL, [2])
    forged = [
        PushDone(request_id="r1", prefill_engine_id=PREFILL, num_blocks=1),
        PushFail(request_id="r2", prefill_engine_id=PREFILL, reason=FailureType.TRANSFER_FAILED),
    ]
    for agent in (other, "agent-never-added"):
        for msg in forged:
            transport.deliver(agent, encode_notification(msg))
    decode.progress_once()
    assert decode.get_finished() == type(decode.get_finished())()
    assert decode.in_flight() == 2
    assert decode.metrics.rejected_total.labels("notification")._value.get() == 4


# --- prefill: a registration's validity and the cancel ------------------------------------


def test_a_cancelled_registration_is_never_written(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.deliver(agent, _reg("r1", [5]))
    prefill.progress_once()
    transport.deliver(agent, _cancel("r1"))
    prefill.progress_once()
    answers = _sent(transport, PushFail)
    assert [(a.request_id, a.reason) for a in answers] == [  # type: ignore[attr-defined]
        ("r1", FailureType.REGISTRATION_TIMEOUT)
    ]
    prefill.request_send("r1", [0], DECODE)  # its KV comes late: no WRITE may follow
    prefill.progress_once()
    assert transport.writes == []


def test_a_cancel_for_a_request_with_its_kv_ready_fails_both_sides(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    prefill.request_send("r1", [0], DECODE)
    transport.deliver(agent, _cancel("r1"))  # its registration never came
    prefill.progress_once()
    assert _failed(prefill) == [("r1", FailureType.REGISTRATION_TIMEOUT)]
    assert [a.request_id for a in _sent(transport, PushFail)] == ["r1"]  # type: ignore[attr-defined]


def test_a_cancel_during_the_write_is_answered_by_the_writes_end(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "PROC"
    prefill.request_send("r1", [0], DECODE)
    transport.deliver(agent, _reg("r1", [5]))
    prefill.progress_once()
    assert len(transport.writes) == 1
    transport.deliver(agent, _cancel("r1"))
    prefill.progress_once()
    assert transport.sent == []  # nothing said while the WRITE may land
    transport.write_state = "DONE"  # its completion rides on the WRITE
    prefill.progress_once()
    assert prefill.get_finished().done_sending == ["r1"]
    # A cancel after it ended done is answered with the completion again.
    transport.deliver(agent, _cancel("r1"))
    prefill.progress_once()
    assert [d.request_id for d in _sent(transport, PushDone)] == ["r1"]  # type: ignore[attr-defined]


def test_an_expired_registration_is_refused_not_written(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    agent = add_engine(transport, registry, DECODE)
    prefill.request_send("r1", [0], DECODE)
    prefill.request_send("r2", [1], DECODE)
    transport.deliver(agent, _reg("r1", [5], expires_at=clock() - 1))  # expired on arrival
    transport.deliver(agent, _reg("r2", [6], expires_at=clock() + 1))
    prefill.progress_once()
    assert [w[2] for w in transport.writes] == [[6]]
    told = _sent(transport, PushFail)
    assert [(t.request_id, t.reason) for t in told] == [  # type: ignore[attr-defined]
        ("r1", FailureType.REGISTRATION_TIMEOUT)
    ]


def test_registrations_are_keyed_by_decode_engine_and_bound_to_their_sender(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    other = add_engine(transport, registry, "decode-other")
    prefill.request_send("r1", [0], DECODE)
    transport.deliver(other, _reg("r1", [7], decode="decode-other"))  # another decode's
    transport.deliver(other, _reg("r1", [8]))  # someone else's agent, claiming DECODE
    transport.deliver(agent, _reg("r1", [5]))  # the paired decode's own
    prefill.progress_once()
    assert [(w[0], w[2]) for w in transport.writes] == [(agent, [5])]
    told = [(a, decode_notification(p)) for a, p in transport.sent]
    assert [(a, m.reason) for a, m in told] == [(other, FailureType.REMOTE_REJECTED)]  # type: ignore[union-attr]


def test_a_registration_from_an_agent_the_registry_does_not_hold_is_not_kept(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    prefill.request_send("r1", [0], DECODE)
    transport.deliver(f"agent-{DECODE}", _reg("r1", [5]))  # before the reverse handshake
    prefill.progress_once()
    assert prefill.metrics.rejected_total.labels("notification")._value.get() == 1
    add_engine(transport, registry, DECODE)  # the operator's handshake lands
    prefill.progress_once()
    assert transport.writes == []  # nothing was kept of it: the decode registers again
    transport.deliver(f"agent-{DECODE}", _reg("r1", [5]))
    prefill.progress_once()
    assert [w[2] for w in transport.writes] == [[5]]


def _write_nixl_will_not_release(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """Request r1's WRITE is in flight, and NIXL will neither finish nor release it."""
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "PROC"
    transport.release_ok = False
    prefill.request_send("r1", [0], DECODE)
    transport.deliver(agent, _reg("r1", [5]))
    prefill.progress_once()


def test_a_write_that_cannot_be_aborted_is_watched_before_anyone_is_told(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    _write_nixl_will_not_release(prefill, registry, transport)
    clock.advance(prefill.config.transfer_timeout_s + 0.1)
    prefill.progress_once()
    prefill.progress_once()
    assert transport.sent == [] and prefill.get_finished().failed == []
    transport.write_state = "DONE"  # it landed after all: both sides say done
    prefill.progress_once()
    assert prefill.get_finished().done_sending == ["r1"]
    assert registry.peer_states()[0].transfers_in_flight == 0


# --- every request ends once, whatever raises --------------------------------------------


@pytest.mark.parametrize("fault", ["write", "poll", "release"])
def test_a_fault_anywhere_in_a_pass_ends_each_request_once_and_unpins(
    clock: FakeClock, fault: str
) -> None:
    transport = FakeTransport()
    registry = EngineRegistry(remove_agent=transport.remove_remote, clock=clock)
    prefill = make_connector("prefill", transport, registry, clock)
    agent = add_engine(transport, registry, DECODE)

    def boom(*_: object) -> None:
        raise RuntimeError(f"injected {fault} fault")

    transport.write_state = "ERR" if fault == "release" else "PROC"
    if fault == "write":
        transport.write_blocks = boom  # type: ignore[assignment,method-assign]
    elif fault == "poll":
        transport.on_poll = boom
    else:
        transport.on_release = boom
    for i in range(3):
        prefill.request_send(f"r{i}", [i], DECODE)
        transport.deliver(agent, _reg(f"r{i}", [10 + i]))
    prefill.progress_once()
    assert registry.evict(DECODE) in ("deferred", "evicted")
    for _ in range(3):
        prefill.progress_once()
    ended = [f.request_id for f in prefill.get_finished().failed]
    assert sorted(ended) == ["r0", "r1", "r2"]
    assert prefill.in_flight() == 0
    assert DECODE not in registry  # the deferred eviction ran: nothing stayed pinned
    assert prefill.metrics.duplicate_outcomes_total._value.get() == 0


def test_stop_fails_everything_pending_tells_the_peers_and_releases(
    clock: FakeClock,
) -> None:
    transport = FakeTransport()
    registry = EngineRegistry(remove_agent=transport.remove_remote, clock=clock)
    prefill = make_connector("prefill", transport, registry, clock)
    decode = make_connector("decode", transport, registry, clock)
    d_agent = add_engine(transport, registry, DECODE)
    add_engine(transport, registry, PREFILL)
    transport.write_state = "PROC"
    prefill.request_send("writing", [0], DECODE)
    transport.deliver(d_agent, _reg("writing", [5]))
    prefill.request_send("waiting", [1], DECODE)
    prefill.progress_once()
    transport.deliver(d_agent, _reg("early", [6]))  # registered, its KV not ready
    prefill.progress_once()
    decode.request_receive("recv", PREFILL, [3])
    decode.flush_registrations()
    transport.sent.clear()
    prefill.stop()
    decode.stop()
    assert sorted(_failed(prefill)) == [
        ("waiting", FailureType.SHUTDOWN),
        ("writing", FailureType.SHUTDOWN),
    ]
    assert _failed(decode) == [("recv", FailureType.SHUTDOWN)]
    told = sorted(
        (type(m).__name__, m.request_id)  # type: ignore[union-attr]
        for m in (decode_notification(p) for _, p in transport.sent)
    )
    assert told == [("PushCancel", "recv"), ("PushFail", "early"), ("PushFail", "writing")]
    assert len(transport.released) == 1
    assert all(p.transfers_in_flight == 0 for p in registry.peer_states())
    with pytest.raises(RuntimeError, match="stopped"):
        prefill.request_send("after", [2], DECODE)


def test_a_write_nixl_will_not_release_is_never_given_up_while_it_can_land(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport, clock: FakeClock
) -> None:
    """Issue 55, defect 5: past any number of deadlines, a WRITE NIXL refuses to release
    stays WRITING: no PUSH_FAIL, no outcome, counted; NIXL's own end then ends it."""
    _write_nixl_will_not_release(prefill, registry, transport)
    for _ in range(5):
        clock.advance(prefill.config.transfer_timeout_s + 0.1)
        prefill.progress_once()
    assert transport.sent == [] and prefill.get_finished().failed == []
    assert prefill.writing("r1")
    assert prefill.metrics.writes_unreleasable._value.get() == 1
    transport.write_state = "ERR"  # NIXL ended it (failed): nothing of it can land now
    prefill.progress_once()
    assert [f.request_id for f in prefill.get_finished().failed] == ["r1"]
    assert [decode_notification(p).request_id for _, p in transport.sent] == ["r1"]
    assert prefill.metrics.writes_unreleasable._value.get() == 0


def test_stopping_beside_a_write_nixl_will_not_release_tells_the_decode_nothing(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    """Issue 55, defect 5: `stop()` ends the prefill's own request (the engine leaves), but
    sends no PUSH_FAIL for a WRITE that can still land; one it released is told."""
    _write_nixl_will_not_release(prefill, registry, transport)
    prefill.stop()
    assert transport.sent == []
    failed = prefill.get_finished().failed
    assert [(f.request_id, f.reason) for f in failed] == [("r1", FailureType.SHUTDOWN)]
