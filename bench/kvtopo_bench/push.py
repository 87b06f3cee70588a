"""`kvtopo bench push`: the push data path against raw NIXL and a torch copy, in one run.

Owns the two-process benchmark: a prefill process and a decode process (spawned), each with
a real NIXL agent (UCX) over a torch KV cache. For each case it measures, side by side:

- raw NIXL: WRITEs of the same blocks with the same prepped descriptor lists, each request
  waiting for its completion notification at the receiver, at every combination of
  {NIXL progress thread on, off} x {1, 8 requests in flight}; the best is the floor (the
  per-block anchor); also raw NIXL posting one merged descriptor per request, and raw NIXL
  with the emulated engine thread waking every step in the sending process (what sharing
  the process with an engine costs, apart from kvtopo);
- the kvtopo push path: decode registers (PUSH_REG), prefill matches and WRITEs, decode gets
  the completion and verifies every byte, through the real PushConnector, best of the same
  progress-thread settings x {1, 8, 16, 32} requests in flight x block merging off/on;
- a torch copy of the same bytes in one process (the machine's limit).

Throughput is bytes moved over wall time from the first submit to the last completion seen
by the receiver (CLOCK_MONOTONIC is shared by both processes).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

CASES = ((2 * 1024 * 1024, 16), (32 * 1024, 64))
WINDOWS = (1, 8)
PUSH_WINDOWS = (1, 8, 16, 32)
ENGINE_STEP_S = 0.0005  # the emulated engine's step
EPOCH_BYTES = 1 << 30  # per side: each request of an epoch has blocks of its own


@dataclass
class CaseResult:
    block_bytes: int
    blocks_per_request: int
    requests: int
    raw_nixl_gbps: float
    raw_config: str
    push_gbps: float
    push_config: str
    ratio_push_vs_raw: float  # against the per-block raw NIXL floor (the anchor)
    verified: bool
    raw_merged_gbps: float  # raw NIXL posting one descriptor per request
    raw_merged_config: str
    ratio_push_vs_raw_merged: float
    # raw NIXL with the emulated engine thread waking every step in the sending process (as
    # it does beside the push path): what sharing the process costs, apart from kvtopo
    raw_with_engine_gbps: float
    ratio_push_vs_raw_with_engine: float
    push_per_block_gbps: float  # the push path with block merging off
    ratio_push_per_block_vs_raw: float
    raw_all: dict[str, float]
    push_all: dict[str, float]
    tp: int = 1  # rank pairs moving at once (each request's bytes split over them)


def memcpy_gbps(request_bytes: int, slots: int, repeats: int, device: str = "cpu") -> float:
    """A torch copy of the bytes the transfers move, one request at a time between two
    buffers of `slots` requests (as large as an epoch's KV, so caches help it no more than
    they help NIXL), on `device`; best of `repeats` passes."""
    import torch

    src = torch.randint(0, 255, (slots, request_bytes), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    cuda = src.is_cuda
    best = 0.0
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(slots):
            dst[i].copy_(src[i])
        if cuda:
            torch.cuda.synchronize()
        best = max(best, slots * request_bytes / (time.perf_counter() - t0) / 1e9)
    return best


def cuda_device_name() -> str | None:
    """The name of CUDA device 0, or None when torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


# --- the peer processes ------------------------------------------------------------------
#
# A run is a sequence of epochs. In each epoch every request has blocks of its own on both
# sides (so a stale or misdirected byte cannot pass verification, and raw NIXL gets no
# cache advantage from a small ring); between epochs, with the clock stopped, the prefill
# side computes the next epoch's KV (fills it) and the decode side verifies every byte of
# the last epoch. The clock runs only while requests move: for raw NIXL from the first
# WRITE to the last completion notification, for push from the first submit to the last
# completion, both as seen across the two processes (CLOCK_MONOTONIC is system-wide).


