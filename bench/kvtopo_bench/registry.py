"""`kvtopo bench registry`: what the registry lock costs the data path.

Owns three measurements on a registry of 1,000 engines:
- the critical section of `snapshot` and of `evict` (p50/p99 in microseconds) with 1, 8 and
  64 ranks per engine: each call timed alone, so the figure is the time the lock is held
  plus the call overhead (teardown is a no-op here, as it runs outside the lock anyway);
- registration-writer throughput through the real `DecodePush.deliver_registration` (the
  writer's registry snapshot and send), alone
  and while a churn thread evicts and re-adds other engines at a fixed rate (the churn a
  rollout of a large fleet causes, far above what Kubernetes produces), in alternating
  100 ms segments of one run, and their ratio (the median over adjacent pairs). The churn
  arrives as the worker gets it, `CHURN_BATCH` evictions back to back per wake-up (a
  `PATCH /v1/peers` on the worker's one NIXL thread); also reported: the same churn with a
  wake-up per eviction, and those wake-ups doing no registry work at all (their thread
  switches alone: the floor no registry can go under).
The transport is a null one: the benchmark isolates the registry and the writer's path.

With `--baseline-tree DIR` (a checkout of another commit), the 64-rank critical sections and
the writer under churn are also measured with that tree's registry (its worker package) and
this tree's benchmark code, each in a process of its own, the two trees alternating A B B A,
and reported side by side.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINES = 1000
RANKS = (1, 8, 64)


class NullTransport:
    """Accepts every notification and does nothing (benchmark only)."""

    agent_name = "bench"

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        return None

    def get_notifs(self, room: object = None) -> list[tuple[str, bytes]]:
        return []

    def write_blocks(
        self, agent_name: str, local: Sequence[int], remote: Sequence[int], notif: bytes
    ) -> tuple[object, str]:
        return None, "DONE"

    def poll(self, handle: object) -> str:
        return "DONE"

    def release(self, handle: object) -> bool:
        return True

    def remove_remote(self, agent_name: str) -> None:
        return None


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    s = sorted(samples_ns)
    return s[len(s) // 2] / 1000, s[min(len(s) - 1, int(len(s) * 0.99))] / 1000


def _agents(engine_id: str, ranks: int) -> dict[int, str]:
    """Agent names of an engine's ranks (an agent belongs to one engine)."""
    return {r: f"agent-{engine_id}-{r}" for r in range(ranks)}


def critical_sections(ranks: int, calls: int) -> dict[str, float]:
    from kvtopo_worker.registry import EngineRegistry

    reg = EngineRegistry(remove_agent=lambda name: None)
    for e in range(ENGINES):
        reg.add_engine(f"e{e}", _agents(f"e{e}", ranks))
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
        reg.add_engine(eid, _agents(eid, ranks))
    s50, s99 = _percentiles(snaps)
    e50, e99 = _percentiles(evicts)
    return {
        "ranks": ranks,
        "snapshot_p50_us": round(s50, 3),
        "snapshot_p99_us": round(s99, 3),
        "evict_p50_us": round(e50, 3),
        "evict_p99_us": round(e99, 3),
    }


@dataclass
class WriterResult:
    rps_alone: float  # registrations/s in the segments without churn
    rps_under_churn: float  # ... and in the segments with it
    churn_ratio: float  # median over adjacent pairs of segments (with / without)
    evictions_per_s: float  # churn achieved while it was on
    segments: int


def _registration_writer(registry: Any) -> Callable[[Any], object]:
    """The registration writer's data path of the worker package on the path, with a null
    transport: `DecodePush.deliver_registration` (this tree), or in a tree from before the
    push connector was split by role (9cfedae) `PushConnector.send_registration`, as that
    tree's own benchmark drove it (so `--baseline-tree` runs both under one churn)."""
    from kvtopo_worker.metrics import WorkerMetrics

    try:
        from kvtopo_worker.push import PushConfig
        from kvtopo_worker.push.decode import DecodePush
    except ImportError:  # an older tree: one PushConnector for both roles
        older: Any = importlib.import_module("kvtopo_worker.push")
        connector = older.PushConnector(
            engine_id="bench-decode",
            role="decode",
            transport=NullTransport(),
            registry=registry,
            metrics=WorkerMetrics(),
        )
        return connector.send_registration  # type: ignore[no-any-return]
    conn = DecodePush(
        engine_id="bench-decode",
        transport=NullTransport(),  # type: ignore[arg-type]
        registry=registry,
        metrics=WorkerMetrics(),
        config=PushConfig(greet_peers=False),  # the writer alone: no greetings
    )
    return conn.deliver_registration


