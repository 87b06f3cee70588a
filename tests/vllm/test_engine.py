"""`python -m kvtopo_worker.vllm.engine` (what `kvtopo drill --engine vllm` runs): vLLM's
scheduler with KVTopoConnector behind the emulated engine's traffic routes. A prefill and a
decode engine in two processes, connected as the operator connects them; requests submitted
to both sides end the same way on both, the decode's bytes verified; a drain ends every
request it held; a killed prefill fails the decode's request once."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.workers import WorkerProcess, start_workers

pytest.importorskip("vllm")
pytestmark = pytest.mark.nixl


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("vllm-engine-test-token\n")
    return path


@pytest.fixture
def pair(tmp_path: Path, token_file: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    opts = ("--registration-timeout", "3", "--transfer-timeout", "3", "--kv-lease", "10")
    # Side by side: each engine's start (vLLM's imports, its scheduler) takes tens of seconds.
    prefill, decode = start_workers(
        [("prefill", ("--engine-id", "p0", *opts)), ("decode", ("--engine-id", "d0", *opts))],
        token_file,
        tmp_path,
        engine="vllm",
        deadline_s=240,
    )
    try:
        decode.connect(prefill)
        prefill.connect(decode)
        yield prefill, decode
    finally:
        for w in (prefill, decode):
            w.stop(grace_s=10)


def outcomes_of(worker: WorkerProcess, rids: set[str], timeout: float = 30) -> dict[str, Any]:
    """Polls GET /v1/finished until every request of `rids` has its outcome."""
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while not rids <= set(got):
        for o in worker.drain():
            assert o["request_id"] not in got, f"second outcome for {o}"
            got[o["request_id"]] = o
        assert time.monotonic() < deadline, f"{worker.role}: no outcome for {rids - set(got)}"
        time.sleep(0.05)
    return got


def test_requests_end_done_on_both_sides_with_every_byte_verified(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    prefill, decode = pair
    rids = {f"r{i}" for i in range(6)}
    for i, rid in enumerate(sorted(rids)):
        assert prefill.submit(rid, decode, 2 + i) == 202
        assert decode.submit(rid, prefill, 2 + i) == 202
    sent = outcomes_of(prefill, rids)
    received = outcomes_of(decode, rids)
    for rid in rids:
        assert sent[rid]["status"] == "done", sent[rid]
        assert received[rid]["status"] == "done", received[rid]
        assert received[rid]["verified_bytes"] > 0
    state = decode.state()
    assert state["requests_done"] == len(rids) and state["requests_failed"] == 0
    assert [p["engine_id"] for p in state["peers"]] == ["p0"]
    # The client token opens the traffic routes only: an admin route answers it 401 with
    # the engine's challenge (only the operator's signature opens those).
    assert with_client_token(decode, "GET", "/v1/drain")[0] == 200
    for method, path in (("GET", "/v1/state"), ("DELETE", "/v1/peers/p0")):
        status, challenge = with_client_token(decode, method, path)
        assert status == 401 and challenge.startswith("KVTopo-Sig "), (path, status)
    assert [p["engine_id"] for p in decode.state()["peers"]] == ["p0"]


def with_client_token(worker: WorkerProcess, method: str, path: str) -> tuple[int, str]:
    """A call with the client token as a bearer: its status and `WWW-Authenticate`."""
    req = urllib.request.Request(
        worker.url + path, method=method, headers={"Authorization": f"Bearer {worker.token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("WWW-Authenticate", "")


def test_a_drain_ends_what_it_held_and_refuses_more(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    prefill, decode = pair
    # Held on the decode only: its prefill side never runs, so the drain deadline ends it.
    assert decode.submit("lonely", prefill, 2) == 202
    status, body = decode.call("POST", "/v1/drain", {"timeout_s": 0.5})
    assert status == 200 and body["draining"], body
    assert decode.submit("late", prefill, 2) == 503
    got = outcomes_of(decode, {"lonely"}, timeout=30)
    assert got["lonely"]["status"] == "failed" and got["lonely"]["reason"] == "shutdown", got
    deadline = time.monotonic() + 10
    while not decode.call("GET", "/v1/drain")[1]["drained"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_killed_prefill_fails_the_decode_request_once(
    pair: tuple[WorkerProcess, WorkerProcess],
) -> None:
    prefill, decode = pair
    assert prefill.submit("before", decode, 2) == 202
    assert decode.submit("before", prefill, 2) == 202
    assert outcomes_of(decode, {"before"})["before"]["status"] == "done"
    assert prefill.submit("doomed", decode, 3) == 202
    deadline = time.monotonic() + 10
    while prefill.state()["requests_in_flight"] < 2:  # "before"'s outcome is still queued
        assert time.monotonic() < deadline
        time.sleep(0.05)
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(10)
    assert decode.submit("doomed", prefill, 3) == 202
    got = outcomes_of(decode, {"doomed"}, timeout=40)
    assert got["doomed"]["status"] == "failed", got
    time.sleep(0.5)  # nothing more may come for it (a second outcome fails outcomes_of)
    assert all(o["request_id"] != "doomed" for o in decode.drain())
