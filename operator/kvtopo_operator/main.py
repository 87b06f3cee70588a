"""`kvtopo-operator`: the operator process (kopf) with its metrics endpoint.

Owns command-line parsing, the Prometheus HTTP server and starting kopf with the operator's
configuration in `memo`. One active replica: standalone by default (this process always
acts); `--leader-elect` runs it as one of several replicas of which only the holder of a
Lease acts while the others stay warm standbys (see `leader`); `--peering NAME` instead uses
kopf's peering objects as a guard against a second one (kopf pauses every replica of equal
priority, so it cannot keep a standby warm: the two are mutually exclusive).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

from prometheus_client import start_http_server

from kvtopo_operator.metrics import OperatorMetrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtopo-operator",
        description="Watches engine pods of KVTopology resources and keeps every prefill/decode "
        "pair connected, evicting engines that are gone.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch the whole cluster"
    )
    p.add_argument(
        "--kubeconfig", help="default: in-cluster config, then $KUBECONFIG/~/.kube/config"
    )
    p.add_argument(
        "--worker-key-file",
        type=Path,
        default=Path(os.environ["KVTOPO_WORKER_KEY_FILE"])
        if os.environ.get("KVTOPO_WORKER_KEY_FILE")
        else None,
        help="the operator's private key (PEM, EC P-256; a mounted Secret: the key, and during "
        "a rotation the previous key after it), which its calls to the workers' admin "
        "routes are signed with. Engines hold only its public key. Default: "
        "$KVTOPO_WORKER_KEY_FILE",
    )
    p.add_argument(
        "--allow-endpoint-host",
        action="store_true",
        help="development only: let a pod's kvtopo.dev/control-endpoint annotation name a "
        "host (ip:port) instead of only a port; by default a worker is reached at its pod IP",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    p.add_argument("--metrics-port", type=int, default=8080, help="0 turns the metrics server off")
    p.add_argument(
        "--liveness",
        default=None,
        help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz: reports each "
        "topology loop's seconds since its last successful round, and answers HTTP 500 "
        "while a loop is stuck (see --stuck-after-seconds)",
    )
    p.add_argument(
        "--stuck-after-seconds",
        type=float,
        default=None,
        help="a topology loop that has not ended a round (well or not) for this long is "
        "stuck and fails the liveness endpoint (default: max(120, 10 x --resync-seconds)); "
        "keep it above the longest wait between rounds (--resync-seconds, a failing loop's "
        "backoff of up to 10 s) plus the longest round (e.g. many unreachable workers at "
        "the handshake timeout each)",
    )
    p.add_argument(
        "--relist-seconds",
        type=float,
        default=60.0,
        help="how often the engine pods are listed afresh (the list replaces what the "
        "watch told: a pod deleted while no watch ran is dropped); 0: only after '410 "
        "Gone' or an error",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=2.0,
        help="the longest a worker's state goes unread (longer in a topology too large to "
        "re-read within --state-reads-per-second); new workers, and workers a call to "
        "failed, are read at once",
    )
    p.add_argument(
        "--state-reads-per-second",
        type=float,
        default=100.0,
        help="at most this many periodic worker-state re-reads a second per namespace (its "
        "topologies share it): in a "
        "topology of more than --resync-seconds x this workers, each is re-read every "
        "workers / this seconds instead (10 s at 1,000); 0: no bound",
    )
    p.add_argument(
        "--watch-nodes",
        action="store_true",
        help="watch the cluster's Nodes (needs list and watch on nodes: the chart's "
        "nodes.watch): an engine on a node whose Ready is not True is lost from the node's "
        "transition, gated or not; without it, the pod's own Ready tells",
    )
    p.add_argument(
        "--guarded-control-ports",
        default="",
        help="the control ports a NetworkPolicy guards, comma-separated (the chart's "
        "workers.controlPort and workers.extraControlPorts): a KVTopology whose controlPort "
        "is none of them gets a Warning Event, ControlPortUnguarded; empty: no check",
    )
    p.add_argument("--peering", default=None, help="kopf peering name (default: standalone)")
    p.add_argument("--verbose", "-v", action="store_true")
    le = p.add_argument_group(
        "leader election", "several replicas, one acting: the holder of a coordination.k8s.io Lease"
    )
    le.add_argument("--leader-elect", action="store_true", help="elect a leader (hot standby)")
    le.add_argument(
        "--leader-elect-namespace",
        default=None,
        help="the Lease's namespace (default: the first --namespace, else $POD_NAMESPACE)",
    )
    le.add_argument("--leader-elect-lease-name", default="kvtopo-operator", help="the Lease")
    le.add_argument(
        "--leader-elect-identity",
        default=None,
        help="this replica's holder identity (default: $POD_NAME, else the host name, "
        "+ '_' + a random suffix)",
    )
    le.add_argument(
        "--leader-elect-lease-seconds",
        type=int,
        default=15,
        help="how long a standby waits, from its last sight of a change, before taking over",
    )
    le.add_argument(
        "--leader-elect-renew-seconds",
        type=float,
        default=10.0,
        help="a leader that has not renewed for this long stops acting (< lease seconds)",
    )
    le.add_argument(
        "--leader-elect-retry-seconds",
        type=float,
        default=2.0,
        help="how often the leader renews and standbys try (< renew seconds)",
    )
    args = p.parse_args(argv)
    if args.leader_elect:
        if args.peering is not None:
            p.error("--leader-elect and --peering exclude each other")
        if not args.leader_elect_namespace:
            args.leader_elect_namespace = (args.namespace or [None])[0] or os.environ.get(
                "POD_NAMESPACE"
            )
        if not args.leader_elect_namespace:
            p.error("give --leader-elect-namespace (or set POD_NAMESPACE)")
        if args.leader_elect_lease_seconds < 1:
            p.error("--leader-elect-lease-seconds must be at least 1")
        if not 0 < args.leader_elect_renew_seconds < args.leader_elect_lease_seconds:
            p.error("--leader-elect-renew-seconds must be above 0 and below the lease seconds")
        if not 0 < args.leader_elect_retry_seconds < args.leader_elect_renew_seconds:
            p.error("--leader-elect-retry-seconds must be above 0 and below the renew seconds")
    try:
        args.guarded_ports = frozenset(
            int(x) for x in str(args.guarded_control_ports).split(",") if x.strip()
        )
    except ValueError:
        p.error("--guarded-control-ports takes port numbers, comma-separated")
    if args.relist_seconds < 0:
        p.error("--relist-seconds must be 0 (off) or more")
    if args.stuck_after_seconds is not None and args.stuck_after_seconds <= 0:
        p.error("--stuck-after-seconds must be above 0")
    if not args.namespace and not args.all_namespaces:
        p.error("give --namespace NS (repeatable) or --all-namespaces")
    if args.worker_key_file is None:
        p.error(
            "give --worker-key-file (or set KVTOPO_WORKER_KEY_FILE): the operator's private key"
        )
    return args


# The interpreter hands the GIL to a waiting thread after this long (CPython's default:
# 5 ms). The event loop makes the worker calls, and each of its socket calls gives the GIL
# up; while a round's decision (a thread) or the pod watch's parsing (another) computes,
# the loop then waited up to the whole interval to get it back, at every send and receive:
# a round's calls crawled while the next one decided, and the decision's wall time was
# three to five times its CPU time. BENCHMARKS.md, fifteenth session.
GIL_SWITCH_INTERVAL_S = 0.0002

# The cyclic garbage collector's thresholds (CPython's default: 700, 10, 10). A round of a
# large topology makes and drops tens of thousands of containers (handshakes, views, their
# sets), so at the default the collector ran thousands of times a rollout and fully every
# two seconds or so, each full pass walking every worker view and memo: at 64 x 2,000 its
# passes took 19.6 s of wall time in a run of 42 s of operator CPU, up to 0.47 s at a time with the
# event loop stopped. Nearly all of that is garbage reference counting frees at once;
# the collector is for cycles (a task's exception and its traceback), which these
# thresholds still bound: a young collection every 50,000 containers more than were
# freed. BENCHMARKS.md, seventeenth session.
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Sets `GC_THRESHOLDS`, and leaves what exists now (the modules, classes and
    functions imported: some 80,000 objects) out of every later collection."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if not args.verbose:
        # kopf logs every handled event at INFO; the operator's own lines are what matter.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # Each liveness/readiness probe runs the loops probe: only its failures matter.
        logging.getLogger("kopf.activities.probe").setLevel(logging.WARNING)
    if args.kubeconfig:
        # Before kopf or the kubernetes client are imported: the client reads it at import.
        os.environ["KUBECONFIG"] = str(Path(args.kubeconfig).resolve())
    from kvtopo_operator import handlers  # registers the kopf handlers

    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    import kopf

    memo = kopf.Memo(
        kubeconfig=args.kubeconfig,
        key_file=args.worker_key_file,
        metrics=metrics,
        resync_s=args.resync_seconds,
        state_reads_per_s=args.state_reads_per_second,
        relist_s=args.relist_seconds,
        stuck_after_s=args.stuck_after_seconds,
        watch_namespaces=None if args.all_namespaces else list(args.namespace),
        allow_endpoint_host=args.allow_endpoint_host,
        watch_nodes=args.watch_nodes,
        guarded_ports=args.guarded_ports,
    )
    if args.leader_elect:
        from kvtopo_operator.leader import ElectionConfig, default_identity

        memo.election = ElectionConfig(
            lease_duration_s=args.leader_elect_lease_seconds,
            renew_deadline_s=args.leader_elect_renew_seconds,
            retry_period_s=args.leader_elect_retry_seconds,
        )
        memo.lease_namespace = args.leader_elect_namespace
        memo.lease_name = args.leader_elect_lease_name
        memo.lease_identity = args.leader_elect_identity or default_identity(
            os.environ.get("POD_NAME")
        )
    assert handlers.kv_topologies is not None
    tune_gc()
    kopf.run(
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        memo=memo,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