def _peer_main(
    role: str, conn: Connection, block_len: int, num_blocks: int, progress: bool, device: str
) -> None:
    """One side of the benchmark; obeys commands from the parent over `conn`."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvtopo_worker.emulated import KVContent, rank_kv
    from kvtopo_worker.metrics import WorkerMetrics
    from kvtopo_worker.protocol import (
        CompatInfo,
        Role,
        compat_hash,
        decode_metadata,
        encode_metadata,
    )
    from kvtopo_worker.push import PushConfig, new_connector
    from kvtopo_worker.registry import EngineRegistry
    from kvtopo_worker.transport import NixlTransport

    engine_id = f"bench-{role}-{os.getpid()}"
    transport = NixlTransport(f"kvtopo-{engine_id}", progress_thread=progress)
    if device == "cuda":  # torch only on a GPU (the host-memory cache is numpy's)
        import torch

        torch.set_num_threads(1)
        torch.cuda.set_device(0)
    kv = rank_kv(num_blocks, block_len, device)
    transport.register_kv_cache(kv.registrable)
    # The peers meet as engines do: each decodes the other's versioned metadata.
    compat = CompatInfo(block_len=block_len)
    own_role: Role = "prefill" if role == "sender" else "decode"
    conn.send_bytes(
        encode_metadata(transport.describe(engine_id=engine_id, role=own_role, compat=compat))
    )
    peer = decode_metadata(conn.recv_bytes(), compat_hash(compat))
    peer_id = peer.engine_id
    peer_agent = transport.add_remote_peer(peer)
    content = KVContent(block_len)
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            mode, window, epoch_requests, epochs, per_req, merge = cmd
            transport.merge_blocks = merge
            connector = None
            if mode == "push":
                registry = EngineRegistry(remove_agent=lambda name: None)
                registry.add_engine(peer_id, {0: peer_agent})
                # Each side added the other before its connector existed: no greetings (the
                # notifications are sealed all the same).
                connector = new_connector(
                    engine_id=engine_id,
                    role="prefill" if role == "sender" else "decode",
                    transport=transport,
                    registry=registry,
                    metrics=WorkerMetrics(),
                    config=PushConfig(registration_timeout_s=60, kv_lease_s=60, greet_peers=False),
                    block_len=block_len,
                )
                connector.start()
            try:
                for epoch in range(epochs):
                    ids = [f"{mode}-{window}-{epoch}-{i}" for i in range(epoch_requests)]
                    slots = [list(range(i * per_req, (i + 1) * per_req)) for i in range(len(ids))]
                    if role == "sender" and mode == "push":
                        for rid, blocks in zip(ids, slots, strict=True):
                            content.fill(kv, blocks, rid)
                    conn.send("ready")
                    conn.recv()  # go
                    if connector is None and mode == "raw+engine" and role == "sender":
                        with _EngineThread():
                            times = _raw_epoch(role, transport, peer_agent, window, slots, merge)
                    elif connector is None:
                        times = _raw_epoch(role, transport, peer_agent, window, slots, merge)
                    else:
                        times = _push_epoch(role, connector, peer_id, window, ids, slots)
                    if role == "receiver" and mode == "push":
                        done_ids = times.pop("done_ids")
                        times["verified"] = sum(
                            1
                            for rid, blocks in zip(ids, slots, strict=True)
                            if rid in done_ids and not content.mismatched_blocks(kv, blocks, rid)
                        )
                    conn.send(times)
            finally:
                if connector is not None:
                    connector.stop()
    finally:
        transport.close()


class _EngineThread:
    """The emulated engine thread of the push runs, without the push path: it wakes every
    engine step and goes back to sleep. Raw NIXL with it running in the sending process
    measures what sharing the process with an engine thread costs the data path (each
    wake-up takes the GIL from the thread that drives the copies), apart from what kvtopo's
    push path adds."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-engine", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(ENGINE_STEP_S)

    def __enter__(self) -> _EngineThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _raw_epoch(
    role: str, transport: Any, peer_agent: str, window: int, slots: list[list[int]], merge: bool
) -> dict[str, Any]:
    """Raw NIXL: WRITE each request's blocks with a completion notification."""
    agent = transport.raw_agent
    local, remote = transport.prepped_dlists(peer_agent)
    if merge:  # one descriptor per request (its blocks are consecutive on both sides)
        local_base, remote_base, dev, far_dev, mem, far_mem = transport.raw_bases(peer_agent)
        block = transport.block_len
    if role == "receiver":
        seen = 0
        while seen < len(slots):
            for msgs in agent.get_new_notifs().values():
                seen += len(msgs)
        return {"t_end": time.monotonic()}
    t0 = time.monotonic()
    in_flight: list[Any] = []
    for i, blocks in enumerate(slots):
        if merge:
            size = len(blocks) * block
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(local_base + blocks[0] * block, size, dev)], mem),
                agent.get_xfer_descs([(remote_base + blocks[0] * block, size, far_dev)], far_mem),
                peer_agent,
                str(i).encode(),
            )
        else:
            handle = agent.make_prepped_xfer(
                "WRITE", local, blocks, remote, blocks, str(i).encode()
            )
        if agent.transfer(handle) == "ERR":
            raise RuntimeError("raw WRITE failed to post")
        in_flight.append(handle)
        while len(in_flight) >= window or (i == len(slots) - 1 and in_flight):
            still = []
            for h in in_flight:
                state = agent.check_xfer_state(h)
                if state == "PROC":
                    still.append(h)
                    continue
                agent.release_xfer_handle(h)
                if state != "DONE":
                    raise RuntimeError(f"raw WRITE ended {state}")
            in_flight = still
    return {"t_start": t0}


