"""Peer health with real processes and real NIXL (UCX, CPU, loopback): a peer that NIXL has
dropped (its process died: remote disconnect) is reported in `/v1/state`, and an add of a
peer held unhealthy fetches its metadata again and replaces its agents, so transfers flow
again with no manual restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvtopo.ports import free_port
from tests.worker.workers import WorkerProcess, start_worker

pytestmark = pytest.mark.nixl

_T = TypeVar("_T")

OPTS = (
    "--num-blocks",
    "64",
    "--block-bytes",
    "4096",
    "--registration-timeout",
    "3",
    "--kv-lease",
    "5",
    "--transfer-timeout",
    "3",
    "--progress-thread",
    "off",
)


def wait_for(what: str, probe: Callable[[], _T | None], timeout: float = 10) -> _T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def peer_state(holder: WorkerProcess, engine_id: str) -> dict[str, Any]:
    return next(p for p in holder.state()["peers"] if p["engine_id"] == engine_id)


def run_request(p: WorkerProcess, d: WorkerProcess, rid: str) -> dict[str, Any]:
    """Submits `rid` to both sides and waits for the decode's outcome."""
    assert p.submit(rid, d, 2) == 202
    assert d.submit(rid, p, 2) == 202
    return wait_for(
        f"the outcome of {rid}",
        lambda: (
            next((o for o in d.drain() if o["request_id"] == rid), None)
            or next((o for o in d.outcomes if o["request_id"] == rid), None)
        ),
        timeout=15,
    )


@pytest.fixture
def workers(token_file: Path, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.stop()


def test_a_peer_restarted_under_its_engine_id_is_reported_dropped_and_renewed_by_a_re_add(
    token_file: Path, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """The failure users report: a prefill engine restarts (same engine id, same address),
    NIXL has dropped it on the decode (remote disconnect), and every later transfer to it
    fails while both pods are Ready. The decode must say so in `/v1/state` within a bounded
    time, and an add of the peer (here one that names no incarnation, as an operator that
    knows nothing newer does) must fetch its metadata again and replace the dead agents
    instead of answering `present`."""
    port = free_port()
    pinned = ("--engine-id", "prefill-pinned", "--port", str(port), *OPTS)
    p = start_worker("prefill", token_file, tmp_path, *pinned)
    d = start_worker("decode", token_file, tmp_path, *OPTS)
    workers += [p, d]
    d.connect(p)
    p.connect(d)
    assert run_request(p, d, "before")["status"] == "done"
    assert peer_state(d, "prefill-pinned").get("health", "ok") == "ok"
    old_agents = peer_state(d, "prefill-pinned")["agents"]

    # SIGKILL the prefill and start it again: same engine id, same port, a new process.
    p.proc.send_signal(signal.SIGKILL)
    assert p.proc.wait(10) == -signal.SIGKILL
    p2 = start_worker("prefill", token_file, tmp_path, *pinned)
    workers.append(p2)
    assert p2.engine_id == "prefill-pinned" and p2.endpoint == p.endpoint
    p2.connect(d)  # the fresh prefill holds nothing yet

    # The decode still holds the dead process's agent: the request fails, with a reason.
    failed = run_request(p2, d, "while-dropped")
    assert failed["status"] == "failed" and failed["reason"], failed
    held = wait_for(
        "the decode to report the prefill dropped",
        lambda: (s := peer_state(d, "prefill-pinned")).get("health") == "dropped" and s,
        timeout=5,
    )
    assert "disconnect" in held["health_reason"].lower(), held

    # A re-add renews the peer: its metadata fetched again, the dead agents replaced. (The
    # operator has read the new process's state first, and so holds its challenge, which
    # the add's ticket is minted from.)
    assert d.client.call("GET", p2.endpoint, "/v1/state")[0] == 200
    status, body = d.call(
        "PUT", "/v1/peers/prefill-pinned", {"endpoint": p2.endpoint, "role": "prefill"}
    )
    assert status == 200 and body["result"] == "renewed", body
    renewed = peer_state(d, "prefill-pinned")
    assert renewed["health"] == "ok" and renewed["health_reason"] == "", renewed
    assert renewed["incarnation"] == p2.state()["incarnation"]
    assert set(renewed["agents"].values()).isdisjoint(old_agents.values())
    done = run_request(p2, d, "after-renewal")
    assert done["status"] == "done", done
    # A healthy peer is not fetched again: the next add answers `present`.
    status, body = d.call(
        "PUT", "/v1/peers/prefill-pinned", {"endpoint": p2.endpoint, "role": "prefill"}
    )
    assert (status, body["result"]) == (200, "present"), body
