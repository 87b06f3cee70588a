"""`kvtopo bench vllm`: KVTopoConnector beside vLLM's own NixlPushConnector.

Owns the side-by-side run. For each variant, a prefill and a decode vLLM engine
(`python -m kvtopo_worker.vllm.engine --connector kvtopo|nixl`: vLLM's scheduler, the
connector's worker side, real KV tensors and NIXL over loopback; the forward pass stood in
for), with the same model, block size and request stream, driven as a P/D proxy drives them
(the prefill's request, then the decode's with the `kv_transfer_params` the prefill answered,
the same request id on both). The variants:

- `nixl`: vLLM's NixlPushConnector as vLLM ships it (it handshakes on the request path; its
  NIXL agents run NIXL's busy-polling progress thread, which vLLM has no setting for, and
  4 UCX backend threads, vLLM's default `num_threads`);
- `kvtopo`: KVTopoConnector as it ships, with the operator's part done as the operator does
  it (the pair connected when both engines serve; a replaced engine's new incarnation added),
  the engines holding the operator's public key and no peer token (no lazy handshakes). Its
  progress thread is its default on this host (off below 8 cores);
- `kvtopo_progress_thread`: the same with the NIXL agent settings vLLM's connector runs
  (progress thread on, 4 UCX backend threads): the connector-to-connector comparison;
- `kvtopo_no_operator`: KVTopoConnector alone (lazy handshakes on the request path, with
  the peer token the engines share; no operator key).

The variants run interleaved, in rounds alternating their order (A B B A ...), each run a
fresh engine pair; the report has every run's figures and each variant's medians over its
runs. Each run measures:

- `first_request_s`: the first request once both engines serve;
- `small`: a latency-bound phase, requests of one block (`BLOCK_BYTES`) one at a time;
- `large`: a bandwidth-bound phase, requests of `LARGE_BLOCKS` blocks (what one prefill
  step computes), `LARGE_IN_FLIGHT` in flight;
  each: per-request latency p50/p99 (the proxy's round trip: the prefill's submission to the
  decode's outcome, every byte verified), KV bytes a second, failures, and the CPU seconds
  the prefill and the decode engine process used during it (/proc: threads and children
  included), also per GB moved;
- `replaced_prefill_s` (each variant's first run): the prefill SIGKILLed and started again
  under the same engine id and address; the time from its new process serving until a
  request succeeds again. None when none did within `replaced_limit_s`;
- `nixl_agent`: each engine's NIXL agent settings, as the engine reported them.

The ratios are a variant's median over nixl's, each named for what it measures
(`p50_ratio_small`, `kv_bytes_per_s_ratio_large`, `cpu_s_per_gb_ratio_large`, ...).

The engines' model is a config.json written here (no weights): 16 KiB of KV per token, so a
block of 32 tokens is 512 KiB and a 16-block request 8 MiB. A request is at most what one
prefill step computes (the engine's 512 batched tokens: 16 blocks).

Launches the engines by module name; imports neither vLLM nor the worker (only, through
`kvtopo.localkeys`, the worker's pure signing module: this benchmark acts as the operator,
its admin calls signed with the operator's key made beside the client token, its peer adds
carrying tickets).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtopo.localkeys import ControlClient, Credentials
from kvtopo.ports import free_port

ENGINE_MODULE = "kvtopo_worker.vllm.engine"
BLOCK_SIZE = 32  # vLLM's CPU attention backend (which NixlPushConnector's worker loads) needs n*32
START_TIMEOUT_S = 300.0  # an engine's start (vLLM's imports and set-up: ~30 s here)
REPLACED_LIMIT_S = 60.0  # how long a replaced prefill is given to serve requests again
NUM_BLOCKS = 256  # KV blocks per engine (128 MiB)

# The engines' model: Llama-shaped, no weights (nothing loads them). 8 layers x K and V x
# 4 KV heads x 64 x float32 = 16 KiB of KV per token.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TOKEN_BYTES = (
    MODEL_CONFIG["num_hidden_layers"]
    * 2
    * MODEL_CONFIG["num_key_value_heads"]
    * MODEL_CONFIG["head_dim"]
    * 4
)
BLOCK_BYTES = TOKEN_BYTES * BLOCK_SIZE  # 512 KiB
SMALL_BLOCKS = 1  # 512 KiB, one at a time
LARGE_BLOCKS = 16  # 8 MiB: 512 tokens, what one prefill step of the engine computes
LARGE_IN_FLIGHT = 4
WARMUP = 2  # requests of each phase's size before it is measured


@dataclass(frozen=True)
class Sizes:
    """How many requests each phase of a run measures, and how many rounds run."""

    small_requests: int
    large_requests: int
    rounds: int
    replaced_limit_s: float


FULL = Sizes(small_requests=100, large_requests=80, rounds=4, replaced_limit_s=REPLACED_LIMIT_S)
QUICK = Sizes(small_requests=12, large_requests=12, rounds=2, replaced_limit_s=20.0)


def _free_port() -> int:
    return free_port()


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """The CPU seconds (user + system) process `pid` used: all its threads, the children it
    reaped, and (recursively) its live children. 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    # After "pid (comm) ": state is field 3, utime 14, stime 15, cutime 16, cstime 17.
    fields = stat[stat.rindex(")") + 2 :].split()
    total = sum(int(f) for f in fields[11:15]) / _TICK
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(cpu_seconds(int(child)) for child in children)
    return total


