"""Worker counters: one Prometheus registry per worker and the single failure-recording helper.

Owns the per-worker `CollectorRegistry` (several workers may live in one process in tests and
benchmarks, so nothing is registered globally), the failure counters by `FailureType` that
`GET /v1/state` reports to the operator, and `record_failure`, the one structured log line
for every failure ("kvtopo transfer failure: <type> | context: {...}").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as _Tally
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtopo_worker.protocol import FailureRecord, FailureType

log = logging.getLogger("kvtopo_worker.failures")


class WorkerMetrics:
    """Counters of one worker; thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._last_warning: dict[str, float] = {}  # kind -> when `warn_limited` last logged
        self._failures: _Tally[str] = _Tally()
        self.last_failure: FailureRecord | None = None
        self.failures_total = Counter(
            "kvtopo_worker_failures",
            "Failures by type (transfer, notification, handshake, timeout, bad input).",
            ["type"],
            registry=self.registry,
        )
        self.requests_total = Counter(
            "kvtopo_worker_requests",
            "Requests ended, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.rejected_total = Counter(
            "kvtopo_worker_rejected_messages",
            "Malformed or unexpected messages from peers or the control API, by source.",
            ["source"],
            registry=self.registry,
        )
        self.connections_refused_total = Counter(
            "kvtopo_worker_control_connections_refused",
            "Control API connections closed by its bounds: over the total or per-source cap, "
            "or no request head within the deadline.",
            ["why"],
            registry=self.registry,
        )
        self.duplicate_outcomes_total = Counter(
            "kvtopo_worker_duplicate_outcomes",
            "Second outcomes for an already ended request (dropped; must stay 0).",
            registry=self.registry,
        )
        self.writes_unreleasable = Gauge(
            "kvtopo_worker_writes_unreleasable",
            "WRITEs past their deadline that NIXL would not release (they may still land: "
            "their requests stay held until NIXL ends them).",
            registry=self.registry,
        )
        self.late_writes_total = Counter(
            "kvtopo_worker_late_writes",
            "KV blocks found written while no request held them (a WRITE that landed after "
            "the engine let its request go; the emulated engine's guard: must stay 0).",
            registry=self.registry,
        )
        self.handshakes_total = Counter(
            "kvtopo_worker_handshakes",
            "Peer handshakes by result.",
            ["result"],
            registry=self.registry,
        )
        self.evictions_total = Counter(
            "kvtopo_worker_evictions",
            "Peer evictions by result (evicted, deferred, absent).",
            ["result"],
            registry=self.registry,
        )
        self.authenticated_total = Counter(
            "kvtopo_worker_authenticated_requests",
            "Control API requests let in, by credential (operator, peer) and which of its "
            "tokens matched (current, previous: a rotation still reaching some callers).",
            ["credential", "token"],
            registry=self.registry,
        )
        self.peers = Gauge(
            "kvtopo_worker_peers", "Remote engines in the registry.", registry=self.registry
        )
        self.peer_health_total = Counter(
            "kvtopo_worker_peer_health_changes",
            "Held peers that turned dropped (NIXL disconnected them) or failing (their last "
            "transfers all failed), by the health they turned to.",
            ["health"],
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "kvtopo_worker_transfer_seconds",
            "WRITE time from post to DONE.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5),
            registry=self.registry,
        )
        self.transfer_bytes_total = Counter(
            "kvtopo_worker_transfer_bytes", "Bytes written to peers.", registry=self.registry
        )

    def record_failure(
        self, failure: FailureType, context: Mapping[str, object], *, level: int = logging.WARNING
    ) -> None:
        """Counts a failure and logs it once, in one structured line."""
        record = FailureRecord(
            time=time.time(),
            type=failure,
            request_id=str(context.get("request_id", ""))[:256],
            engine_id=str(context.get("engine_id", ""))[:256],
            message=str(context.get("msg", ""))[:512],
        )
        with self._lock:
            self._failures[failure.value] += 1
            self.last_failure = record
        self.failures_total.labels(failure.value).inc()
        log.log(level, "kvtopo transfer failure: %s | context: %s", failure.value, dict(context))

    def reject(self, source: str, count: int = 1) -> None:
        """Counts `count` malformed or unexpected messages (dropped, nothing crashed)."""
        with self._lock:
            self._failures[FailureType.MALFORMED_MESSAGE.value] += count
        self.rejected_total.labels(source).inc(count)

    def unauthenticated(self, agent_name: str, known: bool) -> None:
        """Counts a notification dropped because it did not open with its sender's key: a
        forgery (or an altered message) from an agent we hold is a rejected message; one
        from an agent never added (a greeting that raced its handshake, or a stranger) is
        counted apart, as `unknown_agent`, and is no failure."""
        if known:
            self.reject("unauthenticated")
            self.warn_limited(
                "unauthenticated",
                "dropped a notification %s did not seal (forged or altered); more are "
                "counted in kvtopo_worker_rejected_messages{source=unauthenticated}",
                agent_name,
            )
        else:
            self.rejected_total.labels("unknown_agent").inc()

    def warn_limited(self, kind: str, message: str, *args: object) -> None:
        """A warning about what a peer sent, logged at most once a second per `kind` (the
        rest at debug level): a flood is counted in the metrics, not written to the log
        once per message."""
        now = time.monotonic()
        if now - self._last_warning.get(kind, -1e9) < 1.0:
            log.debug(message, *args)
            return
        self._last_warning[kind] = now
        log.warning(message, *args)

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._failures)
