"""Nothing lands after the decode let go, and no notification counts unless it comes from the
exact peer process: real `kvtopo-worker` processes over real NIXL (UCX, CPU, loopback), an
ordinary abort racing its own registration, a decode restarted under its engine id, a prefill
replaced while its old process is frozen (SIGSTOP), a rogue NIXL agent in the test process
posing under the prefill's own agent name, and a registration flood from an agent nobody
added."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtopo_worker.protocol import PushRegistration, encode_notification
from tests.worker.workers import WorkerProcess, forged_answers, rogue_agent, start_worker

pytestmark = pytest.mark.nixl

BLOCK = 16 * 1024
OPTS = ("--block-bytes", str(BLOCK), "--num-blocks", "64", "--progress-thread", "off")


@pytest.fixture
def started() -> Iterator[list[WorkerProcess]]:
    workers: list[WorkerProcess] = []
    yield workers
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGCONT)
        w.stop()


def start(
    started: list[WorkerProcess], role: str, token_file: Path, tmp_path: Path, *extra: str
) -> WorkerProcess:
    w = start_worker(role, token_file, tmp_path, *OPTS, *extra)
    started.append(w)
    return w


def connect(w: WorkerProcess, peer: WorkerProcess) -> None:
    """What the operator does: add `peer`, naming the process it must be."""
    state = peer.state()
    body = {"endpoint": peer.endpoint, "role": peer.role, "incarnation": state["incarnation"]}
    deadline = time.monotonic() + 15
    while True:
        status, answer = w.call("PUT", f"/v1/peers/{peer.engine_id}", body)
        if status == 200:
            return
        assert status == 409 and answer.get("error") == "replacing", answer
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)


def abort(w: WorkerProcess, request_id: str) -> int:
    status, _ = w.call("DELETE", f"/v1/requests/{request_id}")
    return status


def outcome(w: WorkerProcess, request_id: str, timeout: float = 30) -> dict[str, Any]:
    """The outcome `w` reports for `request_id` (collected from `GET /v1/finished`)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [o for o in w.outcomes if o["request_id"] == request_id]
        if found:
            assert len(found) == 1, f"{request_id} ended twice on {w.role}: {found}"
            return found[0]
        assert time.monotonic() < deadline, f"{w.role} never ended {request_id}"
        w.drain()
        time.sleep(0.02)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def late_writes(w: WorkerProcess) -> int:
    """Blocks the engine found written while it held no request in them (its guard)."""
    return int(w.metric("kvtopo_worker_late_writes"))


