"""Events posted off the reconcile path, without repeats, at a bounded rate per object.

Owns `EventRecorder`: a reconcile hands it an Event and goes on; one background task posts
them through the injected `post` (the API call, `kube.KubeClient.record_event`). Like
client-go's event correlator it drops what would only be noise:

- an Event equal to one already posted for the same object (reason and message) within
  `repeat_window_s` (a failure that persists is said once, and again after the window);
- beyond a token bucket per object (`burst` at once, then one per `refill_s`), so a fault
  touching a thousand engines cannot post a thousand Events a round;
- beyond `queue_limit` waiting Events (the API server slower than the faults).

What is dropped is counted (`kvtopo_operator_events_dropped_total{why}`), never an error.
Called by `reconcile`; the clock is injected for the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import Event

log = logging.getLogger(__name__)

Post = Callable[[Mapping[str, Any], str, str, str], Awaitable[None]]

KEYS_KEPT = 4096  # (object, reason, message) remembered for the repeat window
# An Event's reason and message are cut to these before anything is kept or posted, so what
# the recorder holds is bounded in bytes (KEYS_KEPT x about 1.2 KB), whatever a worker said.
MAX_REASON = 128
MAX_MESSAGE = 1024


@dataclass
class _Bucket:
    tokens: float
    at: float


class EventRecorder:
    """Queues Events and posts them from one task, dropping repeats and floods."""

    def __init__(
        self,
        post: Post,
        metrics: OperatorMetrics,
        *,
        repeat_window_s: float = 600.0,
        burst: int = 25,
        refill_s: float = 5.0,
        queue_limit: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._post = post
        self._metrics = metrics
        self._repeat_window_s = repeat_window_s
        self._burst = burst
        self._refill_s = refill_s
        self._clock = clock
        self._recent: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._buckets: dict[str, _Bucket] = {}
        self._queue: asyncio.Queue[tuple[Mapping[str, Any], Event]] = asyncio.Queue(queue_limit)
        self._task: asyncio.Task[None] | None = None

    def _object(self, body: Mapping[str, Any]) -> str:
        meta = body.get("metadata") or {}
        return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")

    def _admit(self, obj: str, event: Event) -> str | None:
        """None when the Event may go; else why it is dropped."""
        now = self._clock()
        key = (obj, event.reason, event.message)
        seen = self._recent.get(key)
        if seen is not None and now - seen < self._repeat_window_s:
            return "repeat"
        bucket = self._buckets.get(obj) or _Bucket(float(self._burst), now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) / self._refill_s)
        bucket.at = now
        self._buckets[obj] = bucket
        if bucket.tokens < 1:
            return "rate"
        bucket.tokens -= 1
        self._recent[key] = now
        self._recent.move_to_end(key)
        while len(self._recent) > KEYS_KEPT:
            self._recent.popitem(last=False)
        return None

    def record(self, body: Mapping[str, Any], event: Event) -> bool:
        """Queues `event` on the object `body` unless it is noise; never waits. True when
        it was queued. Its reason and message are cut to their bounds first."""
        if len(event.message) > MAX_MESSAGE or len(event.reason) > MAX_REASON:
            event = Event(event.type, event.reason[:MAX_REASON], event.message[:MAX_MESSAGE])
        why = self._admit(self._object(body), event)
        if why is None:
            try:
                self._queue.put_nowait((body, event))
            except asyncio.QueueFull:
                why = "queue_full"
        if why is not None:
            self._metrics.events_dropped.labels(why).inc()
            return False
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="kvtopo-events")
        return True

    async def _drain(self) -> None:
        while True:
            body, event = await self._queue.get()
            try:
                await self._post(body, event.type, event.reason, event.message)
            except Exception as exc:  # the Event is lost; the status still says it
                self._metrics.events_dropped.labels("post_failed").inc()
                log.warning("could not post Event %s: %s", event.reason, exc)
            finally:
                self._queue.task_done()

    async def flush(self) -> None:
        """Waits until every queued Event has been posted (for tests and shutdown)."""
        await self._queue.join()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
