"""`kvtopo bench vllm`: KVTopoConnector beside vLLM's own NixlPushConnector.

Owns the side-by-side run. For each variant, a prefill and a decode vLLM engine
(`python -m kvtopo_worker.vllm.engine --connector kvtopo|nixl`: vLLM's scheduler, the
connector's worker side, real KV tensors and NIXL over loopback; the forward pass stood in
for), with the same model, block size and request stream, driven as a P/D proxy drives them
(the prefill's request, then the decode's with the `kv_transfer_params` the prefill answered,
the same request id on both). The variants, one after another in one run:

- `nixl`: vLLM's NixlPushConnector (it handshakes on the request path);
- `kvtopo`: KVTopoConnector with the operator's part done as the operator does it (the pair
  connected when both engines serve; a replaced engine's new incarnation added), the
  engines holding the operator's public key and no peer token (no lazy handshakes);
- `kvtopo_no_operator`: KVTopoConnector alone (lazy handshakes on the request path, with
  the peer token the engines share; no operator key).

Measured for each:

- `first_request_s`: the first request once both engines serve.
- `steady`: a stream of requests, a few in flight: per-request p50/p99, KV bytes a second
  (every byte verified by the decode), failures; `throughput_ratio` is kvtopo's bytes a
  second over nixl's.
- `replaced_prefill_s`: the prefill SIGKILLed and started again under the same engine id and
  address; the time from its new process serving until a request succeeds again. None when
  none did within `replaced_limit_s`.

Launches the engines by module name; imports neither vLLM nor the worker (only, through
`kvtopo.localkeys`, the worker's pure signing module: this benchmark acts as the operator,
its admin calls signed with the operator's key made beside the client token, its peer adds
carrying tickets).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtopo.localkeys import ControlClient, Credentials

ENGINE_MODULE = "kvtopo_worker.vllm.engine"
BLOCK_SIZE = 32  # vLLM's CPU attention backend (which NixlPushConnector's worker loads) needs n*32
START_TIMEOUT_S = 300.0  # an engine's start (vLLM's imports and set-up: ~30 s here)
REPLACED_LIMIT_S = 60.0  # how long a replaced prefill is given to serve requests again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Engine:
    role: str
    engine_id: str
    endpoint: str
    incarnation: str
    proc: subprocess.Popen[str]
    client: ControlClient  # the operator's key (admin routes, tickets), the client token

    def call(self, method: str, path: str, body: object = None, timeout: float = 10) -> Any:
        """The answer to a call with the credential its route takes (a peer add given the
        ticket the operator mints for this engine); RuntimeError for an HTTP error."""
        status, answer = self.client.call(
            method, self.endpoint, path, body, timeout, fetcher=(self.engine_id, self.incarnation)
        )
        if status >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {str(answer)[:300]!r}")
        return answer

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass(frozen=True)
class Variant:
    """One side of the comparison: a connector, and whether the operator connects the pair
    (kvtopo only: it pre-warms the pair when the pods serve and adds a replaced engine's new
    incarnation; without it the connector handshakes lazily on the request path)."""

    name: str
    connector: str
    operator: bool


VARIANTS = (
    Variant("nixl", "nixl", operator=False),
    Variant("kvtopo", "kvtopo", operator=True),
    Variant("kvtopo_no_operator", "kvtopo", operator=False),
)


class _Pair:
    """A prefill and a decode engine of one connector."""

    def __init__(
        self, variant: Variant, workdir: Path, creds: Credentials, peer_token_file: Path
    ) -> None:
        self.variant = variant
        self.connector = variant.connector
        self.workdir = workdir
        self.creds = creds
        self.peer_token_file = peer_token_file
        self.client = ControlClient.of(creds)
        self.ports = {role: (_free_port(), _free_port()) for role in ("prefill", "decode")}
        self.prefill: _Engine | None = None
        self.decode: _Engine | None = None
        self.seq = 0
        self.seq_lock = threading.Lock()
        self.outcome_lock = threading.Lock()
        self.outcomes: dict[str, dict[str, Any]] = {}

    def spawn(self, role: str) -> tuple[subprocess.Popen[str], Path]:
        control, side = self.ports[role]
        env = dict(
            os.environ,
            VLLM_TARGET_DEVICE="cpu",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        log = self.workdir / f"{self.variant.name}-{role}-{time.monotonic_ns()}.log"
        argv = [
            sys.executable,
            "-m",
            ENGINE_MODULE,
            "--role",
            role,
            "--engine-id",
            f"{self.variant.name}-{role}",
            "--port",
            str(control),
            "--token-file",
            str(self.creds.client_token),
            "--connector",
            self.connector,
            "--block-size",
            str(BLOCK_SIZE),
            "--num-blocks",
            "512",
            "--registration-timeout",
            "5",
            "--kv-lease",
            "20",
            "--transfer-timeout",
            "5",
            "--drain-timeout",
            "1",
        ]
        if self.variant.operator:  # the admin routes take the operator's signed calls
            argv += ["--operator-key-file", str(self.creds.operator_public)]
        elif self.connector == "kvtopo":  # paired lazily, with the peer token
            argv += ["--peer-token-file", str(self.peer_token_file)]
        with log.open("w") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=self.workdir
            )
        return proc, log

    def ready(self, role: str, spawned: tuple[subprocess.Popen[str], Path]) -> _Engine:
        proc, log = spawned
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not line and proc.poll() is None and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        if not line:
            proc.kill()
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {self.variant.name} {role} engine did not start:\n{tail}")
        info = json.loads(line)
        engine = _Engine(
            role, info["engine_id"], info["endpoint"], info["incarnation"], proc, self.client
        )
        # A new process at this address: the challenge held for the one before is stale
        # (the next peer add's ticket must be minted from the new one's).
        self.client.challenges.pop(engine.endpoint, None)
        if role == "prefill":
            self.prefill = engine
        else:
            self.decode = engine
        return engine

    def start(self) -> None:
        p, d = self.spawn("prefill"), self.spawn("decode")
        self.ready("prefill", p)
        self.ready("decode", d)

    def connect(self) -> None:
        """What the operator does when the pods come up (kvtopo only)."""
        assert self.prefill is not None and self.decode is not None
        for a, b in ((self.decode, self.prefill), (self.prefill, self.decode)):
            body = {"endpoint": b.endpoint, "role": b.role}
            if b.incarnation:
                body["incarnation"] = b.incarnation
            a.call("PUT", f"/v1/peers/{b.engine_id}", body, timeout=30)

    def request(self, blocks: int, timeout: float = 30) -> tuple[bool, float, int]:
        """One request through the proxy flow: (done, seconds, verified bytes)."""
        assert self.prefill is not None and self.decode is not None
        with self.seq_lock:
            self.seq += 1
            rid = f"bench-{self.variant.name}-{self.seq}"
        prompt = blocks * BLOCK_SIZE
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        self.prefill.call(
            "POST",
            "/v1/vllm/requests",
            {
                "request_id": rid,
                "prompt_len": prompt,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        params = None
        while params is None and time.monotonic() < deadline:
            finished = self.prefill.call("GET", f"/v1/vllm/requests/{rid}")["finished"]
            if finished is not None:
                params = finished["kv_transfer_params"]
                if params is None:
                    return False, time.perf_counter() - t0, 0
            else:
                time.sleep(0.001)
        if params is None:
            return False, time.perf_counter() - t0, 0
        self.decode.call(
            "POST",
            "/v1/vllm/requests",
            {
                "request_id": rid,
                "prompt_len": prompt,
                "max_tokens": 1,
                "kv_transfer_params": params,
                "content_id": rid,
            },
        )
        while time.monotonic() < deadline:
            if (o := self._outcome(rid)) is not None:
                return o["status"] == "done", time.perf_counter() - t0, o["verified_bytes"]
            time.sleep(0.001)
        return False, time.perf_counter() - t0, 0

    def _outcome(self, rid: str) -> dict[str, Any] | None:
        """The decode's outcome of `rid` once it ended (the decode hands each outcome out
        once, so whichever client asks keeps them all for the others)."""
        assert self.decode is not None
        with self.outcome_lock:
            if rid not in self.outcomes:
                for o in self.decode.call("GET", "/v1/finished"):
                    self.outcomes[o["request_id"]] = o
            return self.outcomes.pop(rid, None)

    def stop(self) -> None:
        for e in (self.prefill, self.decode):
            if e is not None:
                e.stop()


def _stream(pair: _Pair, n: int, blocks: int, in_flight: int) -> dict[str, Any]:
    """`n` requests, `in_flight` at a time, each through the proxy flow."""
    times: list[float] = []
    nbytes = failed = 0
    lock = threading.Lock()
    todo = iter(range(n))

    def client() -> None:
        nonlocal nbytes, failed
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            ok, took, got = pair.request(blocks)
            with lock:
                if ok:
                    times.append(took)
                    nbytes += got
                else:
                    failed += 1

    t0 = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(in_flight)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    times.sort()
    return {
        "requests": n,
        "in_flight": in_flight,
        "failed": failed,
        "blocks_per_request": blocks,
        "p50_ms": round(statistics.median(times) * 1000, 2) if times else None,
        "p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1000, 2) if times else None,
        "bytes_per_s": round(nbytes / wall) if wall > 0 else 0,
    }


def _run_variant(
    variant: Variant,
    workdir: Path,
    creds: Credentials,
    peer_token_file: Path,
    sizes: tuple[int, int, int],
    log: Callable[[str], None],
) -> dict[str, Any]:
    n, blocks, in_flight = sizes
    pair = _Pair(variant, workdir, creds, peer_token_file)
    out: dict[str, Any] = {"variant": variant.name, "connector": variant.connector}
    name = variant.name
    try:
        log(f"  {name}: starting a prefill and a decode engine")
        pair.start()
        if variant.operator:
            pair.connect()
        ok, first, _ = pair.request(blocks, timeout=60)
        out["first_request_s"] = round(first, 4) if ok else None
        log(f"  {name}: first request {first * 1000:.0f} ms ({'done' if ok else 'failed'})")
        out["steady"] = _stream(pair, n, blocks, in_flight)
        log(f"  {name}: steady {out['steady']}")
        # The prefill replaced under the same engine id and address.
        assert pair.prefill is not None
        pair.prefill.stop(signal.SIGKILL)
        pair.ready("prefill", pair.spawn("prefill"))
        served = time.monotonic()
        if variant.operator:
            pair.connect()  # the operator adds the new incarnation
        recovered = None
        attempts = 0
        while time.monotonic() - served < REPLACED_LIMIT_S:
            attempts += 1
            ok, _, _ = pair.request(1, timeout=10)
            if ok:
                recovered = time.monotonic() - served
                break
        out["replaced_prefill_s"] = round(recovered, 3) if recovered is not None else None
        out["replaced_prefill_attempts"] = attempts
        said = f"{recovered:.2f} s" if recovered is not None else f"none in {REPLACED_LIMIT_S} s"
        log(f"  {name}: prefill replaced -> a request succeeds after {said} ({attempts} tries)")
    finally:
        pair.stop()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def run(
    json_path: Path | None,
    quick: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    sizes = (24, 8, 2) if quick else (200, 16, 4)
    n, blocks, in_flight = sizes
    workdir = Path(tempfile.mkdtemp(prefix="kvtopo-bench-vllm-"))
    token_file = workdir / "token"  # the client token; the operator's key pair beside it
    token_file.write_text(secrets.token_hex(16) + "\n")
    creds = Credentials.beside(token_file)
    peer_token_file = workdir / "peer-token"  # what the engines pairing lazily share
    peer_token_file.write_text(secrets.token_hex(16) + "\n")
    log(
        f"kvtopo bench vllm: {n} requests of {blocks} blocks of {BLOCK_SIZE} tokens, "
        f"{in_flight} in flight, per variant; engine logs in {workdir}"
    )
    runs = [_run_variant(v, workdir, creds, peer_token_file, sizes, log) for v in VARIANTS]
    by = {r["variant"]: r for r in runs}
    report = {
        "block_size": BLOCK_SIZE,
        "replaced_limit_s": REPLACED_LIMIT_S,
        "runs": runs,
        "throughput_ratio": _ratio(
            by["kvtopo"]["steady"]["bytes_per_s"], by["nixl"]["steady"]["bytes_per_s"]
        ),
        "throughput_ratio_no_operator": _ratio(
            by["kvtopo_no_operator"]["steady"]["bytes_per_s"], by["nixl"]["steady"]["bytes_per_s"]
        ),
    }
    log(format_table(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, one column per variant."""
    runs = report["runs"]

    def cell(value: float | None, fmt: str, none: str) -> str:
        return none if value is None else fmt.format(value)

    limit = f"none in {report['replaced_limit_s']:.0f} s"
    rows = [
        ("first request after the engines serve", "first_request_s", "{:.3f} s", "failed"),
        ("prefill replaced -> a request succeeds", "replaced_prefill_s", "{:.2f} s", limit),
    ]
    lines = [
        "| | " + " | ".join(r["variant"] for r in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for label, key, fmt, none in rows:
        lines.append(f"| {label} | " + " | ".join(cell(r[key], fmt, none) for r in runs) + " |")
    for label, key, fmt in (
        ("steady p50", "p50_ms", "{:.1f} ms"),
        ("steady p99", "p99_ms", "{:.1f} ms"),
        ("steady KV bytes/s", "bytes_per_s", "{:,.0f}"),
        ("steady failed", "failed", "{}"),
    ):
        values = [cell(r["steady"][key], fmt, "-") for r in runs]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    lines.append(
        f"\nthroughput kvtopo/nixl: {report['throughput_ratio']} "
        f"(without the operator: {report['throughput_ratio_no_operator']})"
    )
    return "\n".join(lines)
