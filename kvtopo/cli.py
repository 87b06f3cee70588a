"""The `kvtopo` command: one entry point for the benchmarks and the local control plane.

Owns argument parsing and dispatch only; each verb's work lives in its own package and is
imported lazily, so `kvtopo --help` stays fast and needs neither torch nor nixl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _bench_push(args: argparse.Namespace) -> int:
    from kvtopo_bench import push

    report = push.run(args.json, quick=args.quick, log=lambda line: print(line, flush=True))
    print()
    print(push.format_table(report))
    if args.json is not None:
        print(f"\nJSON report: {args.json}")
    ok = all(c["verified"] for c in report["cases"])
    if not ok:
        print("error: some pushed bytes did not verify", file=sys.stderr)
    return 0 if ok else 1


def _bench_registry(args: argparse.Namespace) -> int:
    from kvtopo_bench import registry

    registry.run(args.json, quick=args.quick, log=lambda line: print(line, flush=True))
    if args.json is not None:
        print(f"JSON report: {args.json}")
    return 0


def _bench_operator(args: argparse.Namespace) -> int:
    from kvtopo_bench import operator as operator_bench

    operator_bench.run(args.json, quick=args.quick, log=lambda line: print(line, flush=True))
    if args.json is not None:
        print(f"JSON report: {args.json}")
    return 0


def _crds(args: argparse.Namespace) -> int:
    from kvtopo_operator.crd import render_crd

    sys.stdout.write(render_crd())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtopo",
        description="kvtopo keeps the KV-cache transfer topology of prefill/decode "
        "disaggregated LLM deployments correct while pods churn.",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    crds = verbs.add_parser(
        "crds",
        help="print the KVTopology CRD (generated from the API models)",
        description="Prints the CustomResourceDefinition generated from kvtopo_operator.api; "
        "the checked-in crds/kvtopology.yaml is this output.",
    )
    crds.set_defaults(func=_crds)

    bench = verbs.add_parser("bench", help="run a benchmark (results as JSON)")
    bench_kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    push = bench_kinds.add_parser(
        "push",
        help="push data path vs raw NIXL vs a torch copy, two processes, every byte verified",
        description="Measures, side by side in one run, raw NIXL WRITEs (best of progress "
        "thread on/off x 1/8 in flight), the kvtopo push path (registration + match + WRITE "
        "+ completion, every byte verified) and a torch copy of the same bytes.",
    )
    push.add_argument("--json", type=Path, metavar="PATH", help="write the JSON report here")
    push.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    push.set_defaults(func=_bench_push)
    reg = bench_kinds.add_parser(
        "registry",
        help="registry lock critical sections and writer throughput under churn",
        description="snapshot/evict critical sections (p50/p99 us) at 1, 8 and 64 ranks with "
        "1,000 engines; registration-writer throughput alone and under eviction churn.",
    )
    reg.add_argument("--json", type=Path, metavar="PATH", help="write the JSON report here")
    reg.add_argument("--quick", action="store_true", help="fewer calls and shorter runs")
    reg.set_defaults(func=_bench_registry)
    op = bench_kinds.add_parser(
        "operator",
        help="the operator at fleet scale on a local control plane with kwok",
        description="16 x 64 and 32 x 1000 pods with in-process fake worker control servers: "
        "pod serving -> pairs Connected, pod gone -> evicted, full rollout -> converged, "
        "operator RSS and CPU per 1,000 pod events.",
    )
    op.add_argument("--json", type=Path, metavar="PATH", help="write the JSON report here")
    op.add_argument("--quick", action="store_true", help="only the 16 x 64 size")
    op.set_defaults(func=_bench_operator)

    from kvtopo.cluster.cli import add_cluster_parser, run_cluster
    from kvtopo.drill.run import add_drill_parser

    add_drill_parser(verbs)

    add_cluster_parser(verbs).set_defaults(func=run_cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
