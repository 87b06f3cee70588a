"""KVTopoConnector against vLLM's real scheduler: a prefill and a decode engine in two
processes (`tests.vllm.engine`), the connector loaded by vLLM through
`kv_connector_module_path`, real per-layer KV tensors and real NIXL (UCX) between them.

The pair is connected the way the operator does it (`PUT /v1/peers` on both control APIs,
signed with the operator's key, each add carrying the ticket the operator mints for it), or
not at all (the connector then handshakes lazily, with the peer token the engines share).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvtopo.localkeys import ControlClient, Credentials
from kvtopo.ports import free_port
from kvtopo_worker.protocol import Introduction

pytest.importorskip("vllm")
pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class EngineProc:
    role: str
    engine_id: str
    endpoint: str
    incarnation: str
    client: ControlClient  # the operator's key (admin routes, tickets), the client token
    proc: subprocess.Popen[str]
    free_blocks: int
    log: Path

    def ask(self, cmd: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"{self.role} engine exited: {self.log.read_text()[-3000:]}"
        answer: dict[str, Any] = json.loads(line)
        assert "exception" not in answer, answer
        return answer

    def add(
        self, rid: str, prompt_len: int, max_tokens: int, params: dict[str, Any], **more: str
    ) -> None:
        """Adds a request; `more`: `prompt_of` (the request whose prompt tokens it has) and
        `content_id` (the prefill request whose bytes it receives)."""
        self.ask(
            {
                "op": "add",
                "rid": rid,
                "prompt_len": prompt_len,
                "max_tokens": max_tokens,
                "params": params,
                **more,
            }
        )

    def wait(self, rids: list[str], timeout: float = 30) -> dict[str, list[dict[str, Any]]]:
        answer = self.ask({"op": "wait", "rids": rids, "timeout": timeout}, timeout + 30)
        assert answer["error"] is None, answer["error"]
        assert not answer["left"], f"{self.role}: {answer['left']} still held: {answer}"
        return answer["events"]  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        return self.ask({"op": "state"})

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """A call to the engine's control API as the operator (a peer add given a ticket
        minted for this engine)."""
        return self.client.call(
            method, self.endpoint, path, body, 15, fetcher=(self.engine_id, self.incarnation)
        )

    def connect(self, peer: EngineProc) -> None:
        """What the operator does: add `peer` to this engine's registry."""
        status, body = self.call(
            "PUT", f"/v1/peers/{peer.engine_id}", {"endpoint": peer.endpoint, "role": peer.role}
        )
        assert status == 200, body

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)


