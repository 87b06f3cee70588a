"""Draining is an engine state: real `kvtopo-worker` processes over real NIXL.

The drill lost a request when a decode engine began to drain between the traffic
generator's two submits (prefill accepted, decode accepted after the drill's last collect,
then the process stopped): nothing ever collected its outcome. These tests put a drain
exactly there and stop engines that still hold requests; every request must end once, done
or failed with a reason, and be collected before the process exits.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtopo.cluster.deadlines import wait_until
from tests.worker.workers import WorkerProcess, start_worker

pytestmark = pytest.mark.nixl

OPTS = ("--num-blocks", "64", "--block-bytes", "4096", "--progress-thread", "off")


@pytest.fixture
def pair(token_file: Path, tmp_path: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    timeouts = ("--registration-timeout", "3", "--kv-lease", "3", "--transfer-timeout", "3")
    p = start_worker("prefill", token_file, tmp_path, *OPTS, *timeouts)
    d = start_worker("decode", token_file, tmp_path, *OPTS, *timeouts)
    try:
        d.connect(p)
        p.connect(d)
        yield p, d
    finally:
        for w in (p, d):
            w.stop()


def outcomes_of(w: WorkerProcess, request_id: str) -> list[dict[str, Any]]:
    return [o for o in w.outcomes if o["request_id"] == request_id]


def ended(w: WorkerProcess, request_id: str) -> list[dict[str, Any]] | None:
    """Collects `w`'s outcomes; the request's once it has one."""
    w.drain()
    return outcomes_of(w, request_id) or None


def test_an_engine_that_drains_between_the_two_submits_refuses_the_second(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    p, d = pair
    assert p.submit("r1", d, 2) == 202 and d.submit("r1", p, 2) == 202
    # The decode engine begins to drain after the prefill side took r2, before the decode
    # side is asked: the engine itself refuses it, so the generator picks another pair.
    assert p.submit("r2", d, 2) == 202
    status, state = d.call("POST", "/v1/drain", {"timeout_s": 30})
    assert status == 200 and state["draining"] is True
    status, body = d.call(
        "POST", "/v1/requests", {"request_id": "r2", "peer_engine_id": p.engine_id, "num_blocks": 2}
    )
    assert (status, body["error"]) == (503, "draining")
    # r1, accepted before the drain, ends and is collected; then the engine is drained.
    wait_until(lambda: ended(d, "r1"), 20, "r1 to end on the decode side")
    state = wait_until(
        lambda: (s := d.call("GET", "/v1/drain")[1])["drained"] and s,
        20,
        "the decode engine to say it is drained",
    )
    assert state == {
        "draining": True,
        "requests_held": 0,
        "requests_in_flight": 0,
        "drained": True,
        "late_writes": 0,  # the decode's guard found no block written after its request ended
        "abort_stages": {},  # the emulated engine keeps no abort stages
    }
    (r1,) = outcomes_of(d, "r1")
    assert r1["status"] == "done" and r1["verified_bytes"] == 2 * 4096
    # The prefill side ends both: r1 pushed, r2 failed with a reason (never registered).
    wait_until(lambda: ended(p, "r2"), 20, "r2 to end on the prefill side")
    assert [o["status"] for o in outcomes_of(p, "r1")] == ["done"]
    (r2,) = outcomes_of(p, "r2")
    assert r2["status"] == "failed" and r2["reason"]
    assert d.drain() == [] and outcomes_of(d, "r2") == []


def test_a_stopped_engine_fails_what_it_holds_and_hands_it_out_before_exiting(
    token_file: Path, tmp_path: Path
) -> None:
    # A decode request whose prefill never pushes is held for its registration timeout
    # (60 s); SIGTERM with a 1 s drain deadline must end it, failed with reason shutdown,
    # and the process must wait until that outcome has been collected.
    p = start_worker("prefill", token_file, tmp_path, *OPTS)
    d = start_worker(
        "decode", token_file, tmp_path, *OPTS, "--registration-timeout", "60",
        "--drain-timeout", "1",
    )  # fmt: skip
    try:
        d.connect(p)
        assert d.submit("held", p, 2) == 202
        d.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: d.call("GET", "/v1/drain")[1]["draining"], 10, "SIGTERM to drain")
        # From then on no new request is taken, and "held" ends while the process lives.
        status, body = d.call(
            "POST",
            "/v1/requests",
            {"request_id": "late", "peer_engine_id": p.engine_id, "num_blocks": 1},
        )
        assert (status, body["error"]) == (503, "draining")
        (held,) = wait_until(lambda: ended(d, "held"), 20, "the held request to end")
        assert held["status"] == "failed" and held["reason"] == "shutdown"
        assert d.proc.wait(20) == 0
        assert outcomes_of(d, "late") == []
    finally:
        for w in (p, d):
            w.stop()


def test_outcomes_collected_with_ack_stay_until_acknowledged(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    # A client whose answer is lost (a timeout: the engine was frozen and answered late, to
    # nobody) asks again with the same ack and gets the same outcomes: nothing is lost.
    p, d = pair
    for rid in ("a1", "a2"):
        assert p.submit(rid, d, 1) == 202 and d.submit(rid, p, 1) == 202

    def both() -> list[dict[str, Any]] | None:
        status, body = d.call("GET", "/v1/finished?ack=0")
        assert status == 200
        return body if len(body) == 2 else None

    first = wait_until(both, 20, "both outcomes")
    again = d.call("GET", "/v1/finished?ack=0")[1]
    assert again == first  # the first answer "lost": still there
    assert sorted(o["seq"] for o in first) == [1, 2]
    assert d.call("GET", "/v1/drain")[1]["requests_in_flight"] == 2
    assert d.call("GET", "/v1/finished?ack=2")[1] == []
    assert d.call("GET", "/v1/drain")[1]["requests_in_flight"] == 0
    status, body = d.call("GET", "/v1/finished?ack=x")
    assert status == 400, body
