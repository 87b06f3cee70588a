"""Both sides agree on every request's outcome when an engine freezes or gives up: real
`kvtopo-worker` processes over real NIXL (UCX, CPU, loopback), SIGSTOP for the freeze."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.workers import WorkerProcess, start_worker

pytestmark = pytest.mark.nixl

BLOCK = 16 * 1024
REG_TIMEOUT = 2.0


def start_pair(
    token_file: Path, tmp_path: Path, *extra: str, decode_blocks: int = 0
) -> tuple[WorkerProcess, WorkerProcess]:
    opts = (
        "--block-bytes",
        str(BLOCK),
        "--registration-timeout",
        str(REG_TIMEOUT),
        "--transfer-timeout",
        "2",
        "--progress-thread",
        "off",
        *extra,
    )
    p = start_worker("prefill", token_file, tmp_path, *opts)
    d_opts = ("--num-blocks", str(decode_blocks)) if decode_blocks else ()
    d = start_worker("decode", token_file, tmp_path, *opts, *d_opts)
    d.connect(p)
    p.connect(d)
    return p, d


@pytest.fixture
def stopper() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGCONT)
        w.stop()


def outcomes_by_id(w: WorkerProcess) -> dict[str, dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for o in w.outcomes:
        assert o["request_id"] not in by_id, f"{o['request_id']} ended twice on {w.role}"
        by_id[o["request_id"]] = o
    return by_id


def collect_until(
    workers: list[WorkerProcess], done: Callable[[], bool], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for w in workers:
            w.drain()
        time.sleep(0.05)


def test_a_registration_given_up_is_never_written_later(
    token_file: Path, tmp_path: Path, stopper: list[WorkerProcess]
) -> None:
    # The decode gives r1 up (no KV on the prefill within its registration timeout); the
    # prefill's KV for r1 comes later. The prefill must not then WRITE r1 into blocks the
    # decode has handed back, nor report done for a request the decode reports failed.
    p, d = start_pair(
        token_file, tmp_path, "--num-blocks", "16", "--kv-lease", "4", decode_blocks=8
    )
    stopper += [p, d]
    assert d.submit("r1", p, 8) == 202
    collect_until([d], lambda: bool(d.outcomes), 30, "the decode to give r1 up")
    (r1,) = d.outcomes
    # Given up by the decode (its cancel answered) or dropped by the prefill when the
    # registration's validity ran out (answered "unknown request"): whichever came first.
    assert r1["status"] == "failed", r1
    assert r1["reason"] in ("registration_timeout", "remote_rejected"), r1
    # Its blocks are free again: the decode takes r2 into the very same blocks.
    assert d.submit("r2", p, 8) == 202
    assert p.submit("r1", d, 8) == 202  # r1's KV, too late
    assert p.submit("r2", d, 8) == 202
    collect_until(
        [p, d], lambda: len(p.outcomes) == 2 and len(d.outcomes) == 2, 30, "both requests"
    )
    on_p, on_d = outcomes_by_id(p), outcomes_by_id(d)
    assert on_p["r1"]["status"] == "failed", f"prefill served a registration given up: {on_p}"
    assert on_d["r2"]["status"] == "done", on_d["r2"]
    assert on_p["r2"]["status"] == "done", on_p["r2"]


def test_a_frozen_decode_and_its_prefill_agree_on_every_outcome(
    token_file: Path, tmp_path: Path, stopper: list[WorkerProcess]
) -> None:
    # SIGSTOP the decode for three registration timeouts while its registrations are out
    # and their KV arrives on the prefill; after SIGCONT every request must end on both
    # sides, with the same outcome, and every byte the decode says it got must verify.
    p, d = start_pair(token_file, tmp_path, "--num-blocks", "256", "--kv-lease", "10")
    stopper += [p, d]
    ids = [f"f{i}" for i in range(40)]
    for rid in ids[:20]:  # KV ready first: these WRITE as their registrations arrive
        assert p.submit(rid, d, 2) == 202
    for rid in ids:
        assert d.submit(rid, p, 2) == 202
    d.proc.send_signal(signal.SIGSTOP)
    try:
        for rid in ids[20:]:  # KV ready while the decode is frozen
            assert p.submit(rid, d, 2) == 202
        time.sleep(3 * REG_TIMEOUT)  # the fault's length, not synchronisation
    finally:
        d.proc.send_signal(signal.SIGCONT)
    collect_until(
        [p, d],
        lambda: len(p.outcomes) == len(ids) and len(d.outcomes) == len(ids),
        60,
        "every request to end on both sides",
    )
    on_p, on_d = outcomes_by_id(p), outcomes_by_id(d)
    mismatched = {
        rid: (on_p[rid]["status"], on_d[rid]["status"])
        for rid in ids
        if on_p[rid]["status"] != on_d[rid]["status"]
    }
    assert mismatched == {}, f"prefill and decode disagree: {mismatched}"
    corrupted = [o for o in on_d.values() if "verification" in o.get("message", "")]
    assert corrupted == []
    assert all(o["verified_bytes"] == 2 * BLOCK for o in on_d.values() if o["status"] == "done")