class Engines:
    def __init__(self, tmp: Path, model_dir: str) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.token_file = tmp / "token"  # the client token; the operator's keys beside it
        self.token_file.write_text(secrets.token_hex(16) + "\n")
        self.creds = Credentials.beside(self.token_file)
        self.peer_token_file = tmp / "peer-token"  # what engines pairing lazily share
        self.peer_token_file.write_text(secrets.token_hex(16) + "\n")
        self.client = ControlClient.of(self.creds)
        self.procs: list[EngineProc] = []

    def _spawn(
        self, role: str, engine_id: str, tp: int = 1, **opts: Any
    ) -> tuple[subprocess.Popen[str], Path]:
        port = free_port()
        log = self.tmp / f"{engine_id}.log"
        argv = [
            sys.executable,
            "-m",
            "tests.vllm.engine",
            "--role",
            role,
            "--engine-id",
            engine_id,
            "--model-dir",
            self.model_dir,
            "--port",
            str(port),
            "--token-file",
            str(self.token_file),
            "--operator-key-file",
            str(self.creds.operator_public),
            "--peer-token-file",
            str(self.peer_token_file),
            "--tp",
            str(tp),
        ]
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with log.open("w") as err:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        return proc, log

    def _ready(
        self, role: str, engine_id: str, spawned: tuple[subprocess.Popen[str], Path]
    ) -> EngineProc:
        proc, log = spawned
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"{role} engine did not start: {log.read_text()[-3000:]}"
        ready = json.loads(line)
        engine = EngineProc(
            role,
            engine_id,
            ready["endpoint"],
            ready["incarnation"],
            self.client,
            proc,
            ready["free_blocks"],
            log,
        )
        self.client.challenges.pop(engine.endpoint, None)  # a new process there
        self.procs.append(engine)
        return engine

    def pair(
        self, name: str, tp: int = 1, prefill: dict[str, Any] | None = None, **decode: Any
    ) -> tuple[EngineProc, EngineProc]:
        """A prefill (`p-<name>`) and a decode (`d-<name>`) engine, started side by side;
        `prefill` and the keywords are each one's extra command-line options."""
        p = self._spawn("prefill", f"p-{name}", tp, **(prefill or {}))
        d = self._spawn("decode", f"d-{name}", tp, **decode)
        return self._ready("prefill", f"p-{name}", p), self._ready("decode", f"d-{name}", d)

    def start(self, role: str, engine_id: str, tp: int = 1, **opts: Any) -> EngineProc:
        """One engine of `role` ("prefill", "decode" or "both": kv_both)."""
        return self._ready(role, engine_id, self._spawn(role, engine_id, tp, **opts))

    def restart(self, engine: EngineProc, **opts: Any) -> EngineProc:
        """A new process of `engine` (same role and engine id) once the old one exited."""
        return self._ready(
            engine.role, engine.engine_id, self._spawn(engine.role, engine.engine_id, **opts)
        )

    def close(self) -> None:
        for p in self.procs:
            p.close()


def prefill_params(prefill: EngineProc, rid: str) -> dict[str, Any]:
    """Runs `rid` on the prefill to its end; the kv_transfer_params it answers (what a
    P/D proxy hands the decode)."""
    deadline = time.monotonic() + 30
    while True:
        state = prefill.ask({"op": "wait", "rids": [rid], "timeout": 0.2})
        finished = [o for o in state["events"][rid] if o["event"] == "finished"]
        if finished:
            params: dict[str, Any] = finished[0]["params"]
            assert finished[0]["reason"] == "length", finished
            return params
        assert time.monotonic() < deadline, f"prefill never finished {rid}: {state}"


def events(outcomes: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in outcomes if o["event"] == kind]


def verified(got: list[dict[str, Any]]) -> int:
    """The bytes the engine verified for a request that ended done (its one outcome)."""
    (outcome,) = events(got, "outcome")
    assert outcome["status"] == "done", got
    return int(outcome["verified_bytes"])


