"""Add, evict, deferred eviction and teardown of one engine, interleaved at random, never
leave the registry and NIXL disagreeing. Real NIXL agents (UCX, in this process), real
ControlServers on loopback, a real EngineRegistry; hypothesis picks what each of three
threads does, the scheduler how their steps interleave."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtopo_worker.agent import ControlServer, LocalEngine
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import CompatInfo
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.transport import NixlTransport
from tests.worker.test_agent import OPERATOR_KEYS, call, serving

pytestmark = pytest.mark.nixl

BLOCKS, BLOCK_LEN = 4, 256


@dataclass
class Side:
    transport: NixlTransport
    registry: EngineRegistry
    server: ControlServer

    @property
    def url(self) -> str:
        return f"http://{self.server.endpoint}"


def make_side(engine_id: str, role: str) -> Side:
    import torch

    transport = NixlTransport(f"kvtopo-race-{engine_id}", progress_thread=False)
    transport.register_kv_cache(torch.zeros((BLOCKS, BLOCK_LEN), dtype=torch.uint8))
    meta = transport.describe(
        engine_id=engine_id,
        role=role,  # type: ignore[arg-type]
        compat=CompatInfo(block_len=BLOCK_LEN),
    )

    def slow_teardown(agent_name: str) -> None:
        # A teardown that takes a while (UCX closing endpoints): widens the window in which
        # a re-add can meet an agent that is on its way out.
        time.sleep(0.005)
        transport.remove_remote(agent_name)

    registry = EngineRegistry(remove_agent=slow_teardown)
    server = ControlServer(
        engine=LocalEngine(engine_id, role, meta, time.time()),  # type: ignore[arg-type]
        registry=registry,
        transport=transport,
        operator_keys=OPERATOR_KEYS,
        metrics=WorkerMetrics(),
    )
    server.start()
    serving(server)
    return Side(transport, registry, server)


@pytest.fixture(scope="module")
def sides() -> Iterator[tuple[Side, Side]]:
    local, peer = make_side("race-decode", "decode"), make_side("race-prefill", "prefill")
    yield local, peer
    for side in (local, peer):
        side.server.stop()
        side.transport.close()


def agree(side: Side) -> tuple[set[str], set[str]]:
    """(agents the registry names, agents NIXL has prepped)."""
    named = {
        agent
        for eid in side.registry.engine_ids()
        for agent in side.registry.snapshot(eid).values()
    }
    return named, set(side.transport.remote_names())


OPS = st.sampled_from(["put", "delete", "pin", "idle_evict"])


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(OPS, min_size=1, max_size=6), min_size=3, max_size=3))
def test_random_interleavings_keep_registry_and_nixl_in_agreement(
    sides: tuple[Side, Side], plans: list[list[str]]
) -> None:
    local, peer = sides
    peer_id = peer.server.engine.engine_id
    put_body = {"endpoint": peer.server.endpoint, "role": "prefill"}
    errors: list[str] = []

    def run(plan: list[str]) -> None:
        for op in plan:
            if op == "put":
                status, body = call("PUT", f"{local.url}/v1/peers/{peer_id}", put_body)
                if status != 200:
                    errors.append(f"PUT answered {status}: {body}")
            elif op == "delete":
                status, body = call("DELETE", f"{local.url}/v1/peers/{peer_id}")
                if status != 200:
                    errors.append(f"DELETE answered {status}: {body}")
            elif op == "pin":  # a WRITE in flight: evictions meanwhile are deferred
                if local.registry.begin_transfer(peer_id) is not None:
                    time.sleep(0.002)  # the WRITE's length (the fault window), not a wait
                    local.registry.end_transfer(peer_id)
            else:
                local.registry.evict(peer_id, reason="idle_ttl")

    threads = [threading.Thread(target=run, args=(plan,)) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    named, prepped = agree(local)
    assert named == prepped, f"registry names {named}, NIXL has {prepped}"
    # Whatever happened, a PUT now makes the peer present on both sides, usable, and a
    # pending eviction does not survive it.
    status, body = call("PUT", f"{local.url}/v1/peers/{peer_id}", put_body)
    assert status == 200, body
    named, prepped = agree(local)
    assert named == prepped == set(local.registry.snapshot(peer_id).values()) != set()
    assert not any(p.eviction_pending for p in local.registry.peer_states())


def test_a_put_cancels_a_deferred_eviction(sides: tuple[Side, Side]) -> None:
    local, peer = sides
    peer_id = peer.server.engine.engine_id
    put_body = {"endpoint": peer.server.endpoint, "role": "prefill"}
    assert call("PUT", f"{local.url}/v1/peers/{peer_id}", put_body)[0] == 200
    assert local.registry.begin_transfer(peer_id) is not None
    assert call("DELETE", f"{local.url}/v1/peers/{peer_id}")[1]["result"] == ("deferred")
    status, body = call("PUT", f"{local.url}/v1/peers/{peer_id}", put_body)
    assert (status, body["result"]) == (200, "present")
    assert local.registry.begin_transfer(peer_id) is not None, "new WRITEs must be allowed"
    local.registry.end_transfer(peer_id)
    local.registry.end_transfer(peer_id)  # the WRITE in flight ends: no eviction follows
    assert peer_id in local.registry
    assert agree(local)[0] == agree(local)[1] != set()