def _push_epoch(
    role: str, connector: Any, peer_id: str, window: int, ids: list[str], slots: list[list[int]]
) -> dict[str, Any]:
    """The push path from the engine thread's side, `window` requests in flight."""
    t0 = time.monotonic()
    submitted = ended = 0
    done: set[str] = set()
    failed = 0
    while ended < len(ids):
        while submitted < len(ids) and submitted - ended < window:
            if role == "sender":
                connector.request_send(ids[submitted], slots[submitted], peer_id)
            else:
                connector.request_receive(ids[submitted], peer_id, slots[submitted])
            submitted += 1
        fin = connector.get_finished()
        finished = fin.done_sending if role == "sender" else fin.done_receiving
        done.update(finished)
        failed += len(fin.failed)
        ended += len(finished) + len(fin.failed)
        # The engine collects finished transfers once per step, as vLLM's scheduler does,
        # not once per completion (waking per completion steals the GIL from the data path).
        time.sleep(ENGINE_STEP_S)
    if role == "sender":
        return {"t_start": t0, "failed": failed}
    return {"t_end": time.monotonic(), "failed": failed, "done_ids": done}


# --- the parent --------------------------------------------------------------------------


class _Pair:
    def __init__(self, block_len: int, num_blocks: int, progress: bool, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conns: dict[str, Connection] = {}
        self.procs = []
        for role in ("sender", "receiver"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_peer_main,
                args=(role, child, block_len, num_blocks, progress, device),
                daemon=True,
            )
            proc.start()
            self.conns[role] = parent
            self.procs.append(proc)
        s, r = self.conns["sender"], self.conns["receiver"]
        s_info, r_info = s.recv_bytes(), r.recv_bytes()
        s.send_bytes(r_info)
        r.send_bytes(s_info)

    def close(self) -> None:
        for c in self.conns.values():
            c.send(("stop",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class _Ranks:
    """`tp` rank pairs (a prefill rank and a decode rank each, in processes of their own, as
    vLLM's TP workers) moving their requests at the same time, in lockstep epochs."""

    def __init__(
        self, tp: int, block_len: int, num_blocks: int, progress: bool, device: str
    ) -> None:
        self.pairs: list[_Pair] = []
        try:
            for _ in range(tp):
                self.pairs.append(_Pair(block_len, num_blocks, progress, device))
        except BaseException:
            self.close()
            raise

    def run(
        self, mode: str, window: int, epoch_requests: int, epochs: int, per_req: int, merge: bool
    ) -> dict[str, Any]:
        """Runs all epochs on every rank pair at once; returns the summed clock time (first
        start of any rank to the last end of any), failures and verified count."""
        conns = [(p.conns["sender"], p.conns["receiver"]) for p in self.pairs]
        for s, r in conns:
            for c in (r, s):
                c.send((mode, window, epoch_requests, epochs, per_req, merge))
        seconds = 0.0
        failed = verified = 0
        for _ in range(epochs):
            for s, r in conns:
                for c in (r, s):
                    if c.recv() != "ready":
                        raise RuntimeError("benchmark peer out of step")
            for s, r in conns:
                for c in (r, s):
                    c.send("go")
            times = [(s.recv(), r.recv()) for s, r in conns]
            seconds += max(rt["t_end"] for _, rt in times) - min(st["t_start"] for st, _ in times)
            for st, rt in times:
                failed += st.get("failed", 0) + rt.get("failed", 0)
                verified += rt.get("verified", 0)
        return {"seconds": seconds, "failed": failed, "verified": verified}

    def close(self) -> None:
        for pair in self.pairs:
            pair.close()


def run_case(
    block_len: int,
    per_req: int,
    requests: int,
    repeats: int,
    log: Any,
    device: str = "cpu",
    tp: int = 1,
) -> CaseResult:
    request_bytes = block_len * per_req
    epoch_requests = max(2 * max(PUSH_WINDOWS), min(requests, EPOCH_BYTES // request_bytes))
    epochs = max(1, round(requests / epoch_requests))
    total = epoch_requests * epochs * tp  # every rank moves its own share of each request
    nbytes = request_bytes * total
    raw: dict[str, float] = {}
    raw_engine: dict[str, float] = {}
    push: dict[str, float] = {}
    verified = True
    for progress in (False, True):
        pair = _Ranks(tp, block_len, per_req * epoch_requests, progress, device)
        try:
            tag = f"progress_thread={'on' if progress else 'off'}"
            # Raw and push alternate, and each configuration runs `repeats` times (best kept),
            # so a burst of load from elsewhere on a shared machine hits both alike.
            for _ in range(repeats):
                for window in sorted({*WINDOWS, *PUSH_WINDOWS}):
                    for merge in (False, True):
                        key = f"{tag},in_flight={window},merge={'on' if merge else 'off'}"
                        if window in WINDOWS:
                            res = pair.run("raw", window, epoch_requests, epochs, per_req, merge)
                            raw[key] = max(raw.get(key, 0.0), nbytes / res["seconds"] / 1e9)
                            if not merge:  # and with an engine thread beside it
                                res = pair.run(
                                    "raw+engine", window, epoch_requests, epochs, per_req, False
                                )
                                gbps = nbytes / res["seconds"] / 1e9
                                raw_engine[key] = max(raw_engine.get(key, 0.0), gbps)
                        if window in PUSH_WINDOWS:
                            res = pair.run("push", window, epoch_requests, epochs, per_req, merge)
                            verified &= res["verified"] == total and res["failed"] == 0
                            push[key] = max(push.get(key, 0.0), nbytes / res["seconds"] / 1e9)
            for key in sorted(raw.keys() | push.keys()):
                if key.startswith(tag):
                    log(
                        f"  {device} TP {tp}: {block_len // 1024} KiB x {per_req}, {key}: "
                        f"raw {raw.get(key, float('nan')):.2f} GB/s, "
                        f"push {push.get(key, float('nan')):.2f} GB/s"
                    )
        finally:
            pair.close()

    return summarize(
        block_len, per_req, total, tp, verified, raw=raw, raw_engine=raw_engine, push=push
    )


def summarize(
    block_len: int,
    per_req: int,
    requests: int,
    tp: int,
    verified: bool,
    *,
    raw: dict[str, float],
    raw_engine: dict[str, float],
    push: dict[str, float],
) -> CaseResult:
    """A case's result from its throughputs (GB/s, by configuration): the best of each
    kind, and their ratios computed before anything is rounded for the report."""

    def best(results: dict[str, float], merge: str) -> tuple[str, float]:
        key = max((k for k in results if k.endswith(merge)), key=lambda k: results[k])
        return key, results[key]

    raw_key, raw_gbps = best(raw, "merge=off")  # the per-block anchor: the floor
    raw_merged_key, raw_merged_gbps = best(raw, "merge=on")
    push_key, push_gbps = max(
        (best(push, "merge=off"), best(push, "merge=on")), key=lambda kv: kv[1]
    )
    _, push_per_block = best(push, "merge=off")
    _, raw_engine_gbps = best(raw_engine, "merge=off")
    return CaseResult(
        block_bytes=block_len,
        blocks_per_request=per_req,
        requests=requests,
        raw_nixl_gbps=round(raw_gbps, 3),
        raw_config=raw_key,
        push_gbps=round(push_gbps, 3),
        push_config=push_key,
        ratio_push_vs_raw=round(push_gbps / raw_gbps, 3),
        verified=verified,
        raw_merged_gbps=round(raw_merged_gbps, 3),
        raw_merged_config=raw_merged_key,
        ratio_push_vs_raw_merged=round(push_gbps / raw_merged_gbps, 3),
        raw_with_engine_gbps=round(raw_engine_gbps, 3),
        ratio_push_vs_raw_with_engine=round(push_gbps / raw_engine_gbps, 3),
        push_per_block_gbps=round(push_per_block, 3),
        ratio_push_per_block_vs_raw=round(push_per_block / raw_gbps, 3),
        raw_all={k: round(v, 3) for k, v in raw.items()},
        push_all={k: round(v, 3) for k, v in push.items()},
        tp=tp,
    )


def run(
    json_path: Path | None, quick: bool, log: Any = print, device: str = "auto", tp: int = 1
) -> dict[str, Any]:
    """Runs every case on the CPU (unless `device` is "cuda") and, where torch sees a CUDA
    device (`device` "auto" or "cuda"), the GPU variant with the KV caches in GPU memory;
    writes the JSON report when `json_path` is given."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    gpu_name = cuda_device_name() if device in ("auto", "cuda") else None
    if device == "cuda" and gpu_name is None:
        raise RuntimeError(
            "--device cuda: torch sees no CUDA device here; run on a GPU host or use --device cpu"
        )
    repeats = 2 if quick else 3
    # Each configuration moves this much, so a timed window is long enough to be measured
    # on a noisy shared machine (a 2 MiB request takes ~0.3 ms here).
    bytes_per_config = (1 << 30) if quick else (3 << 30)
    log(
        f"kvtopo bench push: about {bytes_per_config / 2**30:.1f} GiB per configuration, "
        f"best of {repeats}, {2 * tp} processes (TP {tp}), NIXL UCX"
    )

    def variant(dev: str, per_config: int) -> tuple[float, list[CaseResult]]:
        memcpy = min(
            memcpy_gbps(bl * n, max(8, (512 << 20) // (bl * n)), 5, dev) for bl, n in CASES
        )
        log(f"  {dev}: torch copy (the machine's limit): {memcpy:.2f} GB/s")
        cases = [
            run_case(bl, n, max(32, per_config // (bl * n * tp)), repeats, log, dev, tp)
            for bl, n in CASES
        ]
        return memcpy, cases

    memcpy, cases = variant("cpu", bytes_per_config) if device != "cuda" else (0.0, [])
    report: dict[str, Any] = {
        "benchmark": "push",
        "quick": quick,
        "tp": tp,
        "cpu_count": os.cpu_count(),
        "memcpy_gbps": round(memcpy, 3),
        "cases": [asdict(c) for c in cases],
    }
    if gpu_name is None:
        report["gpu"] = {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
        log("  GPU variant skipped: torch sees no CUDA device")
    else:
        # GPU copies are far faster: move more per configuration so the windows stay long.
        gpu_memcpy, gpu_cases = variant("cuda", 4 * bytes_per_config)
        report["gpu"] = {
            "device": gpu_name,
            "memcpy_gbps": round(gpu_memcpy, 3),
            "cases": [asdict(c) for c in gpu_cases],
        }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _table(cases: list[dict[str, Any]], memcpy: float) -> list[str]:
    rows = [
        "| case | requests | raw NIXL GB/s (config) | push GB/s (config) | push/raw | push/memcpy "
        "| raw merged GB/s | raw + engine thread GB/s | push/(raw + engine) | push per-block/raw "
        "| verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        tp = f" (TP {c['tp']})" if c.get("tp", 1) > 1 else ""
        rows.append(
            f"| {c['block_bytes'] // 1024} KiB x {c['blocks_per_request']}{tp} | {c['requests']} "
            f"| {c['raw_nixl_gbps']:.2f} ({c['raw_config']}) "
            f"| {c['push_gbps']:.2f} ({c['push_config']}) | {c['ratio_push_vs_raw']:.2f} "
            f"| {c['push_gbps'] / memcpy:.2f} | {c['raw_merged_gbps']:.2f} "
            f"| {c['raw_with_engine_gbps']:.2f} | {c['ratio_push_vs_raw_with_engine']:.2f} "
            f"| {c['ratio_push_per_block_vs_raw']:.2f} | {c['verified']} |"
        )
    rows.append(f"\ntorch copy of the same bytes: {memcpy:.2f} GB/s")
    return rows


def format_table(report: dict[str, Any]) -> str:
    rows: list[str] = []
    if report["cases"]:
        rows += ["CPU (DRAM to DRAM):", "", *_table(report["cases"], report["memcpy_gbps"])]
    gpu = report.get("gpu") or {}
    if "cases" in gpu:
        rows += ["", f"GPU ({gpu['device']}, GPU memory to GPU memory):", ""]
        rows += _table(gpu["cases"], gpu["memcpy_gbps"])
    elif "skipped" in gpu:
        rows += ["", f"GPU variant skipped: {gpu['skipped']}"]
    return "\n".join(rows)


def all_verified(report: dict[str, Any]) -> bool:
    cases = [*report["cases"], *(report.get("gpu") or {}).get("cases", [])]
    return all(c["verified"] for c in cases)
