"""`kvtopo bench vllm`: KVTopoConnector beside vLLM's own NixlPushConnector.

Owns the side-by-side run: for each connector, a prefill and a decode vLLM engine
(`python -m kvtopo_worker.vllm.engine --connector kvtopo|nixl`: vLLM's scheduler, the
connector's worker side per TP rank, real KV tensors and NIXL over loopback; the forward
pass stood in for), the same block size and model for both, driven as a P/D proxy drives
them (the prefill's request, then the decode's with the `kv_transfer_params` the prefill
answered, the same request id on both). Measured for each:

- `first_request_s`: the first request after both engines serve. kvtopo's pair is connected
  first, as the operator connects it when the pods come up; vLLM's connector handshakes on
  the request path.
- `steady`: a stream of requests one after another: per-request p50/p99 and KV bytes a
  second (every byte verified by the decode); `throughput_ratio` is kvtopo's over vLLM's.
- `replaced_prefill_s`: the prefill SIGKILLed and started again under the same engine id and
  address; the time from its new process serving until a request succeeds again (kvtopo:
  with the operator's add of the new incarnation, as it makes one when the pod's engine
  comes back). None when none succeeded within the limit.

Launches the engines by module name; imports neither vLLM nor the worker.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_MODULE = "kvtopo_worker.vllm.engine"
BLOCK_SIZE = 32  # vLLM's CPU attention backend (which NixlPushConnector's worker loads) needs n*32
START_TIMEOUT_S = 300.0


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
    token: str

    def call(self, method: str, path: str, body: object = None, timeout: float = 10) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.endpoint}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (http only)
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"{method} {path}: HTTP {err.code}: {err.read()[:300]!r}") from None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class _Pair:
    """A prefill and a decode engine of one connector."""

    def __init__(self, connector: str, workdir: Path, token_file: Path, token: str) -> None:
        self.connector = connector
        self.workdir = workdir
        self.token_file = token_file
        self.token = token
        self.ports = {role: (_free_port(), _free_port()) for role in ("prefill", "decode")}
        self.prefill: _Engine | None = None
        self.decode: _Engine | None = None
        self.seq = 0

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
        log = self.workdir / f"{self.connector}-{role}-{time.monotonic_ns()}.log"
        argv = [
            sys.executable,
            "-m",
            ENGINE_MODULE,
            "--role",
            role,
            "--engine-id",
            f"{self.connector}-{role}",
            "--port",
            str(control),
            "--token-file",
            str(self.token_file),
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
        with log.open("w") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=self.workdir
            )
        return proc, log

    def ready(self, role: str, spawned: tuple[subprocess.Popen[str], Path]) -> _Engine:
        proc, log = spawned
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {self.connector} {role} engine did not start:\n{tail}")
        info = json.loads(line)
        engine = _Engine(
            role, info["engine_id"], info["endpoint"], info["incarnation"], proc, self.token
        )
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
        self.seq += 1
        rid = f"bench-{self.connector}-{self.seq}"
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
            for o in self.decode.call("GET", "/v1/finished"):
                if o["request_id"] == rid:
                    return o["status"] == "done", time.perf_counter() - t0, o["verified_bytes"]
            time.sleep(0.001)
        return False, time.perf_counter() - t0, 0

    def stop(self) -> None:
        for e in (self.prefill, self.decode):
            if e is not None:
                e.stop()


def _run_connector(
    connector: str, workdir: Path, token_file: Path, token: str, n: int, blocks: int, log: Any
) -> dict[str, Any]:
    pair = _Pair(connector, workdir, token_file, token)
    out: dict[str, Any] = {"connector": connector}
    try:
        log(f"  {connector}: starting a prefill and a decode engine")
        pair.start()
        if connector == "kvtopo":
            pair.connect()
        ok, first, _ = pair.request(blocks, timeout=60)
        out["first_request_s"] = round(first, 4) if ok else None
        log(f"  {connector}: first request {first * 1000:.0f} ms ({'done' if ok else 'failed'})")
        times, nbytes, failed = [], 0, 0
        t0 = time.perf_counter()
        for _ in range(n):
            ok, took, got = pair.request(blocks)
            if ok:
                times.append(took)
                nbytes += got
            else:
                failed += 1
        wall = time.perf_counter() - t0
        out["steady"] = {
            "requests": n,
            "failed": failed,
            "blocks_per_request": blocks,
            "p50_ms": round(statistics.median(times) * 1000, 2) if times else None,
            "p99_ms": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1000, 2)
            if times
            else None,
            "bytes_per_s": round(nbytes / wall) if wall > 0 else 0,
        }
        log(f"  {connector}: steady {out['steady']}")
        # The prefill replaced under the same engine id and address.
        assert pair.prefill is not None
        pair.prefill.stop(signal.SIGKILL)
        spawned = pair.spawn("prefill")
        pair.ready("prefill", spawned)
        served = time.monotonic()
        if connector == "kvtopo":
            pair.connect()  # the operator adds the new incarnation
        recovered = None
        attempts = 0
        while time.monotonic() - served < 60:
            attempts += 1
            ok, _, _ = pair.request(1, timeout=10)
            if ok:
                recovered = time.monotonic() - served
                break
        out["replaced_prefill_s"] = round(recovered, 3) if recovered is not None else None
        out["replaced_prefill_attempts"] = attempts
        log(f"  {connector}: replaced prefill -> success after {recovered} s ({attempts} tries)")
    finally:
        pair.stop()
    return out


def run(
    json_path: Path | None,
    quick: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    n, blocks = (20, 8) if quick else (100, 16)
    workdir = Path(tempfile.mkdtemp(prefix="kvtopo-bench-vllm-"))
    token = secrets.token_hex(16)
    token_file = workdir / "token"
    token_file.write_text(token + "\n")
    log(
        f"kvtopo bench vllm: {n} requests of {blocks} blocks of {BLOCK_SIZE} tokens; logs in "
        f"{workdir}"
    )
    results = [
        _run_connector(c, workdir, token_file, token, n, blocks, log) for c in ("nixl", "kvtopo")
    ]
    by = {r["connector"]: r for r in results}
    ratio = None
    if by["nixl"]["steady"]["bytes_per_s"]:
        ratio = round(
            by["kvtopo"]["steady"]["bytes_per_s"] / by["nixl"]["steady"]["bytes_per_s"], 3
        )
    report = {"block_size": BLOCK_SIZE, "runs": results, "throughput_ratio": ratio}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
