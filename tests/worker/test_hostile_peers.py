"""Peers that lie: real `kvtopo-worker` processes over real NIXL (UCX, CPU, loopback)
against a fake peer's control API serving crafted metadata, and a rogue NIXL agent in the
test process sending notifications under nobody's or somebody else's name."""

from __future__ import annotations

import collections
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvtopo_worker.protocol import (
    decode_metadata,
)
from tests.worker.fakes import MetadataPeer
from tests.worker.workers import WorkerProcess, forged_answers, rogue_agent, start_worker

pytestmark = pytest.mark.nixl

BLOCK = 64 * 1024
OPTS = (
    "--num-blocks",
    "64",
    "--block-bytes",
    str(BLOCK),
    "--registration-timeout",
    "4",
    "--kv-lease",
    "10",
    "--progress-thread",
    "off",
)


@pytest.fixture
def crafted() -> Iterator[MetadataPeer]:
    peer = MetadataPeer()
    yield peer
    peer.close()


@pytest.fixture
def workers(token_file: Path, tmp_path: Path) -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for name, role in (("p", "prefill"), ("d", "decode"), ("d2", "decode")):
            started[name] = start_worker(role, token_file, tmp_path, *OPTS)
        yield started
    finally:
        for w in started.values():
            w.stop()


def recraft(raw: bytes, **changes: Any) -> bytes:
    """`raw` metadata with payload fields changed (the envelope's hash kept valid)."""
    envelope = msgspec.msgpack.decode(raw)
    envelope["payload"].update(changes)
    return msgspec.msgpack.encode(envelope)


