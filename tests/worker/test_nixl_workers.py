"""Two real `kvtopo-worker` processes pushing KV over real NIXL (UCX, CPU, loopback)."""

from __future__ import annotations

import collections
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.workers import WorkerProcess, start_worker

pytestmark = pytest.mark.nixl

BLOCK = 64 * 1024
BLOCKS_PER_REQUEST = 4


@pytest.fixture
def pair(token_file: Path, tmp_path: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    opts = (
        "--num-blocks",
        "256",
        "--block-bytes",
        str(BLOCK),
        "--registration-timeout",
        "3",
        "--kv-lease",
        "10",
        "--transfer-timeout",
        "3",
        "--progress-thread",
        "off",
    )
    p = start_worker("prefill", token_file, tmp_path, *opts)
    d = start_worker("decode", token_file, tmp_path, *opts)
    try:
        d.connect(p)
        p.connect(d)
        yield p, d
    finally:
        for w in (p, d):
            w.stop()


def stream(
    p: WorkerProcess,
    d: WorkerProcess,
    n: int,
    window: int = 24,
    stop_after_done: int | None = None,
    on_stop: object = None,
    deadline_s: float = 120,
) -> tuple[list[str], set[str]]:
    """Streams requests P -> D keeping `window` in flight; returns (submitted, done on D)."""
    submitted: list[str] = []
    ended_d: set[str] = set()
    end = time.monotonic() + deadline_s
    i = 0
    stopped = False
    while time.monotonic() < end:
        for o in d.drain():
            assert o["request_id"] not in ended_d, f"request {o['request_id']} ended twice"
            ended_d.add(o["request_id"])
        if not stopped:
            p.drain()
        if stop_after_done is not None and not stopped and len(ended_d) >= stop_after_done:
            stopped = True
            on_stop()  # type: ignore[operator]
        while not stopped and i < n and len(submitted) - len(ended_d) < window:
            rid = f"req-{i}"
            i += 1
            if p.submit(rid, d, BLOCKS_PER_REQUEST) != 202:
                continue
            assert d.submit(rid, p, BLOCKS_PER_REQUEST) == 202
            submitted.append(rid)
        if (stopped or i >= n) and len(ended_d) == len(submitted):
            break
        time.sleep(0.002)
    return submitted, ended_d


def test_thousand_requests_every_byte_verified(pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    p, d = pair
    submitted, ended = stream(p, d, 1000)
    assert len(submitted) == 1000 and ended == set(submitted)
    done = [o for o in d.outcomes if o["status"] == "done"]
    assert len(done) == 1000, collections.Counter(o.get("reason") for o in d.outcomes)
    assert all(o["verified_bytes"] == BLOCKS_PER_REQUEST * BLOCK for o in done)
    # The prefill side ended every request exactly once too.
    deadline = time.monotonic() + 10
    while len(p.outcomes) < 1000 and time.monotonic() < deadline:
        p.drain()
    assert collections.Counter(o["status"] for o in p.outcomes) == {"done": 1000}
    assert len({o["request_id"] for o in p.outcomes}) == 1000
    state = d.state()
    assert state["requests_done"] == 1000 and state["requests_failed"] == 0
    assert state["failures"] == {}


def test_killing_prefill_mid_stream_fails_in_flight_requests_once(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    p, d = pair
    parked: list[str] = []

    def kill_prefill() -> None:
        # Requests whose registrations reach P before their KV is ready: surely in flight.
        for i in range(16):
            rid = f"parked-{i}"
            assert d.submit(rid, p, BLOCKS_PER_REQUEST) == 202
            parked.append(rid)
        p.proc.send_signal(signal.SIGKILL)

    submitted, ended = stream(
        p, d, 10_000, window=32, stop_after_done=150, on_stop=kill_prefill, deadline_s=60
    )
    submitted += parked
    deadline = time.monotonic() + 15
    while ended != set(submitted) and time.monotonic() < deadline:
        ended.update(o["request_id"] for o in d.drain())
        time.sleep(0.05)
    assert p.proc.wait(10) == -signal.SIGKILL
    assert ended == set(submitted), "every request submitted to decode must end"
    by_id = collections.Counter(o["request_id"] for o in d.outcomes)
    assert max(by_id.values()) == 1, "a request ended twice"
    failed = [o for o in d.outcomes if o["status"] == "failed"]
    assert {o["request_id"] for o in failed} >= set(parked), "in-flight requests must fail"
    assert all(
        o["reason"] in ("registration_timeout", "push_reg_notif_failed") and o["message"]
        for o in failed
    ), failed[:3]
    assert all(
        o["verified_bytes"] == BLOCKS_PER_REQUEST * BLOCK
        for o in d.outcomes
        if o["status"] == "done"
    )
    # The decode worker survives and can drop the dead peer.
    assert d.proc.poll() is None
    assert urllib.request.urlopen(d.url + "/healthz", timeout=5).status == 200
    status, body = d.call("DELETE", f"/v1/peers/{p.engine_id}")
    assert status == 200 and body["result"] in ("evicted", "deferred")
    assert d.state()["requests_in_flight"] == 0


def test_idle_worker_uses_under_two_percent_of_a_core(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    p, d = pair
    time.sleep(0.5)  # let start-up work settle before measuring (not synchronisation)
    before = {w.role: w.cpu_seconds() for w in (p, d)}
    t0 = time.monotonic()
    time.sleep(5)
    elapsed = time.monotonic() - t0
    for w in (p, d):
        share = (w.cpu_seconds() - before[w.role]) / elapsed
        assert share < 0.02, f"idle {w.role} worker used {share:.1%} of a core"


def test_garbage_notifications_over_nixl_are_counted_and_survived(
    pair: tuple[WorkerProcess, WorkerProcess], tmp_path: Path
) -> None:
    """A peer that speaks NIXL but sends garbage: the workers count it and keep serving.
    From an agent they never added nothing even opens (counted as `unknown_agent`); from a
    peer they hold, sealed properly, it opens and is refused as malformed."""
    import msgspec
    import torch

    from kvtopo_worker.protocol import REG_PREFIX, decode_metadata, encode_metadata
    from kvtopo_worker.transport import NixlTransport
    from tests.worker.fakes import MetadataPeer

    p, d = pair
    garbage = [
        b"",
        b"\x00" * 32,
        REG_PREFIX + b"\xff\xfe",
        b"PUSH_DONE:\x93\x01\x02",
        REG_PREFIX + b"\x85" + b"\xa1x" * 5,
        b"PUSH_FAIL:not msgpack",
    ]

    def count(source: str) -> dict[str, int]:
        return {w.role: w.rejected(source) for w in (p, d)}

    def sent_all(rogue: NixlTransport, source: str) -> dict[str, int]:
        deadline = time.monotonic() + 10
        counts: dict[str, int] = {}
        while time.monotonic() < deadline:
            rogue.get_notifs()  # drive our side's progress (progress thread off)
            counts = count(source)
            if all(c >= len(garbage) for c in counts.values()):
                break
            time.sleep(0.05)
        return counts

    stranger = NixlTransport("kvtopo-stranger", progress_thread=False)
    held = NixlTransport("kvtopo-held-rogue", progress_thread=False)
    served = MetadataPeer()
    try:
        stranger.register_kv_cache(torch.zeros((4, BLOCK), dtype=torch.uint8))
        targets = [
            stranger.add_remote_peer(decode_metadata(w.raw_metadata(), w.state()["compat_hash"]))
            for w in (p, d)
        ]
        for agent in targets:
            for g in garbage:
                stranger.send_notif(agent, g)
        assert sent_all(stranger, "unknown_agent") == {"prefill": 6, "decode": 6}
        assert {w.role: w.state()["failures"].get("malformed_message", 0) for w in (p, d)} == {
            "prefill": 0,
            "decode": 0,
        }
        # A peer each worker holds (it added the rogue's metadata), sending sealed garbage.
        held.register_kv_cache(torch.zeros((4, BLOCK), dtype=torch.uint8))
        agents = []
        for w, role in ((p, "decode"), (d, "prefill")):
            compat = decode_metadata(w.raw_metadata(), w.state()["compat_hash"]).compat
            meta = held.describe(engine_id=f"rogue-{role}", role=role, compat=compat)
            served.payload = encode_metadata(meta)
            status, body = w.call(
                "PUT", f"/v1/peers/rogue-{role}", {"endpoint": served.endpoint, "role": role}
            )
            assert status == 200, body
            agents.append(
                held.add_remote_peer(decode_metadata(w.raw_metadata(), w.state()["compat_hash"]))
            )
        for agent in agents:
            for g in garbage:
                held.send_notif(agent, g)
        assert sent_all(held, "notification") == {"prefill": 6, "decode": 6}
        assert msgspec.json.encode(count("unauthenticated")) == b'{"prefill":0,"decode":0}'
    finally:
        stranger.close()
        held.close()
        served.close()
    # Both still serve real traffic afterwards.
    submitted, ended = stream(p, d, 20)
    assert ended == set(submitted) and len(submitted) == 20
    assert all(o["status"] == "done" for o in d.outcomes)


def test_submits_with_bad_ids_or_no_blocks_are_refused_at_once(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    # Accepted, they would fail on both sides only at their timeouts.
    p, d = pair
    for w, peer in ((p, d), (d, p)):
        for request_id, peer_id, blocks in (
            ("", peer.engine_id, 1),
            ("r" * 300, peer.engine_id, 1),
            ("ok", "", 1),
            ("ok", peer.engine_id, 0),
            ("ok", peer.engine_id, -1),
        ):
            status, body = w.call(
                "POST",
                "/v1/requests",
                {"request_id": request_id, "peer_engine_id": peer_id, "num_blocks": blocks},
            )
            assert status == 400 and body["error"] == "bad_request", (request_id, blocks, body)
        assert w.state()["requests_in_flight"] == 0
