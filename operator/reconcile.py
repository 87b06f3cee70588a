"""Gather -> evaluate -> act, once per topology at a time.

Owns one asyncio task per KVTopology. Each task waits for a poke (a pod or spec change) or
its resync period, then reconciles: reads the topology fresh, takes its pods from the pod
index, reads every usable worker's `/v1/state` (bounded concurrency, timeouts), asks
`logic.evaluate` for a plan, makes the handshakes and evictions, writes the status once
(only when it changed) and records Events and metrics. A topology's reconciles never
overlap because only its own task runs them. Called by `handlers` (kopf).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvtopo_operator.api import KVTopologySpec, KVTopologyStatus, LastFailure, dump
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.logic import (
    Event,
    Observed,
    Plan,
    PodView,
    WorkerUnreachable,
    WorkerView,
    evaluate,
    pods_of,
    record_operator_failures,
    rfc3339,
)
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.workers import WorkerClient
from pydantic import ValidationError

log = logging.getLogger(__name__)

TopologyKey = tuple[str, str]  # (namespace, name)
PodSource = Callable[[str, int], Iterable[PodView]]  # (namespace, control port) -> pods


@dataclass
class Settings:
    resync_s: float = 2.0  # worker state is polled at least this often
    retry_s: float = 0.2  # re-reconcile this soon after acting
    max_backoff_s: float = 10.0


@dataclass
class _Loop:
    task: asyncio.Task[None]
    poke: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = -1
    failed_rounds: int = 0
    connected_at: dict[str, float] = field(default_factory=dict)


class Reconciler:
    """Runs and pokes the per-topology loops."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        workers: WorkerClient,
        pods: PodSource,
        metrics: OperatorMetrics,
        settings: Settings | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.workers = workers
        self.pods = pods
        self.metrics = metrics
        self.settings = settings or Settings()
        self.clock = clock
        self._loops: dict[TopologyKey, _Loop] = {}

    # --- loop management -----------------------------------------------------------------

    def ensure(self, key: TopologyKey, generation: int | None = None) -> None:
        """Starts the topology's loop if needed; pokes it when its spec changed."""
        loop = self._loops.get(key)
        if loop is None or loop.task.done():
            poke = asyncio.Event()
            task = asyncio.create_task(self._run(key, poke), name=f"kvtopo-{key[0]}/{key[1]}")
            self._loops[key] = _Loop(task=task, poke=poke)
            poke.set()
            return
        if generation is not None and generation != loop.generation:
            loop.poke.set()

    def poke_namespace(self, namespace: str) -> None:
        for (ns, _), loop in self._loops.items():
            if ns == namespace:
                loop.poke.set()

    def forget(self, key: TopologyKey) -> None:
        loop = self._loops.pop(key, None)
        if loop is not None:
            loop.task.cancel()

    async def stop(self) -> None:
        for key in list(self._loops):
            self.forget(key)
        await self.workers.close()

    # --- the loop ------------------------------------------------------------------------

    async def _run(self, key: TopologyKey, poke: asyncio.Event) -> None:
        delay = self.settings.resync_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(poke.wait(), timeout=delay)
            poke.clear()
            loop = self._loops.get(key)
            if loop is None:
                return
            try:
                acted, wake_in = await self.reconcile(key, loop)
                loop.failed_rounds = 0
                delay = self.settings.retry_s if acted else self.settings.resync_s
                if wake_in is not None:  # an eviction falls due before the next resync
                    delay = min(delay, max(0.05, wake_in))
            except asyncio.CancelledError:
                raise
            except Exception:
                loop.failed_rounds += 1
                delay = min(self.settings.max_backoff_s, 0.5 * 2**loop.failed_rounds)
                log.exception("reconcile of %s/%s failed; retrying in %.1fs", *key, delay)

    async def reconcile(self, key: TopologyKey, loop: _Loop) -> tuple[bool, float | None]:
        """One round; returns whether it changed something (so it runs again soon) and when
        the next eviction falls due."""
        started = time.monotonic()
        namespace, name = key
        body = await self.kube.get_topology(namespace, name)
        if body is None:
            self.forget(key)
            return False, None
        generation = int(body["metadata"].get("generation", 0))
        loop.generation = generation
        try:
            spec = KVTopologySpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            log.error("%s/%s has a spec the CRD should have refused: %s", namespace, name, exc)
            return False, None
        try:
            previous = KVTopologyStatus.model_validate(body.get("status") or {})
        except ValidationError:
            previous = KVTopologyStatus()

        pods = pods_of(spec, self.pods(namespace, spec.control_port))
        sem = asyncio.Semaphore(spec.handshake.max_concurrent)
        timeout = float(spec.handshake.timeout_seconds)

        async def read(pod: PodView) -> tuple[str, WorkerView | WorkerUnreachable]:
            async with sem:
                return pod.name, await self.workers.state(pod.endpoint, timeout)

        usable = [p for p in pods if p.ready and not p.deleting and p.endpoint]
        workers = dict(await asyncio.gather(*(read(p) for p in usable)))
        now = self.clock()
        plan = evaluate(
            Observed(
                generation=generation, spec=spec, pods=pods, workers=workers, previous=previous
            ),
            now,
        )
        acted, act_events, operator_failures = await self._act(plan, sem, timeout, now)
        status = record_operator_failures(plan.status, operator_failures)
        new, old = dump(status), dump(previous)
        if new != old:
            written = await self.kube.patch_status(
                namespace, name, new, body["metadata"]["resourceVersion"]
            )
            if not written:
                loop.poke.set()  # the object moved under us: read it again at once
        for event in (*plan.events, *act_events):
            await self.kube.record_event(body, event.type, event.reason, event.message)
        self._observe(key, loop, plan, pods, time.monotonic() - started)
        return acted, plan.wake_in_s

    async def _act(
        self, plan: Plan, sem: asyncio.Semaphore, call_timeout: float, now: datetime
    ) -> tuple[bool, list[Event], list[tuple[str, LastFailure]]]:
        events: list[Event] = []
        failures: list[tuple[str, LastFailure]] = []

        async def handshake(h: Any) -> bool:
            async with sem:
                res = await self.workers.add_peer(
                    h.endpoint, h.peer_engine_id, h.peer_endpoint, h.peer_role, call_timeout
                )
            outcome = "ok" if res.ok else ("unreachable" if res.status == 0 else "failed")
            self.metrics.handshakes.labels(outcome).inc()
            if not res.ok:
                msg = f"{h.pod}: adding {h.peer_role} engine {h.peer_engine_id}: {res.message}"
                events.append(Event("Warning", "HandshakeFailed", msg))
                if res.status == 0:  # the worker never saw it, so it could not count it
                    failures.append(
                        (
                            "handshake_failed",
                            LastFailure(
                                time=rfc3339(now),
                                type="handshake_failed",
                                engine_id=h.peer_engine_id,
                                pod=h.pod,
                                message=res.message[:512],
                            ),
                        )
                    )
            return res.ok

        async def evict(e: Any) -> bool:
            async with sem:
                res = await self.workers.evict_peer(e.endpoint, e.engine_id, call_timeout)
            self.metrics.evictions.labels(
                res.result or ("unreachable" if res.status == 0 else "failed")
            ).inc()
            if not res.ok:
                log.warning("evicting %s from %s: %s", e.engine_id, e.pod, res.message)
            return res.ok

        results = await asyncio.gather(
            *(handshake(h) for h in plan.handshakes), *(evict(e) for e in plan.evictions)
        )
        return any(results), events, failures

    def _observe(
        self, key: TopologyKey, loop: _Loop, plan: Plan, pods: tuple[PodView, ...], seconds: float
    ) -> None:
        self.metrics.reconcile_seconds.observe(seconds)
        ready_since = {p.name: p.ready_since for p in pods if p.ready_since is not None}
        for engine in plan.status.engines:
            first = engine.state == "Connected" and engine.engine_id not in loop.connected_at
            if first and engine.pod in ready_since:
                loop.connected_at[engine.engine_id] = time.time()
                self.metrics.ready_to_connected.observe(
                    max(0.0, time.time() - ready_since[engine.pod])
                )
        self.metrics.pairs_expected.labels(*key).set(len(plan.expected_pairs))
        self.metrics.pairs_connected.labels(*key).set(len(plan.connected_pairs))