def writer_under_churn(
    seconds: float, churn_per_s: float, segment_s: float, batch: int = 1, work: bool = True
) -> WriterResult:
    """Registration throughput through the real writer (`_registration_writer`), in
    alternating segments of `segment_s` with the churn thread off and on, in one run on one
    registry: a burst
    of load from elsewhere on a shared machine lasts longer than a segment, so it hits both
    alike (separate runs a few seconds apart differed by up to 15% on the same code).

    The churn thread wakes `churn_per_s / batch` times a second and evicts and re-adds
    `batch` engines back to back each time, as the worker's one NIXL thread runs the
    evictions of one `PATCH /v1/peers`; `batch=1` wakes it for every eviction. `work=False`
    keeps its wake-ups and does no registry work: what the wake-ups alone cost the writer
    (the thread switches of the GIL), the floor under any registry."""
    from kvtopo_worker.protocol import PushRegistration
    from kvtopo_worker.registry import EngineRegistry

    reg = EngineRegistry(remove_agent=lambda name: None)
    for e in range(ENGINES):
        reg.add_engine(f"e{e}", _agents(f"e{e}", 8))
    write = _registration_writer(reg)
    regs = [
        PushRegistration(
            request_id=f"r{i}",
            decode_engine_id="bench-decode",
            prefill_engine_id=f"e{i % 100}",
            block_ids=[1, 2, 3, 4],
            expires_at=time.time() + 3600,
            write_timeout_s=30.0,
        )
        for i in range(100)
    ]
    stop = threading.Event()
    churning = threading.Event()
    churned = [0]

    def churn() -> None:
        # While on: evict and re-add engines the writer does not target, at a fixed rate.
        period = batch / churn_per_s
        i = 0
        while not stop.is_set():
            if not churning.wait(0.05):
                continue
            next_t = time.perf_counter()
            while churning.is_set() and not stop.is_set():
                for _ in range(batch):
                    eid = f"e{100 + i % (ENGINES - 100)}"
                    if work:
                        reg.evict(eid)
                        reg.add_engine(eid, _agents(eid, 8))
                    churned[0] += 1
                    i += 1
                next_t += period
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)

    churner = threading.Thread(target=churn, name="bench-churn")
    churner.start()
    pairs = max(1, round(seconds / (2 * segment_s)))
    sent = {False: 0, True: 0}
    spent = {False: 0.0, True: 0.0}
    ratios: list[float] = []
    try:
        for p in range(pairs):
            rates = {}
            for on in (False, True) if p % 2 == 0 else (True, False):
                if on:
                    churning.set()
                else:
                    churning.clear()
                n = 0
                t0 = time.perf_counter()
                end = t0 + segment_s
                while time.perf_counter() < end:
                    for r in regs:
                        write(r)
                    n += len(regs)
                elapsed = time.perf_counter() - t0
                sent[on] += n
                spent[on] += elapsed
                rates[on] = n / elapsed
            ratios.append(rates[True] / rates[False])
    finally:
        stop.set()
        churning.set()
        churner.join()
    ratios.sort()
    return WriterResult(
        rps_alone=sent[False] / spent[False],
        rps_under_churn=sent[True] / spent[True],
        churn_ratio=ratios[len(ratios) // 2],
        evictions_per_s=churned[0] / spent[True],
        segments=2 * pairs,
    )


CHURN_PER_S = 1000.0
# Evictions per wake-up of the churn thread: the worker's one NIXL thread runs the evictions
# of one `PATCH /v1/peers` back to back, and the operator sends one per worker per round
# (rounds at least `retry_s` = 0.2 s apart while acting: 200 evictions at this rate). 20
# wakes the thread ten times as often as that.
CHURN_BATCH = 20

_ONE_RUN = """
import dataclasses, json, sys
from kvtopo_bench.registry import CHURN_BATCH, CHURN_PER_S, critical_sections, writer_under_churn
calls, seconds = int(sys.argv[1]), float(sys.argv[2])
section = critical_sections(64, calls)
writer = writer_under_churn(seconds, CHURN_PER_S, 0.1, batch=CHURN_BATCH)
each = writer_under_churn(seconds, CHURN_PER_S, 0.1)
print(json.dumps({"section": section, "writer": dataclasses.asdict(writer),
                  "writer_each": dataclasses.asdict(each)}))
"""


def _tree_run(tree: Path, calls: int, seconds: float) -> dict[str, Any]:
    """One measurement with `tree`'s registry (its worker package) and this tree's benchmark
    code, in a process of its own: both trees get the same churn and the same writer loop."""
    env = dict(os.environ)
    this = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "worker"), str(this / "bench"), str(tree)])
    out = subprocess.run(
        [sys.executable, "-c", _ONE_RUN, str(calls), str(seconds)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"registry run in {tree} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def side_by_side(
    baseline: Path, calls: int, seconds: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """This tree and `baseline`, A B B A, each run in a process of its own: the medians of
    the 64-rank snapshot p99, the writer alone, under churn, and the churn ratio."""
    this = Path(__file__).resolve().parents[2]
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    for which in ("this", "baseline", "baseline", "this"):
        tree = this if which == "this" else baseline
        res = _tree_run(tree, calls, seconds)
        runs[which].append(res)
        log(
            f"  {which:>8}: snapshot p99 {res['section']['snapshot_p99_us']:.2f} us, writer "
            f"{res['writer']['rps_alone']:.0f}/s alone, {res['writer']['rps_under_churn']:.0f}/s "
            f"under churn (ratio {res['writer']['churn_ratio']:.3f}; a wake-up per eviction "
            f"{res['writer_each']['churn_ratio']:.3f})"
        )

    def medians(rs: list[dict[str, Any]]) -> dict[str, float]:
        return {
            "snapshot_p99_us": round(
                statistics.median(r["section"]["snapshot_p99_us"] for r in rs), 3
            ),
            "writer_rps": round(statistics.median(r["writer"]["rps_alone"] for r in rs)),
            "writer_rps_under_churn": round(
                statistics.median(r["writer"]["rps_under_churn"] for r in rs)
            ),
            "churn_ratio": round(statistics.median(r["writer"]["churn_ratio"] for r in rs), 3),
            "churn_ratio_each_eviction": round(
                statistics.median(r["writer_each"]["churn_ratio"] for r in rs), 3
            ),
        }

    return {
        "baseline_tree": str(baseline),
        "order": "A B B A (this, baseline, baseline, this)",
        "this": medians(runs["this"]),
        "baseline": medians(runs["baseline"]),
        "runs": runs,
    }


def run(
    json_path: Path | None,
    quick: bool,
    log: Callable[[str], None] = print,
    baseline_tree: Path | None = None,
) -> dict[str, Any]:
    calls = 20_000 if quick else 100_000
    seconds = 6.0 if quick else 30.0
    log(f"kvtopo bench registry: {ENGINES} engines, {calls} calls per measurement")
    sections = [critical_sections(r, calls) for r in RANKS]
    for s in sections:
        log(
            f"  {s['ranks']:>2} ranks: snapshot p50/p99 {s['snapshot_p50_us']:.2f}/"
            f"{s['snapshot_p99_us']:.2f} us, evict p50/p99 {s['evict_p50_us']:.2f}/"
            f"{s['evict_p99_us']:.2f} us"
        )
    writer = writer_under_churn(seconds, CHURN_PER_S, segment_s=0.1, batch=CHURN_BATCH)
    each = writer_under_churn(seconds, CHURN_PER_S, segment_s=0.1)
    floor = writer_under_churn(seconds, CHURN_PER_S, segment_s=0.1, work=False)
    report = {
        "benchmark": "registry",
        "engines": ENGINES,
        "critical_sections": sections,
        "snapshot_p99_us": sections[-1]["snapshot_p99_us"],
        "evict_p99_us": sections[-1]["evict_p99_us"],
        "writer_rps": round(writer.rps_alone),
        "writer_rps_under_churn": round(writer.rps_under_churn),
        "churn_evictions_per_s": round(writer.evictions_per_s),
        "churn_ratio": round(writer.churn_ratio, 3),
        "churn_segments": writer.segments,
        "churn_evictions_per_wakeup": CHURN_BATCH,
        # The same churn with a wake-up per eviction, and those wake-ups with no registry
        # work (the floor the thread switches set, whatever the registry costs).
        "churn_ratio_each_eviction": round(each.churn_ratio, 3),
        "churn_floor_ratio_each_eviction": round(floor.churn_ratio, 3),
    }
    log(
        f"  writer: {report['writer_rps']} registrations/s alone, "
        f"{report['writer_rps_under_churn']} under {report['churn_evictions_per_s']} "
        f"evictions/s, {CHURN_BATCH} a wake-up (ratio {report['churn_ratio']}); a wake-up per "
        f"eviction {report['churn_ratio_each_eviction']}, the same wake-ups doing nothing "
        f"{report['churn_floor_ratio_each_eviction']}"
    )
    if baseline_tree is not None:
        log(f"  side by side with {baseline_tree} (A B B A, a process each)")
        report["side_by_side"] = side_by_side(baseline_tree, calls, seconds, log)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
