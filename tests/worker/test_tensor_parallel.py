"""TP > 1: `kvtopo-worker --tp 2` runs two ranks, each with its own NIXL agent and KV cache;
rank r of the decode pairs with rank r of the prefill, a request ends when every rank has,
and handshakes and evictions work per (engine, rank). Real processes, real NIXL."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.workers import WorkerProcess, start_worker

pytestmark = pytest.mark.nixl

BLOCK = 16 * 1024
OPTS = (
    "--num-blocks",
    "128",
    "--block-bytes",
    str(BLOCK),
    "--registration-timeout",
    "3",
    "--transfer-timeout",
    "3",
    "--kv-lease",
    "3",
    "--progress-thread",
    "off",
)


@pytest.fixture
def tp2(token_file: Path, tmp_path: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    started: list[WorkerProcess] = []
    try:
        for role in ("prefill", "decode"):
            started.append(start_worker(role, token_file, tmp_path, *OPTS, "--tp", "2"))
        yield started[0], started[1]
    finally:
        for w in started:
            w.stop()


def run_requests(p: WorkerProcess, d: WorkerProcess, ids: list[str], blocks: int) -> None:
    for rid in ids:
        assert p.submit(rid, d, blocks) == 202
        assert d.submit(rid, p, blocks) == 202
    deadline = time.monotonic() + 60

    def ended(w: WorkerProcess) -> set[str]:
        return {o["request_id"] for o in w.outcomes} & set(ids)

    while len(ended(p)) < len(ids) or len(ended(d)) < len(ids):
        assert time.monotonic() < deadline, (ended(p), ended(d))
        p.drain()
        d.drain()
        time.sleep(0.02)


def test_two_ranks_each_push_their_own_bytes_and_a_request_ends_when_both_have(
    tp2: tuple[WorkerProcess, WorkerProcess],
) -> None:
    p, d = tp2
    added = d.connect(p)
    assert sorted(added["agents"]) == ["0", "1"], added
    assert sorted(p.connect(d)["agents"]) == ["0", "1"]
    assert d.state()["tp_size"] == 2
    ids = [f"tp-{i}" for i in range(60)]
    run_requests(p, d, ids, 3)
    assert collections.Counter(o["status"] for o in d.outcomes) == {"done": 60}, d.outcomes[:3]
    # Both ranks' bytes (each rank holds other bytes) verified on every request.
    assert {o["verified_bytes"] for o in d.outcomes} == {3 * BLOCK * 2}
    assert collections.Counter(o["status"] for o in p.outcomes) == {"done": 60}
    assert len({o["request_id"] for o in d.outcomes}) == 60


def test_peers_of_another_tp_size_are_refused(
    tp2: tuple[WorkerProcess, WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    _, d = tp2
    single = start_worker("prefill", token_file, tmp_path, *OPTS)
    try:
        status, body = d.call(
            "PUT", f"/v1/peers/{single.engine_id}", {"endpoint": single.endpoint, "role": "prefill"}
        )
        assert status == 409 and body["failure_type"] == "incompatible", body
        assert "TP ranks" in body["message"]
        assert d.state()["peers"] == []
    finally:
        single.stop()


def test_handshakes_and_evictions_per_rank(tp2: tuple[WorkerProcess, WorkerProcess]) -> None:
    p, d = tp2
    body = {"endpoint": p.endpoint, "role": "prefill"}
    for rank in (0, 1):
        status, answer = d.call("PUT", f"/v1/peers/{p.engine_id}", {**body, "rank": rank})
        assert (status, answer["result"]) == (200, "added"), answer
        assert str(rank) in answer["agents"]
    status, answer = d.call("PUT", f"/v1/peers/{p.engine_id}", body)
    assert (status, answer["result"], sorted(answer["agents"])) == (200, "present", ["0", "1"])
    p.connect(d)
    status, answer = d.call("DELETE", f"/v1/peers/{p.engine_id}?rank=1")
    assert (status, answer["result"]) == (200, "evicted"), answer
    (peer,) = d.state()["peers"]
    assert sorted(peer["agents"]) == ["0"]
    # Rank 1 cannot register: the request fails on both sides (never done on one only).
    run_requests(p, d, ["half"], 2)
    assert [o["status"] for o in d.outcomes] == ["failed"], d.outcomes
    assert [o["status"] for o in p.outcomes] == ["failed"], p.outcomes
    # Re-adding rank 1 repairs it.
    status, answer = d.call("PUT", f"/v1/peers/{p.engine_id}", body)
    assert (status, answer["result"], sorted(answer["agents"])) == (200, "added", ["0", "1"])
    run_requests(p, d, ["whole"], 2)
    assert d.outcomes[-1]["status"] == "done", d.outcomes
    assert p.outcomes[-1]["status"] == "done", p.outcomes