def failed_once(got: list[dict[str, Any]], *, freed: bool = True) -> dict[str, Any]:
    """The one outcome of a request that failed, and vLLM's one failed load of it; under
    the `fail` policy (`freed`) vLLM lets the request and its blocks go in the very step
    that reports the failed load, and the connector keeps no work pending for it (as
    vLLM's NixlPushConnector)."""
    (outcome,) = events(got, "outcome")
    assert outcome["status"] == "failed", got
    (failed,) = events(got, "failed_recving")
    assert not events(got, "finished_recving"), got
    assert failed["freed"] is freed, got
    assert failed["pending_push_work"] is False, got
    return outcome


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_waits_for_pushed_kv_and_the_prefill_holds_its_blocks_until_sent(
    engines: Engines, tp: int
) -> None:
    prefill, decode = engines.pair(f"tp{tp}", tp)
    decode.connect(prefill)
    prefill.connect(decode)

    rids = [f"req{i}" for i in range(3)]
    for i, rid in enumerate(rids):
        prefill.add(rid, 40 + 13 * i, 1, {"do_remote_decode": True})
    params = {rid: prefill_params(prefill, rid) for rid in rids}
    for rid in rids:
        p = params[rid]
        # The keys (and meanings) of vLLM's NixlPushConnector, so P/D proxies work unchanged.
        assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
        assert p["remote_engine_id"] == prefill.engine_id
        assert p["remote_request_id"] == rid
        assert f"{p['remote_host']}:{p['remote_port']}" == prefill.endpoint
        assert p["tp_size"] == tp and p["transfer_mode"] == "push"
        assert len(p["remote_block_ids"]) == -(-p["remote_num_tokens"] // 16)
    # Finished, but its blocks are held for the WRITE.
    assert prefill.state()["free_blocks"] < prefill.free_blocks

    for rid in rids:
        decode.add(f"d-{rid}", 40 + 13 * rids.index(rid), 4, params[rid])
    outcomes = decode.wait([f"d-{rid}" for rid in rids])
    for rid in rids:
        got = outcomes[f"d-{rid}"]
        recv = events(got, "finished_recving")
        assert len(recv) == 1 and not events(got, "failed_recving"), got
        assert verified(got) > 0, got  # every byte of every block, every rank
        finished = events(got, "finished")
        assert len(finished) == 1 and finished[0]["reason"] == "length", got
    sent = prefill.wait(rids)
    for rid in rids:
        assert len(events(sent[rid], "finished_sending")) == 1, sent[rid]
    assert prefill.state()["free_blocks"] == prefill.free_blocks
    assert decode.state()["free_blocks"] == decode.free_blocks


def test_without_an_operator_the_pair_handshakes_lazily_and_again_with_a_new_prefill(
    engines: Engines,
) -> None:
    prefill, decode = engines.pair("lazy")
    assert prefill.state()["peers"] == [] and decode.state()["peers"] == []
    prefill.add("r1", 50, 1, {"do_remote_decode": True})
    params = prefill_params(prefill, "r1")
    decode.add("d1", 50, 2, params)
    got = decode.wait(["d1"])["d1"]
    assert verified(got) > 0, got
    assert events(got, "finished")[0]["reason"] == "length", got
    prefill.wait(["r1"])
    assert decode.state()["peers"] == ["p-lazy"]
    assert prefill.state()["peers"] == ["d-lazy"]
    requests_cannot_move_the_held_prefill(prefill, decode)

    # The prefill dies and comes back under the same engine id (a new process, new NIXL
    # agents): the decode still holds the old one, and must not keep using it.
    prefill.kill()
    prefill.proc.wait(10)
    prefill = engines.restart(prefill)
    prefill.add("r2", 50, 1, {"do_remote_decode": True})
    decode.add("d2", 50, 2, prefill_params(prefill, "r2"))
    got = decode.wait(["d2"])["d2"]
    assert verified(got) > 0, got
    prefill.wait(["r2"])
    assert decode.state()["peers"] == ["p-lazy"]


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_dead_or_frozen_prefill_fails_the_request_through_vllm_once(
    engines: Engines, fault: str
) -> None:
    prefill, decode = engines.pair(fault, registration_timeout=2, transfer_timeout=2)
    decode.connect(prefill)
    prefill.connect(decode)
    prefill.add("r1", 40, 1, {"do_remote_decode": True})
    params = prefill_params(prefill, "r1")
    prefill.kill(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    decode.add("d1", 40, 4, params)
    got = decode.wait(["d1"], timeout=30)["d1"]
    failed_once(got)
    finished = events(got, "finished")
    assert len(finished) == 1 and finished[0]["reason"] == "error", got
    assert decode.state()["free_blocks"] == decode.free_blocks


def test_a_failed_load_is_recomputed_under_the_recompute_policy(engines: Engines) -> None:
    prefill, decode = engines.pair(
        "rc", registration_timeout=2, transfer_timeout=2, failure_policy="recompute"
    )
    decode.connect(prefill)
    prefill.connect(decode)
    prefill.add("r1", 40, 1, {"do_remote_decode": True})
    params = prefill_params(prefill, "r1")
    prefill.kill()
    decode.add("d1", 40, 3, params)
    got = decode.wait(["d1"], timeout=30)["d1"]
    failed_once(got, freed=False)
    finished = events(got, "finished")
    assert len(finished) == 1 and finished[0]["reason"] == "length", got  # ran locally
    assert decode.state()["free_blocks"] == decode.free_blocks


def test_a_prefill_the_operator_evicted_is_not_used_again(engines: Engines) -> None:
    prefill, decode = engines.pair("ev", registration_timeout=2, transfer_timeout=2)
    decode.connect(prefill)
    prefill.connect(decode)
    prefill.add("r1", 40, 1, {"do_remote_decode": True})
    params = prefill_params(prefill, "r1")
    status, body = decode.call("DELETE", f"/v1/peers/{prefill.engine_id}")
    assert status == 200, body
    assert decode.state()["peers"] == []
    decode.add("d1", 40, 2, params)
    got = decode.wait(["d1"], timeout=30)["d1"]
    assert "evicted by the operator" in failed_once(got)["message"], got
    assert decode.state()["peers"] == []  # not handshaken again behind the operator's back


def test_kv_both_engines_serve_plain_requests_prefill_and_decode_at_once(
    engines: Engines,
) -> None:
    """vLLM's documented P/D setup: `kv_role: kv_both` on both engines, no other key; each
    request's part comes from its kv_transfer_params (selective P/D). Each engine prefills
    for the other and decodes from the other, beside a plain request, over lazy
    handshakes; every received byte verified."""
    a = engines.start("both", "both-a")
    b = engines.start("both", "both-b")
    a.add("plain-a", 40, 3, {})
    a.add("pa", 45, 1, {"do_remote_decode": True})
    b.add("pb", 60, 1, {"do_remote_decode": True})
    from_a, from_b = prefill_params(a, "pa"), prefill_params(b, "pb")
    assert from_a["remote_engine_id"] == "both-a" and from_b["remote_engine_id"] == "both-b"
    b.add("db", 45, 2, from_a)  # b decodes a's prefill ...
    a.add("da", 60, 2, from_b)  # ... while a decodes b's
    got_a = a.wait(["da", "plain-a", "pa"])
    got_b = b.wait(["db", "pb"])
    assert verified(got_a["da"]) > 0 and verified(got_b["db"]) > 0, (got_a, got_b)
    (plain,) = events(got_a["plain-a"], "outcome")
    assert plain["status"] == "done", got_a
    assert events(got_a["plain-a"], "finished")[0]["reason"] == "length", got_a
    assert not events(got_a["plain-a"], "finished_sending"), got_a  # no KV moved
    for got, rid in ((got_a, "pa"), (got_b, "pb")):
        assert len(events(got[rid], "finished_sending")) == 1, got
    for engine in (a, b):
        state = engine.state()
        assert state["free_blocks"] == engine.free_blocks, state
        assert state["pending_push_work"] is False, state
    assert a.state()["peers"] == ["both-b"] and b.state()["peers"] == ["both-a"]


def test_an_abort_while_waiting_for_remote_kv_holds_the_blocks_until_no_write_can_land(
    engines: Engines,
) -> None:
    """A client aborts a decode request whose KV a frozen prefill still owes it: vLLM
    finishes the request at once, keeps its blocks until the connector reports that no
    WRITE can land (the cancel unanswered, the give-up time passed), then frees them; the
    request ends once, aborted. The registration's give-up time (registration plus transfer
    timeout) is wide: on a loaded machine the abort may land seconds after the
    registration, and a give-up time already past frees the blocks at once, rightly."""
    prefill, decode = engines.pair("abort", registration_timeout=5, transfer_timeout=5)
    decode.connect(prefill)
    prefill.connect(decode)
    prefill.add("r1", 40, 1, {"do_remote_decode": True})
    params = prefill_params(prefill, "r1")
    prefill.kill(signal.SIGSTOP)
    decode.add("d1", 40, 4, params)
    deadline = time.monotonic() + 10
    while decode.state()["receiving"] != 1:  # its registration is with the workers
        assert time.monotonic() < deadline, decode.state()
    assert decode.ask({"op": "abort", "rid": "d1"})["ok"] is True
    state = decode.state()
    assert state["abort_stages"] == {"recv:waiting-for-kv": 1}, state
    assert "d1" in state["requests"] and state["free_blocks"] < decode.free_blocks, state
    got = decode.wait(["d1"], timeout=30)["d1"]
    (outcome,) = events(got, "outcome")
    assert (outcome["status"], outcome["reason"]) == ("failed", "aborted"), got
    assert not events(got, "finished"), got  # vLLM answers an abort to no one
    (recv,) = events(got, "finished_recving")  # the connector let the blocks go, once
    assert recv["freed"] is True and not events(got, "failed_recving"), got
    state = decode.state()
    assert state["free_blocks"] == decode.free_blocks and not state["pending_push_work"], state


class Stranger:
    """An HTTP server on loopback that holds no credential and records what reaches it (a
    request's `remote_host`/`remote_port` may name it): (method, path, body bytes)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen: list[tuple[str, str, int]] = []
        bodies: list[bytes] = []
        self.seen, self.bodies = seen, bodies

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                return

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                seen.append((self.command, self.path, len(body)))
                bodies.append(body)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._any()

            def do_POST(self) -> None:
                self._any()

            def do_PUT(self) -> None:
                self._any()

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def requests_cannot_move_the_held_prefill(prefill: EngineProc, decode: EngineProc) -> None:
    """Issue 55, defect 1 (in the lazy pair's test, which holds the pair it needs): a
    request whose kv_transfer_params name a held, healthy prefill's engine id with a
    stranger's endpoint and a made-up incarnation fails alone: the decode never dials the
    stranger (nothing of it, its metadata least of all, reaches it), keeps the prefill it
    holds, and the next honest request uses that prefill. A public address is never
    dialled; an engine not held is opened with a hello (no metadata), and the stranger,
    holding no peer credential, gets no further."""
    stranger = Stranger()
    try:
        crafted = {
            "do_remote_prefill": True,
            "remote_engine_id": prefill.engine_id,
            "remote_request_id": "made-up",
            "remote_host": "127.0.0.1",
            "remote_port": stranger.port,
            "kvtopo_incarnation": "made-up-incarnation",
        }
        decode.add("x1", 50, 2, crafted)
        outcome = failed_once(decode.wait(["x1"], timeout=30)["x1"])
        assert stranger.seen == [], f"the stranger was dialled: {stranger.seen}"
        assert "held" in outcome["message"], outcome
        decode.add("x2", 50, 2, {**crafted, "remote_host": "203.0.113.7", "remote_port": 80})
        outcome = failed_once(decode.wait(["x2"], timeout=30)["x2"])
        assert "lazy_peer_networks" in outcome["message"], outcome
        decode.add("x3", 50, 2, {**crafted, "remote_engine_id": "p-unknown"})
        failed_once(decode.wait(["x3"], timeout=30)["x3"])
        assert [s[:2] for s in stranger.seen] == [("POST", "/v1/introductions")], stranger.seen
        hello = msgspec.msgpack.decode(stranger.bodies[0], type=Introduction)
        assert hello.engine_id == decode.engine_id and hello.ranks == [], hello
    finally:
        stranger.close()
    assert decode.state()["peers"] == [prefill.engine_id]
    prefill.add("r1b", 50, 1, {"do_remote_decode": True})
    decode.add("d1b", 50, 2, prefill_params(prefill, "r1b"))
    assert verified(decode.wait(["d1b"])["d1b"]) > 0
    prefill.wait(["r1b"])
