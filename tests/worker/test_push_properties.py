"""Random interleavings of a push's events on both sides, over real NIXL (two agents of
this process over UCX loopback, real WRITEs into real tensors): registrations, cancels,
aborts, KV becoming ready, passes of either side's progress, time passing, a decode process
replaced under its engine id (its old process frozen or partitioned, not dead), either
engine's drain deadline (every request it holds given up), the prefill engine stopping
(`stop()`; it is not pumped again), and NIXL refusing to release (abort) the prefill's next
WRITE past its deadline, in any order hypothesis finds.

After every case: each request ends once on each side that took it; both sides agree (done
on one side is done on the other); and no WRITE landed in blocks the decode had let go (the
decode zeroes a request's blocks when it ends it, so a block that is not zero while free, or
the memory of a process that never asked for anything, holds a WRITE that came too late).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import CompatInfo, FailureType, compat_hash, decode_metadata
from kvtopo_worker.protocol import encode_metadata as encode
from kvtopo_worker.push import PushConfig, PushConnector, new_connector
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.transport import NixlTransport
from tests.worker.fakes import FakeClock

pytestmark = pytest.mark.nixl

BLOCK = 1024
BLOCKS = 32
PER_REQUEST = 2
CASES = int(os.environ.get("KVTOPO_PUSH_CASES", "1000"))


@dataclass
class Agents:
    """The NIXL agents of the module: a prefill, a decode and the decode's successor (the
    same engine id restarted: a new agent), each with a KV cache."""

    prefill: NixlTransport
    decode: NixlTransport
    successor: NixlTransport
    kv: dict[str, torch.Tensor] = field(default_factory=dict)

    def all(self) -> list[NixlTransport]:
        return [self.prefill, self.decode, self.successor]


def _meta(t: NixlTransport, engine_id: str, role: str) -> Any:
    compat = CompatInfo(block_len=BLOCK)
    raw = encode(t.describe(engine_id=engine_id, role=role, compat=compat))  # type: ignore[arg-type]
    return decode_metadata(raw, compat_hash(compat))


@pytest.fixture(scope="module")
def agents() -> Iterator[Agents]:
    made = Agents(
        NixlTransport("prop-prefill", progress_thread=False),
        NixlTransport("prop-decode-a", progress_thread=False),
        NixlTransport("prop-decode-b", progress_thread=False),
    )
    for t in made.all():
        kv = torch.zeros((BLOCKS, BLOCK), dtype=torch.uint8)
        t.register_kv_cache(kv)
        made.kv[t.agent_name] = kv
    p_meta = _meta(made.prefill, "pre", "prefill")
    for d in (made.decode, made.successor):
        d.add_remote_peer(p_meta)
        made.prefill.add_remote_peer(_meta(d, "dec", "decode"))
    yield made
    for t in made.all():
        t.close()


_case = itertools.count()

Step = tuple[str, int]
steps = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["submit", "ready", "abort_d", "abort_p"]), st.integers(0, 3)),
        st.tuples(
            st.sampled_from(
                [
                    "pump_d",
                    "pump_p",
                    "pump_d",
                    "pump_p",
                    "later",
                    "much_later",
                    "replace",
                    "drain_d",
                    "drain_p",
                    "stop_p",
                    "refuse_release",
                ]
            ),
            st.just(0),
        ),
    ),
    min_size=1,
    max_size=24,
)


class _RefusingRelease:
    """The prefill's real NIXL transport, except that its next `refusals` releases (aborts
    of a WRITE past its deadline) are refused, as NIXL does for a transfer it cannot stop
    at that moment."""

    def __init__(self, inner: NixlTransport) -> None:
        self.inner = inner
        self.agent_name = inner.agent_name
        self.refusals = 0

    def release(self, handle: Any) -> bool:
        if self.refusals > 0:
            self.refusals -= 1
            return False
        return self.inner.release(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Case:
    """One generated case: a prefill and a decode connector over the module's agents."""

    def __init__(self, agents: Agents) -> None:
        self.a = agents
        self.n = next(_case)
        self.clock = FakeClock()
        for t in agents.all():  # what an earlier case left in flight is not this one's
            t.get_notifs()
        cfg = PushConfig(
            registration_timeout_s=2.0,
            kv_lease_s=3.0,
            transfer_timeout_s=2.0,
            cancel_margin_s=0.5,
            greet_peers=False,
        )
        self.p_reg = EngineRegistry(remove_agent=lambda name: None, clock=self.clock)
        self.p_reg.add_engine("dec", {0: agents.decode.agent_name})
        self.d_reg = EngineRegistry(remove_agent=lambda name: None, clock=self.clock)
        self.d_reg.add_engine("pre", {0: agents.prefill.agent_name})
        self.p_transport = _RefusingRelease(agents.prefill)
        self.prefill = self._connector("pre", "prefill", self.p_transport, self.p_reg, cfg)
        self.p_stopped = False
        self.decode = self._connector("dec", "decode", agents.decode, self.d_reg, cfg)
        self.replaced = False
        self.free = list(range(BLOCKS))
        self.blocks: dict[str, list[int]] = {}
        self.d_out: dict[str, str] = {}
        self.p_out: dict[str, str] = {}
        self.d_taken: set[str] = set()
        self.p_taken: set[str] = set()
        self.late = 0
        kv = agents.kv[agents.prefill.agent_name]
        for b in range(BLOCKS):
            kv[b].fill_(b + 1)  # every prefill block holds non-zero bytes
        for name in (agents.decode.agent_name, agents.successor.agent_name):
            agents.kv[name].zero_()

    def _connector(
        self, engine: str, role: str, t: Any, reg: EngineRegistry, cfg: PushConfig
    ) -> PushConnector:
        return new_connector(
            engine_id=engine,
            role=role,  # type: ignore[arg-type]
            transport=t,
            registry=reg,
            metrics=WorkerMetrics(),
            config=cfg,
            clock=self.clock,
            wall_clock=self.clock,
            block_len=BLOCK,
        )

    def rid(self, i: int) -> str:
        return f"c{self.n}-r{i}"

    # --- the decode's memory guard -------------------------------------------------------

    def _decode_kv(self) -> torch.Tensor:
        return self.a.kv[self.a.decode.agent_name]

    def _check_free(self) -> None:
        kv = self._decode_kv()
        self.late += sum(int(kv[b].any()) for b in self.free)
        for b in self.free:
            kv[b].zero_()

    def _collect(self) -> None:
        fin = self.decode.get_finished()
        for rid in fin.done_receiving:
            self._end_d(rid, "done")
        for f in fin.failed:
            self._end_d(f.request_id, "failed")
        fin = self.prefill.get_finished()
        for rid in fin.done_sending:
            self._end_p(rid, "done")
        for f in fin.failed:
            self._end_p(f.request_id, "failed")

    def _end_d(self, rid: str, outcome: str) -> None:
        assert rid not in self.d_out, f"decode ended {rid} twice"
        self.d_out[rid] = outcome
        blocks = self.blocks.pop(rid)
        kv = self._decode_kv()
        if outcome == "done":  # its bytes are the prefill's blocks' (b + 1 each)
            for b in blocks:
                assert bool((kv[b] != 0).all()), f"{rid} done without its bytes"
        for b in blocks:
            kv[b].zero_()
        self.free += blocks

    def _end_p(self, rid: str, outcome: str) -> None:
        assert rid not in self.p_out, f"prefill ended {rid} twice"
        self.p_out[rid] = outcome

    # --- steps ---------------------------------------------------------------------------

    def step(self, op: str, i: int) -> None:
        rid = self.rid(i)
        if op == "submit" and rid not in self.d_taken:
            if len(self.free) < PER_REQUEST:
                return
            self._check_free()
            blocks = [self.free.pop(0) for _ in range(PER_REQUEST)]
            self.blocks[rid] = blocks
            self.decode.request_receive(rid, "pre", blocks)
            self.d_taken.add(rid)
            self.decode.flush_registrations()
        elif op == "ready" and rid not in self.p_taken and not self.p_stopped:
            self.prefill.request_send(rid, [2 * i, 2 * i + 1], "dec")
            self.p_taken.add(rid)
        elif op == "abort_d":
            self.decode.abandon(rid, FailureType.ABORTED, "abort")
        elif op == "abort_p":
            self.prefill.abandon(rid, FailureType.ABORTED, "abort")
        elif op == "pump_d":
            self.decode.flush_registrations()
            self._pump(self.decode)
        elif op == "pump_p" and not self.p_stopped:
            self._pump(self.prefill)
        elif op == "drain_d":  # the decode engine's drain deadline: what it holds given up
            for held in sorted(self.d_taken - set(self.d_out)):
                self.decode.abandon(held, FailureType.SHUTDOWN, "drain deadline")
        elif op == "drain_p":
            for held in sorted(self.p_taken - set(self.p_out)):
                self.prefill.abandon(held, FailureType.SHUTDOWN, "drain deadline")
        elif op == "stop_p" and not self.p_stopped:  # the prefill engine stops for good
            self.p_stopped = True
            self.prefill.stop()
        elif op == "refuse_release":
            self.p_transport.refusals += 1
        elif op == "later":
            self.clock.advance(0.7)
        elif op == "much_later":
            self.clock.advance(2.5)
        elif op == "replace" and not self.replaced:
            # The decode engine restarted under its id: the prefill drops the old process's
            # agent (deferred while a WRITE to it is in flight) and adds the new one.
            self.replaced = True
            if self.p_reg.evict("dec", "restarted") == "evicted":
                self.p_reg.add_engine("dec", {0: self.a.successor.agent_name}, "b")
        self._collect()

    @staticmethod
    def _pump(conn: PushConnector) -> None:
        """Passes of one side until what its peer sent so far has arrived (UCX delivers
        within a few polls on loopback; the deadline bounds a pass that finds nothing)."""
        deadline = time.monotonic() + 0.01
        while True:
            conn.progress_once()
            if time.monotonic() >= deadline:
                return

    def settle(self) -> None:
        """Time passes until every request has ended on both sides."""
        for _ in range(400):
            self.clock.advance(0.25)
            self.decode.flush_registrations()
            self.decode.progress_once()
            if not self.p_stopped:
                self.prefill.progress_once()
            # A replacement deferred by a WRITE in flight is done once the WRITE ended.
            if self.replaced and "dec" not in self.p_reg:
                self.p_reg.add_engine("dec", {0: self.a.successor.agent_name}, "b")
            self._collect()
            if self.decode.in_flight() == 0 and self.prefill.in_flight() == 0:
                break
        for conn in (self.decode, self.prefill):
            conn.stop()
        self._collect()
        self._check_free()

    def check(self) -> None:
        assert self.decode.in_flight() == 0 and self.prefill.in_flight() == 0
        assert set(self.d_out) == self.d_taken, "a decode request never ended"
        assert set(self.p_out) == self.p_taken, "a prefill request never ended"
        for rid in self.d_taken & self.p_taken:
            assert self.d_out[rid] == self.p_out[rid], (rid, self.d_out[rid], self.p_out[rid])
        for rid in self.p_taken - self.d_taken:
            assert self.p_out[rid] == "failed", f"{rid} written though nobody asked"
        for rid in self.d_taken - self.p_taken:
            assert self.d_out[rid] == "failed", f"{rid} done though its KV never existed"
        assert self.late == 0, f"{self.late} blocks written after the decode let them go"
        successor = self.a.kv[self.a.successor.agent_name]
        assert not bool(successor.any()), "the old process's request landed in its successor"


@settings(
    max_examples=CASES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(script=steps)
def test_no_write_lands_after_the_decode_let_go_and_both_sides_agree(
    agents: Agents, script: list[Step]
) -> None:
    case = Case(agents)
    for op, i in script:
        case.step(op, i)
    case.settle()
    case.check()
