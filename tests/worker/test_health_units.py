"""Peer health, the pure parts: the registry's transitions (ok, dropped, failing), what the
push path records of each transfer, and the control API's renewal of an unhealthy peer.
Built through the real constructors, with a fake transport and clock."""

from __future__ import annotations

import contextlib

import pytest

from kvtopo_worker.protocol import PushDone, PushRegistration, encode_notification
from kvtopo_worker.push import PushConnector
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.transport import TransportError
from tests.worker.conftest import DECODE, PREFILL, add_engine, make_connector
from tests.worker.fakes import FakeClock, FakeTransport
from tests.worker.test_agent import call, make_node


def health(registry: EngineRegistry, engine_id: str) -> tuple[str, str] | None:
    return registry.health(engine_id)


# --- the registry ------------------------------------------------------------------------


def test_failures_in_a_row_make_a_peer_failing_and_a_success_makes_it_ok_again(
    transport: FakeTransport, clock: FakeClock
) -> None:
    registry = EngineRegistry(remove_agent=transport.remove_remote, clock=clock, failing_after=3)
    agent = add_engine(transport, registry, "e1")
    assert registry.peer_failed("e1", agent, "WRITE failed") is None
    assert registry.peer_failed("e1", agent, "WRITE failed") is None
    assert registry.peer_succeeded("e1", agent) is None  # the count starts again
    assert registry.peer_failed("e1", agent, "WRITE failed") is None
    assert registry.peer_failed("e1", agent, "WRITE failed") is None
    assert health(registry, "e1") == ("ok", "")
    assert registry.peer_failed("e1", agent, "WRITE timed out") == "failing"
    assert registry.peer_failed("e1", agent, "WRITE timed out") is None  # no new transition
    assert health(registry, "e1") == ("failing", "WRITE timed out")
    (state,) = registry.peer_states()
    assert (state.health, state.health_reason) == ("failing", "WRITE timed out")
    assert registry.peer_succeeded("e1", agent) == "ok"
    assert health(registry, "e1") == ("ok", "")


def test_a_disconnect_drops_a_peer_at_once_and_only_a_renewal_makes_it_ok(
    transport: FakeTransport, registry: EngineRegistry
) -> None:
    agent = add_engine(transport, registry, "e1")
    assert registry.peer_failed("e1", agent, "failing first") is None
    reason = "send_notif to agent-e1: NIXL_ERR_REMOTE_DISCONNECT"
    assert registry.peer_failed("e1", agent, reason, dropped=True) == "dropped"
    assert health(registry, "e1") == ("dropped", reason)
    assert registry.peer_succeeded("e1", agent) is None  # NIXL does not reconnect it
    assert registry.peer_failed("e1", agent, "other") is None
    assert health(registry, "e1") == ("dropped", reason)
    # Renewed: evicted and added again, it starts healthy.
    assert registry.evict("e1", "unhealthy") == "evicted"
    add_engine(transport, registry, "e1")
    assert health(registry, "e1") == ("ok", "")
    assert registry.health("absent") is None


def test_failures_of_an_agent_the_peer_no_longer_has_say_nothing_of_it(
    transport: FakeTransport, registry: EngineRegistry
) -> None:
    add_engine(transport, registry, "e1")
    for _ in range(5):
        assert registry.peer_failed("e1", "agent-of-a-former-process", "x", dropped=True) is None
        assert registry.peer_failed("unknown", "agent-unknown", "x", dropped=True) is None
    assert health(registry, "e1") == ("ok", "")


def test_failing_after_must_be_at_least_one(transport: FakeTransport) -> None:
    with pytest.raises(ValueError, match="failing_after"):
        EngineRegistry(remove_agent=transport.remove_remote, failing_after=0)


# --- what the push path records ----------------------------------------------------------


def _register(transport: FakeTransport, agent: str, rid: str, block: int) -> None:
    reg = PushRegistration(
        request_id=rid,
        decode_engine_id=DECODE,
        prefill_engine_id=PREFILL,
        block_ids=[block],
        expires_at=1e12,
        write_timeout_s=30.0,
    )
    transport.deliver(agent, encode_notification(reg))


def _write_one(prefill: PushConnector, transport: FakeTransport, agent: str, rid: str) -> None:
    prefill.request_send(rid, [0])
    _register(transport, agent, rid, 5)
    prefill.progress_once()  # the WRITE is posted
    prefill.progress_once()  # ... and polled to its end


