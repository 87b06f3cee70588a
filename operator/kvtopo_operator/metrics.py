"""The operator's Prometheus metrics, in a registry of its own (served on /metrics).

Owns the counters and histograms the reconciler updates: handshakes and evictions by
result, readiness-gate writes, reconcile duration, the time from an engine coming up to all
of its pairs Connected, and the expected/connected pair gauges per topology; and the leader
gauge, the engine pods the periodic relist dropped and the relists that failed (`handlers`
updates these).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.handshakes = Counter(
            "kvtopo_operator_handshakes",
            "Peer adds the operator asked for, by result.",
            ["result"],
            registry=self.registry,
        )
        self.evictions = Counter(
            "kvtopo_operator_evictions",
            "Peer evictions the operator asked for, by result.",
            ["result"],
            registry=self.registry,
        )
        self.arrival_handshakes = Counter(
            "kvtopo_operator_arrival_handshakes",
            "Handshake halves planned for engines that came up after a round's gather: "
            "joined to that round's calls (or made by the fast pass between rounds, when "
            "on), and for those a round's gather read first, paired while it decides; "
            "their results are counted in kvtopo_operator_handshakes.",
            registry=self.registry,
        )
        self.state_reads = Counter(
            "kvtopo_operator_worker_state_reads",
            "Worker /v1/state reads (new, failed or stale workers only).",
            registry=self.registry,
        )
        self.state_prefetches = Counter(
            "kvtopo_operator_worker_state_prefetches",
            "First reads of new workers started as soon as the pod watch reported their pod "
            "usable, before a round or pass looked (also counted in "
            "kvtopo_operator_worker_state_reads once they end within a round).",
            registry=self.registry,
        )
        self.state_unchanged = Counter(
            "kvtopo_operator_worker_state_unchanged",
            "Worker /v1/state reads the worker answered 304 Not Modified (the view kept).",
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "kvtopo_operator_events_dropped",
            "Events not posted, by why: repeat (said within the repeat window), rate (over "
            "the object's budget), queue_full, post_failed.",
            ["why"],
            registry=self.registry,
        )
        self.gate_writes = Counter(
            "kvtopo_operator_gate_writes",
            "Writes of the kvtopo.dev/kv-connected pod condition (the readiness gate), by "
            "result: True, False, or failed (written again next round).",
            ["result"],
            registry=self.registry,
        )
        self.status_write_failures = Counter(
            "kvtopo_operator_status_write_failures",
            "KVTopology status writes refused or failed (the next round writes again; "
            "eviction timers and failure baselines do not depend on them).",
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "kvtopo_operator_reconcile_seconds",
            "Duration of one topology reconcile.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.ready_to_connected = Histogram(
            "kvtopo_operator_ready_to_connected_seconds",
            "From an engine pod's containers becoming ready to all of its pairs Connected.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60),
            registry=self.registry,
        )
        self.pairs_expected = Gauge(
            "kvtopo_operator_pairs_expected",
            "Pairs that must be connected.",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.pairs_connected = Gauge(
            "kvtopo_operator_pairs_connected",
            "Pairs connected both ways.",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.peers_unhealthy = Gauge(
            "kvtopo_operator_peers_unhealthy",
            "Held peers of expected pairs that their holder reports dropped (NIXL disconnected "
            "them) or failing (their transfers keep failing); each is re-handshaked, which "
            "renews it.",
            ["namespace", "name"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "kvtopo_operator_leader",
            "1 while this replica runs the reconcile loops: it holds the leader Lease "
            "(--leader-elect), or runs standalone; 0 while it is a standby.",
            registry=self.registry,
        )
        self.stale_pods_dropped = Counter(
            "kvtopo_operator_stale_pods_dropped",
            "Engine pods dropped because a fresh list of their namespace (after '410 Gone', "
            "an error, or every --relist-seconds) no longer had them: deletions the pod "
            "watch missed.",
            registry=self.registry,
        )
        self.relist_failures = Counter(
            "kvtopo_operator_relist_failures",
            "Lists and watches of a namespace's engine pods that failed (the pods known stay "
            "as they are until a list succeeds).",
            registry=self.registry,
        )
        self.stale_topologies_dropped = Counter(
            "kvtopo_operator_stale_topologies_dropped",
            "KVTopologies forgotten because a fresh list (every --relist-seconds) no longer "
            "had them, or had another object (uid) under their name: deletions the watch "
            "missed.",
            registry=self.registry,
        )
        self.quiet_rounds = Counter(
            "kvtopo_operator_quiet_rounds",
            "Rounds that found nothing changed since a round with nothing to do (the same "
            "claim, spec and worker views, no call out, no timer running) and skipped the "
            "decision: their work was the periodic re-reads.",
            registry=self.registry,
        )
        self.writes = Counter(
            "kvtopo_operator_writes",
            "Writes this replica made, by kind: status (a KVTopology's), gate (a pod's "
            "kv-connected condition), event, peers (a worker's peer changes), settings (a "
            "worker's idle TTL). Every one passes the fence (`kvtopo_operator.fence`).",
            ["kind"],
            registry=self.registry,
        )
        self.writes_fenced = Counter(
            "kvtopo_operator_writes_fenced",
            "Writes refused by the fence because this replica did not lead with a fresh "
            "lease (stopping, demoted, partitioned) when it was about to make them, by kind "
            "(as kvtopo_operator_writes) and why (stopping, not_leading, lease_stale, "
            "clock_doubted).",
            ["kind", "why"],
            registry=self.registry,
        )
        self.pod_watch_malformed = Counter(
            "kvtopo_operator_pod_watch_malformed",
            "Pods or watch lines from the API server that the engine-pod watch could not "
            "decode (skipped).",
            registry=self.registry,
        )

    def forget_topology(self, namespace: str, name: str) -> None:
        """Removes the per-topology gauges of a topology this replica no longer runs (it is
        gone, or this replica lost the lead): they would otherwise report its last values."""
        for gauge in (self.pairs_expected, self.pairs_connected, self.peers_unhealthy):
            with contextlib.suppress(KeyError):  # never set
                gauge.remove(namespace, name)
