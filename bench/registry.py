"""`kvtopo bench registry`: what the registry lock costs the data path.

Owns three measurements on a registry of 1,000 engines:
- the critical section of `snapshot` and of `evict` (p50/p99 in microseconds) with 1, 8 and
  64 ranks per engine: each call timed alone, so the figure is the time the lock is held
  plus the call overhead (teardown is a no-op here, as it runs outside the lock anyway);
- registration-writer throughput through the real `PushConnector.send_registration`, alone
  and while a churn thread evicts and re-adds other engines at a fixed rate (the churn a
  rollout of a large fleet causes, far above what Kubernetes produces), and their ratio.
The transport is a null one: the benchmark isolates the registry and the writer's path.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENGINES = 1000
RANKS = (1, 8, 64)


class NullTransport:
    """Accepts every notification and does nothing (benchmark only)."""

    agent_name = "bench"

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        return None

    def get_notifs(self) -> list[tuple[str, bytes]]:
        return []

    def write_blocks(
        self, agent_name: str, local: Sequence[int], remote: Sequence[int], notif: bytes
    ) -> object:
        return None

    def poll(self, handle: object) -> str:
        return "DONE"

    def release(self, handle: object) -> None:
        return None

    def remove_remote(self, agent_name: str) -> None:
        return None


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    s = sorted(samples_ns)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


def critical_sections(ranks: int, calls: int) -> dict[str, float]:
    from kvtopo_worker.registry import EngineRegistry

    reg = EngineRegistry(remove_agent=lambda name: None)
    agents = {r: f"agent-{r}" for r in range(ranks)}
    for e in range(ENGINES):
        reg.add_engine(f"e{e}", agents)
    clock = time.perf_counter_ns
    snaps: list[int] = []
    for i in range(calls):
        eid = f"e{i % ENGINES}"
        t = clock()
        reg.snapshot(eid)
        snaps.append(clock() - t)
    evicts: list[int] = []
    for i in range(calls):
        eid = f"e{i % ENGINES}"
        t = clock()
        reg.evict(eid)
        evicts.append(clock() - t)
        reg.add_engine(eid, agents)
    s50, s99 = _percentiles(snaps)
    e50, e99 = _percentiles(evicts)
    return {
        "ranks": ranks,
        "snapshot_p50_us": round(s50, 3),
        "snapshot_p99_us": round(s99, 3),
        "evict_p50_us": round(e50, 3),
        "evict_p99_us": round(e99, 3),
    }


def writer_rps(seconds: float, churn_per_s: float) -> tuple[float, int]:
    """Registrations per second through send_registration, with optional churn."""
    from kvtopo_worker.metrics import WorkerMetrics
    from kvtopo_worker.protocol import PushRegistration
    from kvtopo_worker.push import PushConnector
    from kvtopo_worker.registry import EngineRegistry

    reg = EngineRegistry(remove_agent=lambda name: None)
    agents = {r: f"agent-{r}" for r in range(8)}
    for e in range(ENGINES):
        reg.add_engine(f"e{e}", agents)
    conn = PushConnector(
        engine_id="bench-decode",
        role="decode",
        transport=NullTransport(),  # type: ignore[arg-type]
        registry=reg,
        metrics=WorkerMetrics(),
    )
    regs = [
        PushRegistration(
            request_id=f"r{i}",
            decode_engine_id="bench-decode",
            prefill_engine_id=f"e{i % 100}",
            block_ids=[1, 2, 3, 4],
        )
        for i in range(1000)
    ]
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        # Evict and re-add engines the writer does not target, at a fixed rate.
        period = 1.0 / churn_per_s
        next_t = time.perf_counter()
        i = 0
        while not stop.is_set():
            eid = f"e{100 + i % (ENGINES - 100)}"
            reg.evict(eid)
            reg.add_engine(eid, agents)
            churned[0] += 1
            i += 1
            next_t += period
            delay = next_t - time.perf_counter()
            if delay > 0:
                stop.wait(delay)

    churner = threading.Thread(target=churn) if churn_per_s > 0 else None
    if churner is not None:
        churner.start()
    sent = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    try:
        while time.perf_counter() < end:
            for r in regs[:100]:
                conn.send_registration(r)
            sent += 100
    finally:
        elapsed = time.perf_counter() - t0
        stop.set()
        if churner is not None:
            churner.join()
    return sent / elapsed, churned[0]


def run(json_path: Path | None, quick: bool, log: Callable[[str], None] = print) -> dict[str, Any]:
    calls = 20_000 if quick else 100_000
    seconds = 2.0 if quick else 5.0
    churn_rate = 1000.0
    log(f"kvtopo bench registry: {ENGINES} engines, {calls} calls per measurement")
    sections = [critical_sections(r, calls) for r in RANKS]
    for s in sections:
        log(
            f"  {s['ranks']:>2} ranks: snapshot p50/p99 {s['snapshot_p50_us']:.2f}/"
            f"{s['snapshot_p99_us']:.2f} us, evict p50/p99 {s['evict_p50_us']:.2f}/"
            f"{s['evict_p99_us']:.2f} us"
        )
    # Alone and under churn, alternated and best-of, so machine noise hits both alike.
    alone, churned_rps, churned = 0.0, 0.0, 0
    for _ in range(3):
        alone = max(alone, writer_rps(seconds, 0)[0])
        rps, n = writer_rps(seconds, churn_rate)
        if rps > churned_rps:
            churned_rps, churned = rps, n
    report = {
        "benchmark": "registry",
        "engines": ENGINES,
        "critical_sections": sections,
        "snapshot_p99_us": sections[-1]["snapshot_p99_us"],
        "evict_p99_us": sections[-1]["evict_p99_us"],
        "writer_rps": round(alone),
        "writer_rps_under_churn": round(churned_rps),
        "churn_evictions_per_s": round(churned / seconds),
        "churn_ratio": round(churned_rps / alone, 3),
    }
    log(
        f"  writer: {report['writer_rps']} registrations/s alone, "
        f"{report['writer_rps_under_churn']} under {report['churn_evictions_per_s']} "
        f"evictions/s (ratio {report['churn_ratio']})"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
