"""`kvtopo bench isolation`: how much a hostile peer delays another pair's requests.

Real `kvtopo-worker` processes and real NIXL: a prefill P and a decode D carry a steady
stream of verified requests (one at a time; each one's latency from submit to D's outcome)
while, in alternate phases measured side by side in one run (quiet, hostile, hostile,
quiet for each kind), P is attacked:

- `stranger_flood`: a NIXL agent P never added (any process that read P's metadata: here
  with a ticket this benchmark, acting as the operator, minted) sends registrations of
  65,536 blocks each as fast as it can; P must drop them unkept.
- `garbage_flood`: the same agent sends garbage notifications.
- `paired_flood`: a second decode H that P holds registers requests nobody prefilled, as
  fast as its control API takes them; P keeps them (bounded per peer) until their lease.
- `nixl_paired_flood`: a decode P added as the operator would (a NIXL agent in this process
  whose metadata P fetched) sends valid sealed `PUSH_CANCEL`s for requests P never had, as
  fast as NIXL takes them (100,000 and more); P handles a budget of each sender's
  notifications per pass and answers such cancels within a rate. P's RSS growth is
  reported for every kind: its peak under attack over its peak in the first quiet step
  (the victim pair's traffic alone); target <= 50 MB for this kind.
- `huge_handshake`: D is told to add a "prefill" whose metadata (served by a process of
  its own, to any request) claims 2^24 blocks, again and again; D must refuse it at once,
  off the data path's lock.

For each kind: D's request latency p50/p99 in the quiet and the hostile phases, and the
delay (hostile p99 - quiet p99), with the target (<= 100 ms). The benchmark acts as the
operator and as the workers' client (`kvtopo.localkeys`: admin calls signed with the
operator's key made beside the client token, peer adds with tickets). Owns nothing else;
imports the worker's transport and protocol for the rogue agent only.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kvtopo import launch
from kvtopo.localkeys import ControlClient, Credentials

DELAY_TARGET_S = 0.100
KINDS = ("stranger_flood", "garbage_flood", "paired_flood", "nixl_paired_flood", "huge_handshake")
RSS_GROWTH_TARGET_MB = 50.0  # the prefill's, under the NIXL-level paired flood


class _Worker:
    """A started worker and a small client of its control API: as the operator on the
    admin routes (signed with its key; a peer add given a ticket minted for this worker),
    with the client token on the traffic routes."""

    def __init__(self, started: launch.StartedWorker, client: ControlClient, role: str) -> None:
        self.started = started
        self.role = role
        self.client = client
        self.engine_id = started.engine_id
        self.endpoint = started.endpoint

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        return self.client.call(
            method,
            self.endpoint,
            path,
            body,
            30,
            fetcher=(self.engine_id, self.started.incarnation),
        )

    def metadata(self) -> bytes:
        """The worker's metadata (rank 0), read with a ticket as a peer it was paired with."""
        return self.client.metadata(self.endpoint)

    def connect(self, peer: _Worker) -> None:
        status, body = self.call(
            "PUT", f"/v1/peers/{peer.engine_id}", {"endpoint": peer.endpoint, "role": peer.role}
        )
        if status != 200:
            raise RuntimeError(f"{self.engine_id} could not add {peer.engine_id}: {body!r}")

    def submit(self, rid: str, peer: _Worker, blocks: int) -> int:
        body = {"request_id": rid, "peer_engine_id": peer.engine_id, "num_blocks": blocks}
        return self.call("POST", "/v1/requests", body)[0]

    def stop(self) -> None:
        launch.stop_process(self.started.proc, 5)