def host_cpu_seconds() -> float:
    """CPU seconds every process on this host has used (busy time summed over its cores,
    /proc/stat); 0 where there is no /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return 0.0
    ticks = [int(f) for f in first[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


@dataclass
class _Engine:
    role: str
    engine_id: str
    endpoint: str
    incarnation: str
    nixl_agent: dict[str, Any]  # the NIXL agent settings the engine reported
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
    """One side of the comparison: a connector; whether the operator connects the pair
    (kvtopo only: it pre-warms the pair when the pods serve and adds a replaced engine's new
    incarnation; without it the connector handshakes lazily on the request path); and the
    engines' NIXL agent settings (`--progress-thread`, `--nixl-num-threads`; "auto" and
    None: the connector's own)."""

    name: str
    connector: str
    operator: bool
    progress_thread: str = "auto"
    nixl_num_threads: int | None = None


VARIANTS = (
    Variant("nixl", "nixl", operator=False),
    Variant("kvtopo", "kvtopo", operator=True),
    Variant("kvtopo_progress_thread", "kvtopo", True, progress_thread="on", nixl_num_threads=4),
    Variant("kvtopo_no_operator", "kvtopo", operator=False),
)


def run_order(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: the variants in order, then reversed, and so
    on (A B, B A, A B, ...: with 2 rounds each variant's mean position is the same)."""
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        order += [(r + 1, n) for n in (names if r % 2 == 0 else list(reversed(names)))]
    return order


class _Pair:
    """A prefill and a decode engine of one connector."""

    def __init__(
        self,
        variant: Variant,
        workdir: Path,
        model_dir: Path,
        creds: Credentials,
        peer_token_file: Path,
    ) -> None:
        self.variant = variant
        self.connector = variant.connector
        self.workdir = workdir
        self.model_dir = model_dir
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
        # The NIXL settings are the variant's alone: none inherited from this environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOPO_NIXL_")}
        env.update(
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
            "--model-dir",
            str(self.model_dir),
            "--block-size",
            str(BLOCK_SIZE),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--progress-thread",
            self.variant.progress_thread,
            "--registration-timeout",
            "5",
            "--kv-lease",
            "20",
            "--transfer-timeout",
            "5",
            "--drain-timeout",
            "1",
        ]
        if self.variant.nixl_num_threads is not None:
            argv += ["--nixl-num-threads", str(self.variant.nixl_num_threads)]
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
            role,
            info["engine_id"],
            info["endpoint"],
            info["incarnation"],
            dict(info.get("nixl_agent") or {}),
            proc,
            self.client,
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

    def cpu(self) -> dict[str, float]:
        """CPU seconds each engine process has used so far."""
        assert self.prefill is not None and self.decode is not None
        return {
            "prefill": cpu_seconds(self.prefill.proc.pid),
            "decode": cpu_seconds(self.decode.proc.pid),
        }

    def stop(self) -> None:
        for e in (self.prefill, self.decode):
            if e is not None:
                e.stop()


def _stream(pair: _Pair, n: int, blocks: int, in_flight: int) -> dict[str, Any]:
    """`n` requests of `blocks` blocks, `in_flight` at a time, each through the proxy flow
    (after `WARMUP` unmeasured ones); the CPU seconds each engine process used meanwhile."""
    for _ in range(WARMUP):
        # A warm-up's failure (an HTTP error, a timeout) shows in the measured requests.
        with contextlib.suppress(Exception):
            pair.request(blocks)
    times: list[float] = []
    nbytes = failed = 0
    errors: list[str] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def client() -> None:
        nonlocal nbytes, failed
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            try:
                ok, took, got = pair.request(blocks)
            except Exception as exc:  # an HTTP error or a timeout: the request failed
                ok, took, got = False, 0.0, 0
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            with lock:
                if ok:
                    times.append(took)
                    nbytes += got
                else:
                    failed += 1

    cpu0, host0, own0 = pair.cpu(), host_cpu_seconds(), time.process_time()
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(in_flight)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    cpu1, host1, own1 = pair.cpu(), host_cpu_seconds(), time.process_time()
    cpu = {role: cpu1[role] - cpu0[role] for role in cpu0}
    # What else ran meanwhile: the host's CPU seconds less the engines' and this process's
    # (the other load of a shared machine, to tell a disturbed run).
    others = (host1 - host0) - sum(cpu.values()) - (own1 - own0)
    times.sort()
    gb = nbytes / 1e9
    return {
        "requests": n,
        "in_flight": in_flight,
        "blocks_per_request": blocks,
        "bytes_per_request": blocks * BLOCK_BYTES,
        "failed": failed,
        "errors": errors[:3],
        "p50_ms": statistics.median(times) * 1000 if times else None,
        "p99_ms": times[int(0.99 * (len(times) - 1))] * 1000 if times else None,
        "kv_bytes": nbytes,
        "wall_s": wall,
        "kv_bytes_per_s": nbytes / wall if wall > 0 else 0.0,
        "cpu_s": cpu,
        "cpu_s_per_gb": sum(cpu.values()) / gb if gb > 0 else None,
        "bench_cpu_s": own1 - own0,
        "other_cpu_s": max(0.0, others),
    }


def _run_variant(
    variant: Variant,
    workdir: Path,
    model_dir: Path,
    creds: Credentials,
    peer_token_file: Path,
    sizes: Sizes,
    log: Callable[[str], None],
    *,
    replaced: bool,
) -> dict[str, Any]:
    pair = _Pair(variant, workdir, model_dir, creds, peer_token_file)
    out: dict[str, Any] = {"variant": variant.name, "connector": variant.connector}
    name = variant.name
    try:
        log(f"  {name}: starting a prefill and a decode engine")
        pair.start()
        assert pair.prefill is not None and pair.decode is not None
        out["nixl_agent"] = {
            "prefill": pair.prefill.nixl_agent,
            "decode": pair.decode.nixl_agent,
        }
        if variant.operator:
            pair.connect()
        ok, first, _ = pair.request(SMALL_BLOCKS, timeout=60)
        out["first_request_s"] = first if ok else None
        log(f"  {name}: first request {first * 1000:.0f} ms ({'done' if ok else 'failed'})")
        for phase, n, blocks, in_flight in (
            ("small", sizes.small_requests, SMALL_BLOCKS, 1),
            ("large", sizes.large_requests, LARGE_BLOCKS, LARGE_IN_FLIGHT),
        ):
            res = out[phase] = _stream(pair, n, blocks, in_flight)
            log(
                f"  {name}: {phase}: p50 {_fmt(res['p50_ms'], '{:.1f}')} ms, "
                f"{res['kv_bytes_per_s'] / 1e6:.1f} MB/s, CPU s prefill "
                f"{res['cpu_s']['prefill']:.2f} decode {res['cpu_s']['decode']:.2f}, "
                f"{res['failed']} failed"
            )
        out["threads"] = {
            "prefill": _thread_count(pair.prefill.proc.pid),
            "decode": _thread_count(pair.decode.proc.pid),
        }
        if not replaced:
            return out
        # The prefill replaced under the same engine id and address.
        pair.prefill.stop(signal.SIGKILL)
        pair.ready("prefill", pair.spawn("prefill"))
        served = time.monotonic()
        if variant.operator:
            pair.connect()  # the operator adds the new incarnation
        recovered = None
        attempts = 0
        while time.monotonic() - served < sizes.replaced_limit_s:
            attempts += 1
            ok, _, _ = pair.request(SMALL_BLOCKS, timeout=10)
            if ok:
                recovered = time.monotonic() - served
                break
        out["replaced_prefill_s"] = recovered
        out["replaced_prefill_attempts"] = attempts
        said = f"{recovered:.2f} s" if recovered is not None else "none"
        log(f"  {name}: prefill replaced -> a request succeeds after {said} ({attempts} tries)")
    finally:
        pair.stop()
    return out


def _fmt(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _agent_said(runs: Sequence[dict[str, Any]]) -> str:
    """The NIXL agent settings of a variant's engines, as they reported them (one phrase
    when all agree)."""
    said = []
    for run in runs:
        for agent in run.get("nixl_agent", {}).values():
            if not agent:
                phrase = "not reported"
            else:
                thread = "on" if agent.get("progress_thread") else "off"
                phrase = f"progress thread {thread}, {agent.get('num_threads')} UCX threads"
            if phrase not in said:
                said.append(phrase)
    return " / ".join(said) or "not reported"


PHASE_FIGURES = ("p50_ms", "p99_ms", "kv_bytes_per_s", "cpu_s_per_gb")
RATIOS = (
    # (name, phase, figure): a variant's median over nixl's
    ("p50_ratio_small", "small", "p50_ms"),
    ("p99_ratio_small", "small", "p99_ms"),
    ("kv_bytes_per_s_ratio_small", "small", "kv_bytes_per_s"),
    ("p50_ratio_large", "large", "p50_ms"),
    ("kv_bytes_per_s_ratio_large", "large", "kv_bytes_per_s"),
    ("cpu_s_per_gb_ratio_small", "small", "cpu_s_per_gb"),
    ("cpu_s_per_gb_ratio_large", "large", "cpu_s_per_gb"),
)


def aggregate(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Each variant's medians over its runs, and each variant's ratios to nixl's medians
    (from the medians as measured, not rounded)."""
    variants = []
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue
        entry: dict[str, Any] = {
            "variant": name,
            "connector": mine[0]["connector"],
            "runs": len(mine),
            "nixl_agent": _agent_said(mine),
            "first_request_s": _median([r.get("first_request_s") for r in mine]),
        }
        measured = [r for r in mine if "replaced_prefill_s" in r]
        entry["replaced_prefill_s"] = (
            _median([r["replaced_prefill_s"] for r in measured]) if measured else None
        )
        entry["replaced_measured"] = len(measured)
        for phase in ("small", "large"):
            ph = [r[phase] for r in mine if phase in r]
            if not ph:
                continue
            agg: dict[str, Any] = {f: _median([p[f] for p in ph]) for f in PHASE_FIGURES}
            agg["cpu_s"] = {
                role: _median([p["cpu_s"][role] for p in ph]) for role in ("prefill", "decode")
            }
            agg["bytes_per_request"] = ph[0]["bytes_per_request"]
            agg["in_flight"] = ph[0]["in_flight"]
            agg["failed"] = sum(p["failed"] for p in ph)
            entry[phase] = agg
        variants.append(entry)
    by = {v["variant"]: v for v in variants}
    ratios: dict[str, dict[str, float | None]] = {}
    base = by.get("nixl")
    for v in variants:
        if base is None or v is base:
            continue
        ratios[v["variant"]] = {}
        for ratio, phase, figure in RATIOS:
            a = v.get(phase, {}).get(figure)
            b = base.get(phase, {}).get(figure)
            ratios[v["variant"]][ratio] = a / b if a is not None and b else None
    return {"variants": variants, "ratios": ratios}


def run(
    json_path: Path | None,
    quick: bool = False,
    log: Callable[[str], None] = print,
    rounds: int | None = None,
    variants: Sequence[str] | None = None,
) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    if rounds is not None:
        if rounds < 1:
            raise RuntimeError("--rounds must be at least 1")
        sizes = Sizes(sizes.small_requests, sizes.large_requests, rounds, sizes.replaced_limit_s)
    known = {v.name: v for v in VARIANTS}
    names = list(variants) if variants else list(known)
    if unknown := [n for n in names if n not in known]:
        raise RuntimeError(f"unknown variants {unknown}; known: {', '.join(known)}")
    workdir = Path(tempfile.mkdtemp(prefix="kvtopo-bench-vllm-"))
    model_dir = workdir / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2))
    token_file = workdir / "token"  # the client token; the operator's key pair beside it
    token_file.write_text(secrets.token_hex(16) + "\n")
    creds = Credentials.beside(token_file)
    peer_token_file = workdir / "peer-token"  # what the engines pairing lazily share
    peer_token_file.write_text(secrets.token_hex(16) + "\n")
    order = run_order(names, sizes.rounds)
    log(
        f"kvtopo bench vllm: {len(order)} runs ({sizes.rounds} rounds, order "
        f"{' '.join(n for _, n in order)}); per run {sizes.small_requests} requests of "
        f"{SMALL_BLOCKS * BLOCK_BYTES >> 10} KiB one at a time, then {sizes.large_requests} "
        f"of {LARGE_BLOCKS * BLOCK_BYTES >> 20} MiB {LARGE_IN_FLIGHT} in flight; engine logs "
        f"in {workdir}"
    )
    runs = []
    seen: set[str] = set()
    for i, (rnd, name) in enumerate(order, 1):
        log(f"run {i}/{len(order)} (round {rnd}): {name}")
        started = time.time()
        res = _run_variant(
            known[name],
            workdir,
            model_dir,
            creds,
            peer_token_file,
            sizes,
            log,
            replaced=name not in seen,
        )
        seen.add(name)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        runs.append({"run": i, "round": rnd, "started_at": started, "loadavg_1m": load, **res})
    report: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "block_bytes": BLOCK_BYTES,
        "token_bytes": TOKEN_BYTES,
        "model": MODEL_CONFIG,
        "cpu_count": os.cpu_count(),
        "rounds": sizes.rounds,
        "order": [n for _, n in order],
        "replaced_limit_s": sizes.replaced_limit_s,
        "small": {"blocks": SMALL_BLOCKS, "bytes": SMALL_BLOCKS * BLOCK_BYTES, "in_flight": 1},
        "large": {
            "blocks": LARGE_BLOCKS,
            "bytes": LARGE_BLOCKS * BLOCK_BYTES,
            "in_flight": LARGE_IN_FLIGHT,
        },
        **aggregate(runs, names),
        "runs": runs,
    }
    log(format_table(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def format_table(report: dict[str, Any]) -> str:
    """The report as Markdown: each variant's medians side by side, what each ratio
    measures, the ratios, then every run."""
    variants = report["variants"]
    small, large = report["small"], report["large"]
    s_said = f"{_size(small['bytes'])} x {small['in_flight']} in flight"
    l_said = f"{_size(large['bytes'])} x {large['in_flight']} in flight"

    def row(label: str, cells: Sequence[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def figure(phase: str, key: str, fmt: str, scale: float | None = None) -> list[str]:
        values = [v.get(phase, {}).get(key) for v in variants]
        return [_fmt(x if x is None or scale is None else x * scale, fmt) for x in values]

    limit = f"none in {report['replaced_limit_s']:.0f} s"
    lines = [
        "| | " + " | ".join(v["variant"] for v in variants) + " |",
        "|---" * (len(variants) + 1) + "|",
        row("NIXL agents (prefill and decode)", [v["nixl_agent"] for v in variants]),
        row("runs", [str(v["runs"]) for v in variants]),
        row(
            "first request after the engines serve",
            [_fmt(v["first_request_s"], "{:.3f} s", "failed") for v in variants],
        ),
        row(
            "prefill replaced -> a request succeeds",
            [
                _fmt(v["replaced_prefill_s"], "{:.2f} s", limit if v["replaced_measured"] else "-")
                for v in variants
            ],
        ),
    ]
    for phase, said in (("small", s_said), ("large", l_said)):
        lines += [
            row(f"{phase} ({said}): p50", figure(phase, "p50_ms", "{:.1f} ms")),
            row(f"{phase}: p99", figure(phase, "p99_ms", "{:.1f} ms")),
            row(f"{phase}: KV MB/s", figure(phase, "kv_bytes_per_s", "{:,.1f}", 1e-6)),
            row(
                f"{phase}: CPU s per GB (prefill + decode)",
                figure(phase, "cpu_s_per_gb", "{:.2f}"),
            ),
            row(
                f"{phase}: CPU s, prefill / decode",
                [
                    "-"
                    if phase not in v
                    else f"{_fmt(v[phase]['cpu_s']['prefill'], '{:.2f}')} / "
                    f"{_fmt(v[phase]['cpu_s']['decode'], '{:.2f}')}"
                    for v in variants
                ],
            ),
            row(f"{phase}: failed (all runs)", figure(phase, "failed", "{}")),
        ]
    lines.append("")
    lines.append(
        f"Medians over each variant's runs; the variants ran interleaved ({report['rounds']} "
        f"rounds, order {' '.join(report['order'])}), each run a fresh engine pair. Ratios are "
        f"a variant's median over nixl's: p50_ratio_small = request latency (the proxy's "
        f"round trip: prefill submission to the decode's verified outcome) at {s_said}, "
        f"below 1 faster; kv_bytes_per_s_ratio_large = verified KV bytes a second at "
        f"{l_said}, above 1 more; cpu_s_per_gb_ratio_large = CPU seconds of both engine "
        f"processes per GB moved at {l_said}, below 1 cheaper. NIXL agents: "
        + "; ".join(f"{v['variant']} {v['nixl_agent']}" for v in variants)
        + " (vLLM's connector has no progress-thread setting: NIXL's default, on; kvtopo's "
        f"default is off below 8 cores, and this host has {report.get('cpu_count', '?')})."
    )
    for name, ratios in report["ratios"].items():
        said = ", ".join(f"{k} {_fmt(x, '{:.2f}')}" for k, x in ratios.items())
        lines.append(f"\n{name} / nixl: {said}")
    lines += [
        "",
        "| run | variant | small p50 | small KV MB/s | large p50 | large KV MB/s "
        "| large CPU s/GB | other processes' CPU s (small, large) | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        s, g = r.get("small", {}), r.get("large", {})
        cells = [
            str(r["run"]),
            r["variant"],
            _fmt(s.get("p50_ms"), "{:.1f} ms"),
            _fmt(None if not s else s["kv_bytes_per_s"] / 1e6, "{:,.1f}"),
            _fmt(g.get("p50_ms"), "{:.1f} ms"),
            _fmt(None if not g else g["kv_bytes_per_s"] / 1e6, "{:,.1f}"),
            _fmt(g.get("cpu_s_per_gb"), "{:.2f}"),
            f"{_fmt(s.get('other_cpu_s'), '{:.1f}')}, {_fmt(g.get('other_cpu_s'), '{:.1f}')}",
            str(s.get("failed", 0) + g.get("failed", 0)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
