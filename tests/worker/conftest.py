"""Worker unit-test fixtures: real EngineRegistry and PushConnector, fake transport and clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.push import PushConfig, PushConnector, new_connector
from kvtopo_worker.registry import EngineRegistry
from tests.worker.fakes import FakeClock, FakeTransport

PREFILL = "prefill-engine-1"
DECODE = "decode-engine-1"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def transport() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def registry(transport: FakeTransport, clock: FakeClock) -> EngineRegistry:
    return EngineRegistry(remove_agent=transport.remove_remote, clock=clock)


def make_connector(
    role: str,
    transport: FakeTransport,
    registry: EngineRegistry,
    clock: FakeClock,
    **config: float,
) -> PushConnector:
    return new_connector(
        engine_id=DECODE if role == "decode" else PREFILL,
        role=role,  # type: ignore[arg-type]
        transport=transport,
        registry=registry,
        metrics=WorkerMetrics(),
        config=PushConfig(**{"greet_peers": False, **config}),
        clock=clock,
        wall_clock=clock,
        block_len=transport.block_len,
    )


@pytest.fixture
def decode(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock
) -> Iterator[PushConnector]:
    conn = make_connector("decode", transport, registry, clock, registration_timeout_s=5.0)
    yield conn
    conn.stop()


@pytest.fixture
def prefill(
    transport: FakeTransport, registry: EngineRegistry, clock: FakeClock
) -> Iterator[PushConnector]:
    conn = make_connector("prefill", transport, registry, clock, kv_lease_s=5.0)
    yield conn
    conn.stop()


def add_engine(transport: FakeTransport, registry: EngineRegistry, engine_id: str) -> str:
    agent = f"agent-{engine_id}"
    transport.add_agent(agent)
    registry.add_engine(engine_id, {0: agent})
    return agent


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """The client token file shared by a test's real worker processes (their traffic
    routes' bearer token); the operator's key pair, which their admin routes take calls
    signed with, is made beside it (`kvtopo.localkeys.Credentials.beside`)."""
    f = tmp_path / "token"
    f.write_text("integration-token\n")
    return f