def test_an_abort_racing_its_own_registration_leaves_nothing_to_write(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    p = start(started, "prefill", token_file, tmp_path, "--kv-lease", "3")
    d = start(started, "decode", token_file, tmp_path)
    connect(d, p)
    connect(p, d)
    for i in range(5):
        rid = f"abort-{i}"
        assert d.submit(rid, p, 2) == 202
        time.sleep(0.005)  # the fault: vLLM aborting a request just after scheduling it
        assert abort(d, rid) == 202
        assert outcome(d, rid)["status"] == "failed"
        # Only now is the prefill's KV ready: nothing may be written for it any more.
        assert p.submit(rid, d, 2) == 202
        assert outcome(p, rid)["status"] == "failed", outcome(p, rid)
    # The decode's blocks went to the next requests: they carry their own bytes only.
    for i in range(3):
        assert d.submit(f"after-{i}", p, 2) == 202
        assert p.submit(f"after-{i}", d, 2) == 202
        assert outcome(d, f"after-{i}")["status"] == "done"
    assert late_writes(d) == 0


def test_a_decode_restarted_under_its_engine_id_is_not_written_its_old_requests(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    p = start(started, "prefill", token_file, tmp_path, "--kv-lease", "20")
    d = start(started, "decode", token_file, tmp_path, "--engine-id", "decode-x")
    connect(d, p)
    connect(p, d)
    assert d.submit("old", p, 4) == 202  # registered; the prefill has no KV for it yet
    assert d.submit("probe", p, 2) == 202
    assert p.submit("probe", d, 2) == 202
    assert outcome(d, "probe")["status"] == "done"  # so "old"'s registration has arrived
    d.proc.kill()
    d.proc.wait()
    d2 = start(started, "decode", token_file, tmp_path, "--engine-id", "decode-x")
    connect(p, d2)
    connect(d2, p)
    assert d2.submit("new", p, 4) == 202
    assert p.submit("new", d2, 4) == 202
    assert outcome(d2, "new")["status"] == "done"
    # The KV of the dead process's request is ready now: it must not go to its successor.
    assert p.submit("old", d2, 4) == 202
    assert outcome(p, "old")["status"] == "failed", outcome(p, "old")
    assert d2.submit("next", p, 4) == 202
    assert p.submit("next", d2, 4) == 202
    assert outcome(d2, "next")["status"] == "done"
    assert late_writes(d2) == 0


def test_a_failure_from_a_new_prefill_process_does_not_end_the_old_ones_request(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    p1 = start(started, "prefill", token_file, tmp_path, "--engine-id", "prefill-x")
    d = start(started, "decode", token_file, tmp_path)
    connect(d, p1)
    connect(p1, d)
    assert d.submit("r", p1, 2) == 202  # registered; p1 has no KV for it yet
    assert d.submit("probe", p1, 2) == 202
    assert p1.submit("probe", d, 2) == 202
    assert outcome(d, "probe")["status"] == "done"  # so r's registration has arrived
    p1.proc.send_signal(signal.SIGSTOP)  # frozen (or partitioned), not dead
    p2 = start(started, "prefill", token_file, tmp_path, "--engine-id", "prefill-x")
    connect(d, p2)  # the operator saw the new pod: the old process is replaced at d
    connect(p2, d)
    assert abort(d, "r") == 202
    # Whatever p2 says of r (it knows nothing of it) says nothing of what p1 may still
    # write: give a wrong answer the time to end r at d (it must not), then thaw p1.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not any(o["request_id"] == "r" for o in d.outcomes):
        d.drain()
        time.sleep(0.05)
    p1.proc.send_signal(signal.SIGCONT)
    assert p1.submit("r", d, 2) == 202  # p1's KV for r is ready: its registration holds
    ended_p = outcome(p1, "r")
    ended_d = outcome(d, "r", timeout=90)
    assert ended_d["status"] == ended_p["status"], (ended_d, ended_p)
    assert late_writes(d) == 0


def test_a_rogue_agent_posing_under_the_prefills_agent_name_ends_nothing(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    p = start(started, "prefill", token_file, tmp_path)
    d = start(started, "decode", token_file, tmp_path)
    connect(d, p)
    connect(p, d)
    (p_agent,) = {a for peer in d.state()["peers"] for a in peer["agents"].values()}
    assert d.submit("r-done", p, 2) == 202
    assert d.submit("r-fail", p, 2) == 202
    rogue, (d_agent,) = rogue_agent([d], p_agent, BLOCK)
    try:
        for data in forged_answers(p.engine_id):
            rogue.send_notif(d_agent, data)

        def handled() -> bool:
            rogue.get_notifs()  # progresses the rogue's sends (its NIXL thread is off)
            return d.rejected("unauthenticated") >= 2 or bool(d.drain())

        wait_until(
            handled,
            10,
            "the decode to handle the forged notifications",
        )
        assert d.outcomes == [], f"a forged notification ended a request: {d.outcomes}"
        # The real prefill then serves both.
        assert p.submit("r-done", d, 2) == 202
        assert p.submit("r-fail", d, 2) == 202
        assert outcome(d, "r-done")["status"] == "done"
        assert outcome(d, "r-fail")["status"] == "done"
    finally:
        rogue.close()


def _rss_mb(w: WorkerProcess) -> float:
    for line in Path(f"/proc/{w.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_registrations_from_an_agent_nobody_added_are_not_kept(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    p = start(started, "prefill", token_file, tmp_path)
    before = _rss_mb(p)
    rogue, (p_agent,) = rogue_agent([p], "kvtopo-stranger", BLOCK)
    n = 150
    try:
        for i in range(n):
            reg = PushRegistration(
                request_id=f"flood-{i}",
                decode_engine_id="stranger",
                prefill_engine_id=p.engine_id,
                block_ids=list(range(65536)),
                expires_at=time.time() + 600,
                write_timeout_s=30,
            )
            rogue.send_notif(p_agent, encode_notification(reg))
        grown = 0.0

        def handled() -> bool:
            nonlocal grown
            rogue.get_notifs()
            grown = _rss_mb(p) - before
            return p.rejected("unknown_agent") >= n or grown > 200

        wait_until(handled, 60, "the prefill to take the flood in")
        assert grown < 64, f"the prefill kept {grown:.0f} MB of a stranger's registrations"
    finally:
        rogue.close()


def test_a_paired_decode_s_cancel_flood_is_neither_answered_nor_kept_per_message(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    """Issue 55, defect 3: a decode the operator paired with P (a NIXL agent in the test
    process whose metadata P fetched) sends 100,000 valid sealed PUSH_CANCELs for requests
    P never had. P answers them within its per-agent rate (the decode's deadline ends an
    unanswered one), keeps a bounded number of tombstones and of queued notifications
    (beyond them the flooder's own messages are dropped and counted), and another pair's
    request sent in the middle of the flood is written."""
    from kvtopo_bench.isolation import served_peer
    from kvtopo_worker.protocol import PushCancel, decode_metadata
    from kvtopo_worker.push.prefill import COURTESY_ANSWERS_BURST, COURTESY_ANSWERS_PER_S

    p = start(started, "prefill", token_file, tmp_path)
    d = start(started, "decode", token_file, tmp_path)
    connect(d, p)
    connect(p, d)
    raw, compat = p.raw_metadata(), p.state()["compat_hash"]
    rogue, server = served_peer(raw, compat, "rogue", "decode")
    try:
        host, port = server.server_address[:2]
        status, body = p.call(
            "PUT", "/v1/peers/rogue", {"endpoint": f"{host}:{port}", "role": "decode"}
        )
        assert status == 200, body
        p_agent = rogue.add_remote_peer(decode_metadata(raw, compat))
        before = _rss_mb(p)
        n, answers = 100_000, 0
        started_at = time.monotonic()
        for i in range(n):
            cancel = PushCancel(
                request_id=f"flood-{i}", decode_engine_id="rogue", prefill_engine_id=p.engine_id
            )
            rogue.send_notif(p_agent, encode_notification(cancel))
            if i % 256 == 0:
                answers += len(rogue.get_notifs())
            if i == n // 2:  # another pair's request, behind half the flood
                assert d.submit("victim", p, 2) == 202
                assert p.submit("victim", d, 2) == 202
        grown = 0.0

        def handled() -> bool:
            nonlocal answers, grown
            answers += len(rogue.get_notifs())
            grown = max(grown, _rss_mb(p) - before)
            # Each cancel was answered, left unanswered (its rate spent), or dropped
            # unhandled (the sender's queue was full).
            dropped = p.rejected("unanswered_courtesy") + p.rejected("notification_backlog")
            return answers + dropped >= n

        wait_until(handled, 120, "the prefill to take the flood in")
        elapsed = time.monotonic() - started_at
        allowed = COURTESY_ANSWERS_BURST + COURTESY_ANSWERS_PER_S * elapsed
        assert answers <= allowed + 10, f"{answers} answers to the flood in {elapsed:.1f} s"
        assert grown <= 50, f"the prefill grew {grown:.0f} MB under the flood"
        assert outcome(d, "victim")["status"] == "done"
    finally:
        server.shutdown()
        server.server_close()
        rogue.close()


def test_a_draining_decode_beside_a_frozen_prefill_reports_what_the_prefill_does(
    started: list[WorkerProcess], token_file: Path, tmp_path: Path
) -> None:
    """Issue 55, defect 4: a decode SIGTERMed (drain deadline 1 s) while its prefill is
    frozen (SIGSTOP) with the decode's registration waiting there gives the request up at
    its deadline, but neither reports it nor hands its blocks back while a WRITE of it can
    land: it ends once the thawed prefill answered, with the prefill's outcome."""
    p = start(started, "prefill", token_file, tmp_path)
    d = start(
        started, "decode", token_file, tmp_path, "--drain-timeout", "1",
        "--registration-timeout", "12", "--transfer-timeout", "4",
    )  # fmt: skip
    connect(d, p)
    connect(p, d)
    assert d.submit("warm", p, 2) == 202 and p.submit("warm", d, 2) == 202
    assert outcome(d, "warm")["status"] == "done"  # the two have greeted each other
    assert p.submit("frozen", d, 2) == 202  # the prefill's KV is ready, waiting for D
    p.proc.send_signal(signal.SIGSTOP)
    try:
        assert d.submit("frozen", p, 2) == 202  # its registration waits in frozen P's queue
        d.proc.send_signal(signal.SIGTERM)
        # Past the drain deadline and well past twice it (where 7314fe4 failed the request
        # and freed its blocks): nothing is reported while the frozen P can still WRITE.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert not [o for o in d.drain() if o["request_id"] == "frozen"], d.outcomes
            time.sleep(0.1)
    finally:
        thawed = time.time()
        p.proc.send_signal(signal.SIGCONT)
    mine, theirs = outcome(d, "frozen", 30), outcome(p, "frozen", 30)
    # The thawed prefill takes the registration and the cancel behind it in one pass: the
    # cancel wins (nothing was written), and both say so; the decode only once P answered.
    assert mine["status"] == theirs["status"], (mine, theirs)
    assert mine["ended_at"] >= thawed, (mine, thawed)
    assert d.proc.wait(30) == 0