class _Bomb:
    """Unpickling this creates a file: proof that a peer's bytes were unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def wait_for(predicate: Any, timeout: float = 15, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)


def test_nothing_a_peer_sends_is_unpickled(
    workers: dict[str, WorkerProcess], crafted: MetadataPeer, tmp_path: Path
) -> None:
    p, d = workers["p"], workers["d"]
    marker = tmp_path / "unpickled-by-the-worker"
    bomb = pickle.dumps(_Bomb(marker))
    # A real prefill's metadata (its NIXL blob is genuine) under a new engine id, every
    # descriptor-ish field replaced by a pickle whose loading creates `marker`.
    crafted.payload = recraft(
        p.raw_metadata(), engine_id="evil", agent_name="evil-agent", kv_descs=bomb
    )
    status, body = d.call(
        "PUT", "/v1/peers/evil", {"endpoint": crafted.endpoint, "role": "prefill"}
    )
    assert not marker.exists(), "a peer's bytes were unpickled inside the worker"
    assert status in (409, 502), body
    assert d.proc.poll() is None and d.state()["peers"] == []


def test_a_peer_carrying_another_engines_nixl_blob_is_refused(
    workers: dict[str, WorkerProcess], crafted: MetadataPeer
) -> None:
    p, d = workers["p"], workers["d"]
    d.connect(p)
    p.connect(d)
    raw = p.raw_metadata()
    # The same blob under another engine id: once with its true agent name, once with a
    # made-up one. Neither may be registered (evicting it would tear down p's agent).
    for agent_name in (None, "kvtopo-evil"):
        changes: dict[str, Any] = {"engine_id": "evil"}
        if agent_name is not None:
            changes["agent_name"] = agent_name
        crafted.payload = recraft(raw, **changes)
        status, body = d.call(
            "PUT", "/v1/peers/evil", {"endpoint": crafted.endpoint, "role": "prefill"}
        )
        assert status == 409, body
        assert body["failure_type"] == "handshake_failed", body
        d.call("DELETE", "/v1/peers/evil")
    assert [peer["engine_id"] for peer in d.state()["peers"]] == [p.engine_id]
    # p's agent is untouched: traffic still flows.
    assert p.submit("after-evil", d, 2) == 202
    assert d.submit("after-evil", p, 2) == 202
    outcomes = wait_for(lambda: d.drain() or None)
    assert outcomes and outcomes[0]["status"] == "done", outcomes


def test_completions_and_failures_from_agents_not_paired_are_dropped(
    workers: dict[str, WorkerProcess],
) -> None:
    p, d = workers["p"], workers["d"]
    d.connect(p)
    p.connect(d)
    rogue, (d_agent,) = rogue_agent([d], block=BLOCK)
    try:
        assert d.submit("r-done", p, 2) == 202
        assert d.submit("r-fail", p, 2) == 202
        for data in forged_answers(p.engine_id):
            rogue.send_notif(d_agent, data)

        def rejected() -> int:
            rogue.get_notifs()
            return int(d.state()["failures"].get("malformed_message", 0)) >= 2 or bool(d.drain())

        wait_for(rejected, timeout=3)
        assert d.outcomes == [], f"a forged notification ended a request: {d.outcomes}"
        # The real prefill then serves both.
        assert p.submit("r-done", d, 2) == 202
        assert p.submit("r-fail", d, 2) == 202
        wait_for(lambda: d.drain() and len(d.outcomes) >= 2)
        assert sorted((o["request_id"], o["status"]) for o in d.outcomes) == [
            ("r-done", "done"),
            ("r-fail", "done"),
        ]
    finally:
        rogue.close()


def test_a_second_decode_registering_the_same_request_id_does_not_take_the_write(
    workers: dict[str, WorkerProcess],
) -> None:
    p, d, d2 = workers["p"], workers["d"], workers["d2"]
    for dec in (d, d2):
        dec.connect(p)
        p.connect(dec)
    assert p.submit("shared", d, 3) == 202  # paired with d
    assert d2.submit("shared", p, 3) == 202  # d2 claims it first
    assert d.submit("shared", p, 3) == 202
    wait_for(lambda: (d.drain(), d2.drain(), p.drain()) and d.outcomes and d2.outcomes)
    assert [(o["status"], o["verified_bytes"]) for o in d.outcomes] == [("done", 3 * BLOCK)]
    assert [o["status"] for o in d2.outcomes] == ["failed"], d2.outcomes
    assert d2.outcomes[0]["reason"] == "remote_rejected", d2.outcomes
    wait_for(lambda: p.drain() or p.outcomes)
    assert collections.Counter(o["status"] for o in p.outcomes) == {"done": 1}


def _compat_of(w: WorkerProcess) -> Any:
    return decode_metadata(w.raw_metadata(), w.state()["compat_hash"]).compat


def test_a_peer_describing_millions_of_blocks_is_refused_at_once_and_stalls_no_one(
    workers: dict[str, WorkerProcess], crafted: MetadataPeer
) -> None:
    """Metadata at the protocol's limit (2^24 blocks) used to build 16M descriptors in
    Python under the data path's lock, stalling that rank's requests for many seconds. A
    peer may describe no more blocks than this engine's size allows (16x its own), and
    descriptors are built off the lock: another pair's requests go on."""
    import torch

    from kvtopo_worker.transport import NixlTransport

    p, d = workers["p"], workers["d"]
    d.connect(p)
    p.connect(d)
    # A process of its own (its NIXL blob names its own agent) that claims 2^24 blocks.
    rogue = NixlTransport("kvtopo-huge", progress_thread=False)
    rogue.register_kv_cache(torch.zeros((4, BLOCK), dtype=torch.uint8))
    own = rogue.describe(engine_id="huge", role="prefill", compat=_compat_of(p))
    crafted.payload = recraft(
        p.raw_metadata(),
        engine_id="huge",
        agent_name=own.agent_name,
        agent_metadata=own.agent_metadata,
        kv_addr=own.kv_addr,
        num_blocks=1 << 24,
        notif_key=own.notif_key,
    )
    latencies: list[float] = []
    stop = False

    def traffic() -> None:
        i = 0
        while not stop:
            rid = f"during-{i}"
            t0 = time.monotonic()
            assert d.submit(rid, p, 1) == 202 and p.submit(rid, d, 1) == 202
            while not any(o["request_id"] == rid for o in d.outcomes):
                d.drain()
            latencies.append(time.monotonic() - t0)
            i += 1

    import threading

    runner = threading.Thread(target=traffic)
    runner.start()
    try:
        answers = [
            d.call("PUT", "/v1/peers/huge", {"endpoint": crafted.endpoint, "role": "prefill"})
            for _ in range(5)
        ]
    finally:
        stop = True
        runner.join(30)
        rogue.close()
    for status, body in answers:
        assert status == 502 and "may describe at most" in body["message"], body
    assert all(o["status"] == "done" for o in d.outcomes)
    latencies.sort()
    assert latencies and latencies[-1] < 2.0, f"another pair stalled {latencies[-1]:.2f} s"
