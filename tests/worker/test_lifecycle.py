"""A request's life on both sides, table-tested: arrival orders of registrations and cancels,
a decode or prefill process replaced under its engine id, timeouts and shutdown, each row a
script over a real DecodePush and PrefillPush joined by a fake wire (unit test: fake
transports and clock, the real constructors), with the outcome each side must report and
whether a WRITE may be posted at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    FailureType,
    PushCancel,
    PushFail,
    PushHello,
    PushRegistration,
    decode_notification,
    encode_notification,
)
from kvtopo_worker.push import PushConfig, PushConnector, new_connector
from kvtopo_worker.push.lifecycle import (
    HELD_TABLE,
    RECV_TABLE,
    SEND_TABLE,
    Held,
    Recv,
    RecvEvent,
    Send,
    SendEvent,
)
from kvtopo_worker.registry import EngineRegistry
from tests.worker.fakes import FakeClock, FakeTransport

P_AGENT, D_AGENT, D2_AGENT, P2_AGENT = "agent-p", "agent-d", "agent-d2", "agent-p2"


class Pair:
    """A decode and a prefill connector whose notifications and WRITE completions travel
    only when `deliver` says so (so a test chooses every arrival order)."""

    def __init__(self, **config: object) -> None:
        self.clock = FakeClock()
        cfg = PushConfig(
            registration_timeout_s=5, kv_lease_s=5, transfer_timeout_s=5, cancel_margin_s=1,
            greet_peers=False, **config,  # type: ignore[arg-type]
        )  # fmt: skip
        self.dt = FakeTransport(agent_name=D_AGENT)
        self.pt = FakeTransport(agent_name=P_AGENT)
        self.d_reg = EngineRegistry(remove_agent=self.dt.remove_remote, clock=self.clock)
        self.p_reg = EngineRegistry(remove_agent=self.pt.remove_remote, clock=self.clock)
        self.dt.add_agent(P_AGENT)
        self.d_reg.add_engine("pre", {0: P_AGENT}, "p1")
        self.pt.add_agent(D_AGENT)
        self.p_reg.add_engine("dec", {0: D_AGENT}, "d1")
        self.decode = self._conn("dec", "decode", self.dt, self.d_reg, cfg)
        self.prefill = self._conn("pre", "prefill", self.pt, self.p_reg, cfg)
        self.to_prefill: list[tuple[str, bytes]] = []  # in flight on the wire
        self.to_decode: list[tuple[str, bytes]] = []
        self.d_out: dict[str, str] = {}
        self.p_out: dict[str, str] = {}

    def _conn(
        self, engine: str, role: str, t: FakeTransport, reg: EngineRegistry, cfg: PushConfig
    ) -> PushConnector:
        return new_connector(
            engine_id=engine, role=role, transport=t, registry=reg,  # type: ignore[arg-type]
            metrics=WorkerMetrics(), config=cfg, clock=self.clock, wall_clock=self.clock,
            block_len=t.block_len,
        )  # fmt: skip

    def _take_sent(self) -> None:
        for _, data in self.dt.sent:
            self.to_prefill.append((D_AGENT, data))
        self.dt.sent.clear()
        for _, data in self.pt.sent:
            self.to_decode.append((P_AGENT, data))
        self.pt.sent.clear()

    def deliver(self, to: str, order: Callable[[list[bytes]], list[int]] | None = None) -> None:
        """What is on the wire to `to` ("prefill" or "decode") arrives in one batch (in
        the order `order` picks), and `to` makes a pass."""
        self._take_sent()
        wire = self.to_prefill if to == "prefill" else self.to_decode
        batch = list(wire)
        wire.clear()
        if order is not None:
            batch = [batch[i] for i in order([d for _, d in batch])]
        t = self.pt if to == "prefill" else self.dt
        for agent, data in batch:
            t.deliver(agent, data)
        (self.prefill if to == "prefill" else self.decode).progress_once()
        self._take_sent()
        self.collect()

    def complete_writes(self) -> None:
        """WRITEs posted so far land: their completions go on the wire to the decode."""
        for _, _, _, notif in self.pt.writes:
            self.to_decode.append((P_AGENT, notif))
        self.pt.writes.clear()

    def collect(self) -> None:
        for conn, out in ((self.decode, self.d_out), (self.prefill, self.p_out)):
            fin = conn.get_finished()
            for rid in fin.done_receiving + fin.done_sending:
                assert rid not in out
                out[rid] = "done"
            for f in fin.failed:
                assert f.request_id not in out
                out[f.request_id] = f"failed:{f.reason.value}"

    def submit(self, rid: str = "r") -> None:
        self.decode.request_receive(rid, "pre", [1, 2])
        self.decode.flush_registrations()
        self._take_sent()

    def ready(self, rid: str = "r") -> None:
        self.prefill.request_send(rid, [5, 6], "dec")
        self.collect()

    def later(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for _ in range(2):  # the give-up decision is taken at a later look
            self.decode.progress_once()
            self.prefill.progress_once()
            self.clock.advance(0.1)
        self._take_sent()
        self.collect()

    def writes_posted(self) -> int:
        return len([w for w in self.pt.writes])

    def replace_decode(self) -> None:
        """The decode engine restarted under its id: the prefill evicts the old process's
        agent and adds the new one."""
        assert self.p_reg.evict("dec", "restarted") == "evicted"
        self.pt.add_agent(D2_AGENT)
        self.p_reg.add_engine("dec", {0: D2_AGENT}, "d2")

    def replace_prefill(self) -> None:
        """The prefill engine restarted under its id: the decode evicts the old process's
        agent and adds the new one (which knows nothing of earlier requests)."""
        assert self.d_reg.evict("pre", "restarted") == "evicted"
        self.dt.add_agent(P2_AGENT)
        self.d_reg.add_engine("pre", {0: P2_AGENT}, "p2")


def _cancel_first(batch: list[bytes]) -> list[int]:
    return sorted(range(len(batch)), key=lambda i: not batch[i].startswith(b"PUSH_CANCEL"))


@dataclass(frozen=True)
class Row:
    name: str
    script: Callable[[Pair], None]
    decode: str  # the decode's outcome of "r"
    prefill: str  # the prefill's outcome of "r"
    writes: int  # WRITEs the prefill may have posted for "r"


def _plain(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")
    p.ready()
    p.deliver("prefill")
    p.complete_writes()
    p.deliver("decode")


def _abort_in_same_batch(p: Pair) -> None:
    p.submit()
    p.decode.abandon("r", FailureType.ABORTED, "abort")
    p.deliver("prefill")  # registration and cancel in one batch, in order
    p.deliver("decode")
    p.ready()
    p.deliver("prefill")


def _cancel_overtakes(p: Pair) -> None:
    p.submit()
    p.decode.abandon("r", FailureType.ABORTED, "abort")
    p.deliver("prefill", _cancel_first)  # reordered: the tombstone refuses the registration
    p.deliver("decode")
    p.ready()  # its KV is ready only now: it fails at once
    p.deliver("prefill")


def _abort_after_written(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")
    p.ready()
    p.deliver("prefill")  # matched and WRITTEN
    p.decode.abandon("r", FailureType.ABORTED, "abort")
    p.deliver("prefill")  # the cancel meets the WRITE in flight: its end answers
    p.complete_writes()
    p.deliver("decode")


def _abort_while_waiting(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")
    p.decode.abandon("r", FailureType.ABORTED, "abort")
    p.deliver("prefill")
    p.deliver("decode")
    p.ready()
    p.deliver("prefill")


def _decode_replaced(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")  # held by the prefill, no KV yet
    p.replace_decode()
    p.ready()
    p.deliver("prefill")
    p.later(6)  # the KV lease; the old decode's request is given up meanwhile
    p.deliver("decode")
    p.later(13)


def _prefill_replaced_answers_nothing(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")  # held by the old prefill process
    p.replace_prefill()
    fail = PushFail(request_id="r", prefill_engine_id="pre", reason=FailureType.REMOTE_REJECTED)
    p.to_decode.append((P2_AGENT, encode_notification(fail)))  # the new process's word
    p.deliver("decode")
    assert "r" not in p.d_out
    p.ready()  # the old process still writes it
    p.deliver("prefill")
    p.complete_writes()
    p.deliver("decode")


def _prefill_never_answers(p: Pair) -> None:
    p.submit()
    p.later(5.1)  # registration timeout: cancel sent, no answer ever
    p.later(5.1 + 1.1)  # past expires_at + write timeout + margin


def _decode_stops(p: Pair) -> None:
    p.submit()
    p.deliver("prefill")
    p.decode.stop()
    p.collect()
    p.deliver("prefill")  # its cancel arrives: the prefill drops the registration
    p.ready()
    p.deliver("prefill")
    p.later(6)


def _registration_expired(p: Pair) -> None:
    p.submit()
    p.clock.advance(5.5)  # the registration sat in the wire past its validity
    p.ready()
    p.deliver("prefill")
    p.deliver("decode")
    p.later(7)


TABLE = [
    Row("plain", _plain, "done", "done", 1),
    Row("abort in the registration's batch", _abort_in_same_batch, "failed:aborted",
        "failed:registration_timeout", 0),
    Row("cancel overtakes its registration", _cancel_overtakes, "failed:aborted",
        "failed:registration_timeout", 0),
    Row("abort after the WRITE started", _abort_after_written, "done", "done", 1),
    Row("abort while the registration waits", _abort_while_waiting, "failed:aborted",
        "failed:registration_timeout", 0),
    Row("decode replaced under its engine id", _decode_replaced,
        "failed:registration_timeout", "failed:kv_expired", 0),
    Row("a new prefill process's failure ends nothing", _prefill_replaced_answers_nothing,
        "done", "done", 1),
    Row("prefill never answers", _prefill_never_answers, "failed:registration_timeout", "", 0),
    Row("decode stops", _decode_stops, "failed:shutdown", "failed:registration_timeout", 0),
    Row("registration expired in the wire", _registration_expired,
        "failed:registration_timeout", "failed:registration_timeout", 0),
]  # fmt: skip


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_each_order_ends_once_the_same_way_on_both_sides(row: Row) -> None:
    pair = Pair()
    posted: list[int] = []
    original = pair.pt.write_blocks

    def counting(*args: object) -> object:
        posted.append(1)
        return original(*args)  # type: ignore[arg-type]

    pair.pt.write_blocks = counting  # type: ignore[method-assign]
    row.script(pair)
    assert pair.d_out.get("r", "") == row.decode, pair.d_out
    assert pair.p_out.get("r", "") == row.prefill, pair.p_out
    assert len(posted) == row.writes
    assert pair.decode.metrics.duplicate_outcomes_total._value.get() == 0
    assert pair.prefill.metrics.duplicate_outcomes_total._value.get() == 0


def test_every_phase_ends_on_stop_and_no_ended_phase_moves() -> None:
    """The tables themselves: stop ends every live phase; nothing leaves an ended one; a
    tombstone never turns into a registration."""
    for phase in (Recv.QUEUED, Recv.REGISTERED, Recv.CANCELLING):
        assert RECV_TABLE[(phase, RecvEvent.STOP)][0] is Recv.FAILED
    for phase in (Send.WAITING, Send.WRITING):
        assert SEND_TABLE[(phase, SendEvent.STOP)][0] is Send.FAILED
    assert not [k for k in RECV_TABLE if k[0] in (Recv.DONE, Recv.FAILED)]
    assert not [k for k in SEND_TABLE if k[0] in (Send.DONE, Send.FAILED)]
    assert all(v[0] is not Held.HELD for k, v in HELD_TABLE.items() if k[0] is Held.TOMBSTONE)
    # A completion can only end a request that was sent.
    assert (Recv.QUEUED, RecvEvent.COMPLETED) not in RECV_TABLE


def test_a_decode_sends_a_registration_only_to_a_prefill_agent_that_greeted_it() -> None:
    pair = Pair()
    decode = new_connector(
        engine_id="dec2", role="decode", transport=pair.dt, registry=pair.d_reg,
        metrics=WorkerMetrics(), config=PushConfig(registration_timeout_s=5),
        clock=pair.clock, wall_clock=pair.clock,
    )  # fmt: skip
    decode.request_receive("g", "pre", [1])
    assert decode.flush_registrations() == 1
    assert not [d for _, d in pair.dt.sent if isinstance(decode_notification(d), PushRegistration)]
    # A greeting from an agent that is not the prefill's (or claims another engine) counts
    # for nothing.
    pair.dt.add_agent("agent-x")
    pair.d_reg.add_engine("other", {0: "agent-x"})
    pair.dt.deliver("agent-x", encode_notification(PushHello(engine_id="pre")))
    decode.progress_once()
    decode.flush_registrations()
    assert not [d for _, d in pair.dt.sent if isinstance(decode_notification(d), PushRegistration)]
    pair.dt.deliver(P_AGENT, encode_notification(PushHello(engine_id="pre")))
    decode.progress_once()
    decode.flush_registrations()
    regs = [(a, decode_notification(d)) for a, d in pair.dt.sent]
    assert [(a, m.request_id) for a, m in regs if isinstance(m, PushRegistration)] == [
        (P_AGENT, "g")
    ]
    # It answered the greeting, once (an ack is not answered).
    hellos = [m for _, m in regs if isinstance(m, PushHello)]
    assert [h.ack for h in hellos if h.engine_id == "dec2"].count(True) == 1
    decode.stop()


def test_a_registration_never_greeted_ends_at_its_timeout_unsent() -> None:
    pair = Pair()
    decode = new_connector(
        engine_id="dec2", role="decode", transport=pair.dt, registry=pair.d_reg,
        metrics=WorkerMetrics(), config=PushConfig(registration_timeout_s=5),
        clock=pair.clock, wall_clock=pair.clock,
    )  # fmt: skip
    decode.request_receive("g", "pre", [1])
    decode.flush_registrations()
    pair.clock.advance(5.1)
    decode.progress_once()
    failed = decode.get_finished().failed
    assert [(f.request_id, f.reason) for f in failed] == [("g", FailureType.REGISTRATION_TIMEOUT)]
    assert "never sent" in failed[0].message
    assert not [m for _, m in pair.dt.sent if isinstance(decode_notification(m), PushCancel)]
    decode.stop()
