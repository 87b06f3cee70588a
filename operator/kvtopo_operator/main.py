"""`kvtopo-operator`: the operator process (kopf) with its metrics endpoint.

Owns command-line parsing, the Prometheus HTTP server and starting kopf with the operator's
configuration in `memo`. One active replica: standalone by default; `--peering NAME` uses
kopf's peering objects as a guard against a second one.
"""

from __future__ import annotations

import argparse
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
        "--worker-token-file", type=Path, help="bearer token for the workers' control API"
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    p.add_argument("--metrics-port", type=int, default=8080, help="0 turns the metrics server off")
    p.add_argument(
        "--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz"
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=2.0,
        help="the longest a worker's state goes unread; new workers, and workers a call "
        "to failed, are read at once",
    )
    p.add_argument("--peering", default=None, help="kopf peering name (default: standalone)")
    p.add_argument("--verbose", "-v", action="store_true")
    args = p.parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        p.error("give --namespace NS (repeatable) or --all-namespaces")
    if args.worker_token_file is None and not os.environ.get("KVTOPO_WORKER_TOKEN"):
        p.error("give --worker-token-file (or set KVTOPO_WORKER_TOKEN)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if not args.verbose:
        # kopf logs every handled event at INFO; the operator's own lines are what matter.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
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
        token_file=args.worker_token_file,
        token=os.environ.get("KVTOPO_WORKER_TOKEN"),
        metrics=metrics,
        resync_s=args.resync_seconds,
    )
    assert handlers.engine_pods is not None
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