def _rss_mb(pid: int) -> float:
    """A process's resident set (MiB), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class _Victim:
    """D's requests from P, one at a time, each one's latency recorded by phase."""

    def __init__(self, p: _Worker, d: _Worker) -> None:
        self.p, self.d = p, d
        self.phase = "warmup"
        self.latencies: dict[str, list[float]] = {}
        self.failed: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        i = 0
        try:
            while not self._stop.is_set():
                rid, phase = f"victim-{i}", self.phase
                i += 1
                t0 = time.monotonic()
                if self.d.submit(rid, self.p, 4) != 202 or self.p.submit(rid, self.d, 4) != 202:
                    self.failed[phase] = self.failed.get(phase, 0) + 1
                    continue
                outcome = self._outcome(rid, t0 + 60)
                if outcome is None or outcome.get("status") != "done":
                    self.failed[phase] = self.failed.get(phase, 0) + 1
                    continue
                self.latencies.setdefault(phase, []).append(time.monotonic() - t0)
        except Exception as exc:  # reported, the run fails
            self.error = f"{type(exc).__name__}: {exc}"

    def _outcome(self, rid: str, deadline: float) -> dict[str, Any] | None:
        while time.monotonic() < deadline:
            _, body = self.d.call("GET", "/v1/finished")
            for o in body if isinstance(body, list) else []:
                if o.get("request_id") == rid:
                    return dict(o)
            time.sleep(0.001)  # polling the engine's real state
        return None


class _Attack:
    """One kind of hostile load on P, run on a thread of its own while `on` is set."""

    def __init__(self, kind: str, p: _Worker, h: _Worker | None, d: _Worker) -> None:
        self.kind, self.p, self.h, self.d = kind, p, h, d
        self.on = threading.Event()
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._rogue: Any = None
        self._agent = ""
        self._server: Any = None
        self.refused = 0  # huge_handshake: adds answered as refused
        self.answers = 0  # nixl_paired_flood: P's answers the rogue received

    def start(self) -> None:
        if self.kind == "huge_handshake":
            self._rogue, self._server = _huge_peer(self.p)
        elif self.kind == "nixl_paired_flood":
            self._rogue, self._server, self._agent = _paired_rogue(self.p)
        elif self.kind != "paired_flood":
            self._rogue, self._agent = _rogue_agent(self.p)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.on.set()
        self._thread.join(60)
        if self._rogue is not None:
            self._rogue.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _run(self) -> None:
        from kvtopo_worker.protocol import PushCancel, PushRegistration, encode_notification

        i = 0
        while not self._stop.is_set():
            self.on.wait()
            if self._stop.is_set():
                return
            i += 1
            if self.kind == "paired_flood":
                assert self.h is not None
                self.h.submit(f"flood-{i}", self.p, 1)
            elif self.kind == "huge_handshake":
                host, port = self._server.server_address[:2]
                body = {"endpoint": f"{host}:{port}", "role": "prefill"}
                status, _ = self.d.call("PUT", "/v1/peers/huge", body)
                self.refused += status != 200
            elif self.kind == "nixl_paired_flood":
                cancel = PushCancel(
                    request_id=f"flood-{i}",
                    decode_engine_id="rogue",
                    prefill_engine_id=self.p.engine_id,
                )
                self._rogue.send_notif(self._agent, encode_notification(cancel))
                if i % 64 == 0:
                    self.answers += len(self._rogue.get_notifs())
            elif self.kind == "garbage_flood":
                self._rogue.send_notif(self._agent, secrets.token_bytes(512))
            else:
                reg = PushRegistration(
                    request_id=f"flood-{i}",
                    decode_engine_id="stranger",
                    prefill_engine_id=self.p.engine_id,
                    block_ids=list(range(65536)),
                    expires_at=time.time() + 600,
                    write_timeout_s=30,
                )
                self._rogue.send_notif(self._agent, encode_notification(reg))
                if i % 64 == 0:
                    self._rogue.get_notifs()  # keep the rogue's own side drained
            self.sent += 1


def served_peer(
    raw_metadata: bytes,
    compat_hash: str,
    engine_id: str,
    role: str,
    num_blocks: int | None = None,
) -> tuple[Any, Any]:
    """A NIXL agent in this process and a control endpoint (loopback, any port) that serves
    its metadata as engine `engine_id` of `role`, to any GET: what an engine that fetches
    it (told to by the operator) adds. Its KV geometry and compatibility are those of the
    engine whose metadata `raw_metadata` is; `num_blocks` overrides the block count it
    claims. Returns (the agent's transport, the HTTP server); the caller closes both."""
    import http.server

    import torch

    from kvtopo_worker.protocol import decode_metadata, encode_metadata
    from kvtopo_worker.transport import NixlTransport

    meta = decode_metadata(raw_metadata, compat_hash)
    rogue = NixlTransport(f"kvtopo-bench-{engine_id}-{secrets.token_hex(4)}", progress_thread=False)
    rogue.register_kv_cache(torch.zeros((4, meta.block_len), dtype=torch.uint8))
    own = rogue.describe(engine_id=engine_id, role=role, compat=meta.compat)  # type: ignore[arg-type]
    if num_blocks is not None:
        own = msgspec.structs.replace(own, num_blocks=num_blocks)
    payload = encode_metadata(own)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return rogue, server


def _huge_peer(p: _Worker) -> tuple[Any, Any]:
    """A prefill of its own that claims 2^24 blocks (see `served_peer`)."""
    _, state = p.call("GET", "/v1/state")
    return served_peer(p.metadata(), state["compat_hash"], "huge", "prefill", 1 << 24)


def _paired_rogue(p: _Worker) -> tuple[Any, Any, str]:
    """A decode of its own that P adds as the operator would (`PUT /v1/peers/rogue`), and
    that added P's agent: its notifications to P are sealed with their pair key, valid.
    Returns (its transport, its metadata server, P's agent name)."""
    from kvtopo_worker.protocol import decode_metadata

    _, state = p.call("GET", "/v1/state")
    raw = p.metadata()
    rogue, server = served_peer(raw, state["compat_hash"], "rogue", "decode")
    host, port = server.server_address[:2]
    status, body = p.call(
        "PUT", "/v1/peers/rogue", {"endpoint": f"{host}:{port}", "role": "decode"}
    )
    if status != 200:
        raise RuntimeError(f"P did not add the rogue decode: {status} {body!r}")
    agent = rogue.add_remote_peer(decode_metadata(raw, state["compat_hash"]))
    return rogue, server, agent


def _rogue_agent(p: _Worker) -> tuple[Any, str]:
    """A NIXL agent in this process that added P's agent from its metadata (as any process
    that read it could); P never added it."""
    import torch

    from kvtopo_worker.protocol import decode_metadata
    from kvtopo_worker.transport import NixlTransport

    _, state = p.call("GET", "/v1/state")
    raw = p.metadata()
    rogue = NixlTransport("kvtopo-bench-rogue", progress_thread=False)
    rogue.register_kv_cache(torch.zeros((4, 64 * 1024), dtype=torch.uint8))
    agent = rogue.add_remote_peer(decode_metadata(raw, state["compat_hash"]))
    return rogue, agent


def run(
    json_path: Path | None,
    quick: bool,
    log: Callable[[str], None] = print,
    phase_s: float | None = None,
) -> dict[str, Any]:
    """Runs every kind (`phase_s`: each phase's length; default 10 s, 4 s `quick`)."""
    if phase_s is None:
        phase_s = 4.0 if quick else 10.0
    workdir = Path(tempfile.mkdtemp(prefix="kvtopo-bench-isolation-"))
    token_file = workdir / "token"  # the client token; the operator's key pair beside it
    token_file.write_text(secrets.token_hex(16) + "\n")
    creds = Credentials.beside(token_file)
    extra = ("--block-bytes", "16384", "--num-blocks", "4096")
    workers: list[_Worker] = []
    try:

        def start(role: str, name: str) -> _Worker:
            log_path = workdir / f"{name}.log"
            started = launch.start_worker(
                role, token_file, log_path, *extra, "--engine-id", f"bench-{name}"
            )
            return _Worker(started, ControlClient.of(creds), role)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # each imports torch and NIXL
            futures = [
                pool.submit(start, role, name)
                for role, name in (("prefill", "p"), ("decode", "d"), ("decode", "h"))
            ]
            errors = []
            for f in futures:
                try:
                    workers.append(f.result())
                except launch.LaunchError as exc:
                    errors.append(str(exc))
        if errors:
            raise RuntimeError(errors[0])
        p, d, h = workers
        for a, b in ((d, p), (p, d), (h, p), (p, h)):
            a.connect(b)
        victim = _Victim(p, d)
        victim.start()
        time.sleep(1.0)  # warm-up requests, not measured (the stream is already running)
        cases: dict[str, Any] = {}
        for kind in KINDS:
            attack = _Attack(kind, p, h, d)
            attack.start()
            rss_start = _rss_mb(p.started.proc.pid)
            rss_steps: list[float] = []  # P's peak RSS in each step
            try:
                for step, hostile in enumerate((False, True, True, False)):
                    phase = f"{kind}:{'hostile' if hostile else 'quiet'}"
                    victim.phase = phase
                    (attack.on.set if hostile else attack.on.clear)()
                    deadline = time.monotonic() + phase_s
                    peak = _rss_mb(p.started.proc.pid)
                    while time.monotonic() < deadline:
                        time.sleep(0.05)  # the phase's length; the victim measures itself
                        peak = max(peak, _rss_mb(p.started.proc.pid))
                    rss_steps.append(peak)
                    log(f"  {kind} step {step + 1}/4 ({phase}) done")
            finally:
                attack.on.clear()
                attack.stop()
            quiet = victim.latencies.get(f"{kind}:quiet", [])
            hostile_l = victim.latencies.get(f"{kind}:hostile", [])
            delay = _percentile(hostile_l, 0.99) - _percentile(quiet, 0.99)
            cases[kind] = {
                "quiet_requests": len(quiet),
                "hostile_requests": len(hostile_l),
                "quiet_p50_ms": round(1000 * _percentile(quiet, 0.5), 2),
                "quiet_p99_ms": round(1000 * _percentile(quiet, 0.99), 2),
                "hostile_p50_ms": round(1000 * _percentile(hostile_l, 0.5), 2),
                "hostile_p99_ms": round(1000 * _percentile(hostile_l, 0.99), 2),
                "delay_p99_ms": round(1000 * delay, 2),
                "failed": victim.failed.get(f"{kind}:quiet", 0)
                + victim.failed.get(f"{kind}:hostile", 0),
                "hostile_messages": attack.sent,
                "refused_adds": attack.refused,
                # What the attack cost P: its peak under attack over its peak in the first
                # quiet step (the same pair's traffic, no attack); and from the start.
                "prefill_rss_growth_mb": round(max(rss_steps[1:3]) - rss_steps[0], 1),
                "prefill_rss_growth_from_start_mb": round(max(rss_steps) - rss_start, 1),
                "within_target": delay <= DELAY_TARGET_S,
            }
            if kind == "nixl_paired_flood":
                cases[kind]["answers_received"] = attack.answers
                cases[kind]["within_target"] = (
                    delay <= DELAY_TARGET_S
                    and cases[kind]["prefill_rss_growth_mb"] <= RSS_GROWTH_TARGET_MB
                )
            c = cases[kind]
            log(
                f"{kind}: another pair's p99 {c['quiet_p99_ms']} ms quiet, "
                f"{c['hostile_p99_ms']} ms under {attack.sent} hostile messages "
                f"(+{c['delay_p99_ms']} ms; target <= {1000 * DELAY_TARGET_S:.0f} ms); "
                f"P's RSS +{c['prefill_rss_growth_mb']} MB"
            )
        victim.stop()
        if victim.error:
            raise RuntimeError(f"the victim pair's traffic failed: {victim.error}")
        report: dict[str, Any] = {
            "benchmark": "isolation",
            "quick": quick,
            "phase_s": phase_s,
            "delay_target_ms": 1000 * DELAY_TARGET_S,
            "rss_growth_target_mb": RSS_GROWTH_TARGET_MB,
            "cases": cases,
            "all_within_target": all(c["within_target"] for c in cases.values()),
        }
        if json_path is not None:
            json_path.write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        for w in workers:
            w.stop()
