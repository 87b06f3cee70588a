"""A prefill request found by its alias (the id a P/D router gave it), with the order of
messages a router's decode may produce: a registration or a cancel under the alias before
the request's KV is ready, one after, an alias two requests carry, a prompt that is not the
request's, and a transfer error. Fakes built through the real constructors; a fake clock."""

from __future__ import annotations

from kvtopo_worker.protocol import (
    FailureType,
    PushCancel,
    PushDone,
    PushFail,
    PushRegistration,
    decode_notification,
    encode_notification,
    prompt_digest,
)
from kvtopo_worker.push import PushConnector
from kvtopo_worker.registry import EngineRegistry
from tests.worker.conftest import DECODE, PREFILL, add_engine
from tests.worker.fakes import FakeTransport

FAR = 1e12
PROMPT = prompt_digest([11, 12, 13, 14])
OTHER = prompt_digest([11, 12, 13, 15])
OURS = "cmpl-router-7-0-1a2b3c4d"  # our id of the request
ALIAS = "router-7"  # the router's


def _register(
    transport: FakeTransport, agent: str, rid: str, digest: str, blocks: list[int] | None = None
) -> None:
    reg = PushRegistration(
        request_id=rid,
        decode_engine_id=DECODE,
        prefill_engine_id=PREFILL,
        block_ids=blocks or [7, 8],
        expires_at=FAR,
        write_timeout_s=30.0,
        prompt_digest=digest,
    )
    transport.deliver(agent, encode_notification(reg))


def _cancel(transport: FakeTransport, agent: str, rid: str) -> None:
    msg = PushCancel(request_id=rid, decode_engine_id=DECODE, prefill_engine_id=PREFILL)
    transport.deliver(agent, encode_notification(msg))


def _told(transport: FakeTransport) -> list[object]:
    return [decode_notification(p) for _, p in transport.sent]


def test_a_registration_under_the_alias_gets_the_requests_kv_named_as_the_decode_named_it(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    _register(transport, agent, ALIAS, PROMPT)
    prefill.progress_once()
    ((w_agent, local, remote, notif),) = transport.writes
    assert (w_agent, local, remote) == (agent, [0, 1], [7, 8])
    assert decode_notification(notif) == PushDone(
        request_id=ALIAS, prefill_engine_id=PREFILL, num_blocks=2
    )
    prefill.progress_once()
    assert prefill.get_finished().done_sending == [OURS]  # vLLM's id, to vLLM


def test_a_registration_under_the_alias_before_the_kv_is_ready_is_adopted(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    _register(transport, agent, ALIAS, PROMPT)
    prefill.progress_once()
    assert transport.writes == []
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    prefill.progress_once()
    ((_, _, remote, notif),) = transport.writes
    assert remote == [7, 8]
    assert decode_notification(notif).request_id == ALIAS  # type: ignore[union-attr]


def test_a_cancel_under_the_alias_before_the_kv_is_ready_fails_the_request_at_once(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    _cancel(transport, agent, ALIAS)
    prefill.progress_once()
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    _register(transport, agent, ALIAS, PROMPT)  # overtaken by its cancel: refused
    prefill.progress_once()
    assert transport.writes == []
    fin = prefill.get_finished()
    assert [(f.request_id, f.reason) for f in fin.failed] == [
        (OURS, FailureType.REGISTRATION_TIMEOUT)
    ]


def test_a_registration_of_another_prompt_is_refused_and_the_request_waits_on(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    _register(transport, agent, ALIAS, OTHER)
    _register(transport, agent, ALIAS, "")  # no digest: not the request's prompt either
    prefill.progress_once()
    assert transport.writes == []
    refused = _told(transport)
    assert len(refused) == 2
    for msg in refused:
        assert isinstance(msg, PushFail) and msg.request_id == ALIAS
        assert msg.reason is FailureType.REMOTE_REJECTED and "prompt" in msg.message
    assert prefill.get_finished().failed == []
    _register(transport, agent, ALIAS, PROMPT)
    prefill.progress_once()
    assert len(transport.writes) == 1


def test_a_registration_of_another_prompt_that_came_first_is_refused_on_adoption(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    _register(transport, agent, ALIAS, OTHER)
    prefill.progress_once()
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    prefill.progress_once()
    assert transport.writes == []
    (msg,) = _told(transport)
    assert isinstance(msg, PushFail) and msg.request_id == ALIAS and "prompt" in msg.message


def test_an_alias_two_requests_carry_finds_neither(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    prefill.request_send("cmpl-router-7-1-99887766", [2, 3], alias=ALIAS, prompt_digest=PROMPT)
    _register(transport, agent, ALIAS, PROMPT)
    prefill.progress_once()
    assert transport.writes == []
    (msg,) = _told(transport)
    assert isinstance(msg, PushFail) and msg.request_id == ALIAS
    assert "several requests" in msg.message
    # Each request is still found by its own id (a proxy that copies the params).
    _register(transport, agent, OURS, PROMPT)
    prefill.progress_once()
    assert len(transport.writes) == 1


def test_a_failed_write_is_told_under_the_alias(
    prefill: PushConnector, registry: EngineRegistry, transport: FakeTransport
) -> None:
    agent = add_engine(transport, registry, DECODE)
    transport.write_state = "ERR"
    prefill.request_send(OURS, [0, 1], alias=ALIAS, prompt_digest=PROMPT)
    _register(transport, agent, ALIAS, PROMPT)
    prefill.progress_once()
    prefill.progress_once()
    assert [(f.request_id, f.reason) for f in prefill.get_finished().failed] == [
        (OURS, FailureType.TRANSFER_FAILED)
    ]
    (msg,) = _told(transport)
    assert isinstance(msg, PushFail) and msg.request_id == ALIAS
    # A late cancel under the alias is answered from the outcome, under the alias.
    _cancel(transport, agent, ALIAS)
    prefill.progress_once()
    late = _told(transport)[-1]
    assert isinstance(late, PushFail) and late.request_id == ALIAS
    assert late.reason is FailureType.TRANSFER_FAILED