def test_writes_that_keep_failing_make_the_decode_failing_and_one_done_heals_it(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "ERR"
    for i in range(3):
        _write_one(prefill, transport, agent, f"r{i}")
    failing = registry.health(DECODE)
    assert failing is not None and failing[0] == "failing", failing
    assert agent in failing[1]
    assert prefill.metrics.peer_health_total.labels("failing")._value.get() == 1
    transport.write_state = "DONE"
    _write_one(prefill, transport, agent, "r3")
    assert registry.health(DECODE) == ("ok", "")
    assert len(prefill.get_finished().failed) == 3


def test_a_write_nixl_reports_disconnected_drops_the_decode(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)

    def disconnected(handle: object) -> None:
        raise TransportError("WRITE failed: NIXL_ERR_REMOTE_DISCONNECT", "disconnected")

    transport.write_state = "PROC"
    transport.on_poll = disconnected
    _write_one(prefill, transport, agent, "r1")
    dropped = registry.health(DECODE)
    assert dropped is not None and dropped[0] == "dropped"
    assert "NIXL_ERR_REMOTE_DISCONNECT" in dropped[1]
    assert [f.request_id for f in prefill.get_finished().failed] == ["r1"]


def test_a_registration_nixl_cannot_send_drops_the_prefill(
    decode: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    add_engine(transport, registry, PREFILL)
    transport.fail_sends = True  # the fake's send failure is a remote disconnect
    decode.request_receive("r1", PREFILL, [1])
    decode.flush_registrations()
    assert [f.request_id for f in decode.get_finished().failed] == ["r1"]
    assert registry.health(PREFILL) == ("dropped", "injected send failure")
    assert decode.metrics.peer_health_total.labels("dropped")._value.get() == 1


def test_requests_given_up_unanswered_make_the_prefill_failing_a_completion_heals_it(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock
) -> None:
    decode = make_connector(
        "decode", transport, registry, clock, registration_timeout_s=1.0, transfer_timeout_s=1.0
    )
    agent = add_engine(transport, registry, PREFILL)
    for i in range(3):
        decode.request_receive(f"r{i}", PREFILL, [i])
    decode.flush_registrations()
    clock.advance(1.01)
    decode.progress_once()  # given up: cancels sent, no answer comes
    clock.advance(5)
    decode.progress_once()
    clock.advance(0.1)
    decode.progress_once()
    assert len(decode.get_finished().failed) == 3
    failing = registry.health(PREFILL)
    assert failing is not None and failing[0] == "failing", failing
    decode.request_receive("r3", PREFILL, [3])
    decode.flush_registrations()
    done = PushDone(request_id="r3", prefill_engine_id=PREFILL, num_blocks=1)
    transport.deliver(agent, encode_notification(done))
    decode.progress_once()
    assert decode.get_finished().done_receiving == ["r3"]
    assert registry.health(PREFILL) == ("ok", "")
    decode.stop()


def test_an_agent_nixl_no_longer_holds_is_dropped_by_the_check(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    other = add_engine(transport, registry, "decode-2")
    assert prefill.check_peers() == 0
    transport.forgotten.add(agent)
    assert prefill.check_peers() == 0  # missing once: it may be being renewed
    assert registry.health(DECODE) == ("ok", "")
    assert prefill.check_peers() == 1  # missing at the next check too: dropped
    dropped = registry.health(DECODE)
    assert dropped is not None and dropped[0] == "dropped" and agent in dropped[1]
    assert registry.health("decode-2") == ("ok", "") and other


# --- the control API renews an unhealthy peer ---------------------------------------------


def test_an_add_of_a_peer_held_unhealthy_renews_it() -> None:
    p, d = make_node("pre-1", "prefill"), make_node("dec-1", "decode")
    try:
        url = f"{d.url}/v1/peers/pre-1"
        body = {"endpoint": p.server.endpoint, "role": "prefill"}
        assert call("PUT", url, body)[1]["result"] == "added"
        assert call("PUT", url, body)[1]["result"] == "present"
        assert d.registry.peer_failed("pre-1", "agent-pre-1", "gone", dropped=True) == "dropped"
        state = call("GET", f"{d.url}/v1/state")[1]
        assert state["peers"][0]["health"] == "dropped"  # type: ignore[index]
        assert state["peers"][0]["health_reason"] == "gone"  # type: ignore[index]
        # With a transfer in flight to the old agent, the renewal waits for it.
        assert d.registry.begin_transfer("pre-1") is not None
        status, answer = call("PUT", url, body)
        assert (status, answer["error"]) == (409, "replacing"), answer
        assert "dropped" in str(answer["message"])
        d.registry.end_transfer("pre-1")  # the deferred eviction runs now
        assert "pre-1" not in d.registry
        assert call("PUT", url, body)[1]["result"] == "added"
        # Dropped again, nothing in flight: renewed at once.
        d.registry.peer_failed("pre-1", "agent-pre-1", "gone again", dropped=True)
        removed = len(d.transport.removed)
        status, answer = call("PUT", url, body)
        assert (status, answer["result"], answer["agents"]) == (
            200,
            "renewed",
            {"0": "agent-pre-1"},
        ), answer
        assert len(d.transport.removed) == removed + 1, "the old agent was torn down"
        assert d.registry.health("pre-1") == ("ok", "")
        metrics = d.server.metrics
        assert metrics.handshakes_total.labels("renewed")._value.get() == 1
        # A renewal whose fetch fails leaves the peer as it was.
        d.registry.peer_failed("pre-1", "agent-pre-1", "gone for good", dropped=True)
        p.server.stop()
        status, answer = call("PUT", url, body)
        assert status == 502 and answer["error"] == "handshake_failed", answer
        assert d.registry.snapshot("pre-1") == {0: "agent-pre-1"}
        assert d.registry.health("pre-1") == ("dropped", "gone for good")
    finally:
        for node in (p, d):
            with contextlib.suppress(RuntimeError):  # stopped already
                node.server.stop()
