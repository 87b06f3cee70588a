"""One topology's status writer: the newest decided status, written off the rounds' path.

Owns `StatusWriter`, a loop's single writer of its topology's `/status` (the subresource has
one writer, the leading replica's loop). A round hands it the status it decided (`write`)
and goes on: one write is in flight at a time, at most one per `status_interval_s`, and a
status decided meanwhile replaces any still waiting (only the newest is written); the
interval grows with the number of engine lines (`status_pause`). The writer puts a status in
its wire form when it is about to write it, and writes nothing when that is what the server
was last known to hold: a round that finds the writer pacing costs nothing (a rollout's
rounds decide a status each, a 2,000-engine topology's is written once per 4 s).

Each write (a merge patch of the whole status, through the fence: `fence.FencedWrites`) is
conditional on the resourceVersion of the writer's own last write (at first, of the body
its loop's first round read) and on the object's uid, so a write a replaced leader still
had in flight is refused once the new one wrote, and one that landed first is overwritten.
A refused write is tried again on the version the API server holds. A loop's first status is
always written. A write that fails (403, 429, an admission webhook, a timeout) is retried,
newest first, with a backoff that doubles up to `max_write_backoff_s`, logged once per kind
of failure; one the API server refuses for what it says (400, 413, 422, or 404 on an object
that exists: a CRD without the status subresource) is also a `StatusWriteRefused` Event. A
write the fence refuses (this replica does not lead now) ends the writer: nothing is
written. The rounds' decisions and timers never wait for it. Used by `reconcile`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtopo_operator.api import KVTopologyStatus, dump
from kvtopo_operator.events import EventRecorder
from kvtopo_operator.fence import Fenced, FencedWrites
from kvtopo_operator.kube import MISSING_STATUS_SUBRESOURCE, KubeClient, StatusNotFound
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.model import Event

log = logging.getLogger(__name__)

# The topology's latest body as a watch delivered it (None: not known).
Body = Callable[[], Mapping[str, Any] | None]


class StatusWriteRefused(Exception):
    """A status write refused for a reason that lasts (`status`: the HTTP code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Pacing:
    """How often a status is written, and how a failing write backs off."""

    interval_s: float = 1.0  # at most one write per this, per 500 engine lines
    engines_per_interval: int = 500
    retry_s: float = 0.2  # a failed write is tried again this soon, doubling
    max_backoff_s: float = 30.0


def status_pause(status: Mapping[str, Any], pacing: Pacing) -> float:
    """How long the writer waits after writing `status` (in its wire form)."""
    lines = len(status.get("engines") or ())
    per = max(1, pacing.engines_per_interval)
    return pacing.interval_s * max(1.0, lines / per)


class StatusWriter:
    """The status writer of topology `key` (see the module)."""

    def __init__(
        self,
        key: tuple[str, str],
        *,
        writes: FencedWrites,
        kube: KubeClient,
        events: EventRecorder,
        metrics: OperatorMetrics,
        pacing: Callable[[], Pacing],
        body: Body,
        gone: Callable[[], None],
    ) -> None:
        self.key = key
        self.writes = writes
        self.kube = kube
        self.events = events
        self.metrics = metrics
        self.pacing = pacing
        self.body = body
        self.gone = gone  # the object is gone from the API server: the loop forgets it
        self.uid = ""  # the object's uid, a precondition of every write
        self.written: dict[str, Any] | None = None  # what the server was last known to hold
        self.version = ""  # the resourceVersion the next write is conditional on
        self.unwritten: KVTopologyStatus | None = None  # the newest still to write
        self.task: asyncio.Task[None] | None = None
        self.failures = 0  # writes failed in a row
        self.failure_logged = ""  # the last failure logged (a repeat is not logged again)
        self.refusal_told = ""  # the last lasting refusal an Event said

    def start_from(self, version: str, uid: str) -> None:
        """A loop's first round read the object at `version`: nothing counts as written."""
        self.written, self.version, self.uid = None, version, uid

    def write(self, status: KVTopologyStatus) -> None:
        """Hands over the newest decided status; never waits."""
        self.unwritten = status
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(
                self._run(), name=f"kvtopo-status-{self.key[0]}/{self.key[1]}"
            )

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        namespace, name = self.key
        while self.unwritten is not None:
            decided, self.unwritten = self.unwritten, None
            status = dump(decided)
            if status == self.written:
                continue
            try:
                try:
                    version = await self.writes.patch_status(
                        namespace, name, status, self.version, self.uid
                    )
                except StatusNotFound:
                    if await self.kube.get_topology(namespace, name) is None:
                        log.info("%s/%s: gone from the API server; forgetting it", *self.key)
                        self.gone()
                        return
                    raise StatusWriteRefused(404, MISSING_STATUS_SUBRESOURCE) from None
            except Fenced as exc:
                # Not leading with a fresh lease (stopping, demoted, partitioned): nothing
                # is written; the leader's loop writes the status it decides.
                log.info("%s/%s: the status is not written: %s", *self.key, exc)
                return
            except Exception as exc:
                await self._failed(exc, decided)
                continue
            self.failures, self.failure_logged = 0, ""
            if version is None:
                # The object changed since the version written last (its spec, or a
                # write of a replaced leader) or is another object now: asked of the API
                # server itself (a watch that missed a deletion still holds the body),
                # carry on from its latest version, with the newest status.
                body = await self.kube.get_topology(namespace, name)
                if body is None:  # deleted (maybe while the watch was away): forgotten
                    log.info("%s/%s: gone from the API server; forgetting it", *self.key)
                    self.gone()
                    return
                latest = str(body["metadata"].get("resourceVersion") or "")
                if self.unwritten is None:
                    self.unwritten = decided
                if latest == self.version:  # the watch has not caught up yet
                    await asyncio.sleep(self.pacing().retry_s)
                self.version = latest
                continue
            self.written, self.version = status, version
            await asyncio.sleep(status_pause(status, self.pacing()))  # pacing the writes

    async def _failed(self, exc: Exception, decided: KVTopologyStatus) -> None:
        """A write that failed: counted, logged once per kind, told when it lasts, and
        tried again (newest first) after a backoff."""
        self.failures += 1
        pause = min(
            self.pacing().max_backoff_s,
            self.pacing().retry_s * 2 ** min(self.failures - 1, 16),
        )
        said = f"{type(exc).__name__}: {exc}"[:300]
        log.log(
            logging.DEBUG if said == self.failure_logged else logging.WARNING,
            "%s/%s: the status write failed (%d in a row; next try in %.1f s): %s",
            *self.key,
            self.failures,
            pause,
            said,
        )
        self.failure_logged = said
        self.metrics.status_write_failures.inc()
        await self._tell_refusal(exc)
        if self.unwritten is None:
            self.unwritten = decided
        await asyncio.sleep(pause)  # backing off: a refusal may last

    async def _tell_refusal(self, exc: Exception) -> None:
        """A write the API server refused for what it says (400, 404 on an existing
        object, 413, 422: the next write of the same kind will be refused too) is an Event
        (`StatusWriteRefused`), once per refusal; a passing failure (a timeout, 429, 5xx) is
        only logged and counted."""
        code = getattr(exc, "status", None)
        if code not in (400, 404, 413, 422):
            return
        text = str(getattr(exc, "body", "") or exc)[:600]
        if text == self.refusal_told:
            return
        self.refusal_told = text
        body = self.body()
        if body is None:
            with contextlib.suppress(Exception):  # an Event is a courtesy: never stop for it
                body = await self.kube.get_topology(*self.key)
        if body is not None:
            message = f"the API server refused the status (HTTP {code}): {text}"
            self.events.record(body, Event("Warning", "StatusWriteRefused", message[:1024]))
