"""The `kvtopo bench` verb: its arguments and the handler of each benchmark.

Owns the `bench` subparser (push, registry, operator, vllm, wire, isolation, summary: flags,
help texts, handlers).
The `kvtopo` command does not import this package: it finds :func:`add_bench_parser` through
the `kvtopo.verbs` entry point in pyproject.toml and calls it with its subparsers. Each
benchmark module is imported only when its verb runs, so `kvtopo --help` needs neither torch
nor nixl.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path


def _bench_push(args: argparse.Namespace) -> int:
    from kvtopo_bench import push

    try:
        report = push.run(
            args.json,
            quick=args.quick,
            log=lambda line: print(line, flush=True),
            device=args.device,
            tp=args.tp,
        )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(push.format_table(report))
    if args.json is not None:
        print(f"\nJSON report: {args.json}")
    ok = push.all_verified(report)
    if not ok:
        print("error: some pushed bytes did not verify", file=sys.stderr)
    return 0 if ok else 1


def _bench_summary(args: argparse.Namespace) -> int:
    from kvtopo_bench.summary import summarize

    table, ok = summarize(args.results)
    print(table)
    if not ok:
        print("\nsome targets are missed or reports missing (see above)", file=sys.stderr)
    return 0 if ok else 1


def _sizes(text: str) -> list[tuple[int, int]]:
    """`--sizes`: "PxD,PxD" as (prefill, decode) pairs, each at least 1."""
    out = []
    for part in text.split(","):
        p, sep, d = part.strip().partition("x")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not PREFILLxDECODE, e.g. 32x1000")
        out.append((int(p), int(d)))
    return out


def _shape(text: str) -> tuple[int, int]:
    """ "100x10" -> (100, 10): topologies x engines each."""
    t, sep, n = text.partition("x")
    if not sep or not t.isdigit() or not n.isdigit() or int(t) < 1 or int(n) < 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOPOLOGIESxENGINES, e.g. 100x10")
    return int(t), int(n)


def _bench_report(module: str) -> Callable[[argparse.Namespace], int]:
    """The handler of a benchmark that writes its own report: run, then say where it is."""

    def run(args: argparse.Namespace) -> int:
        bench = importlib.import_module(f"kvtopo_bench.{module}")
        extra: dict[str, object] = {}
        if getattr(args, "baseline_tree", None) is not None:
            extra["baseline_tree"] = args.baseline_tree
        if getattr(args, "hostile", False):
            extra["hostile"] = True
        if getattr(args, "topologies", None):
            extra["topologies"] = args.topologies
        if getattr(args, "sizes", None):
            extra["sizes"] = args.sizes
        if getattr(args, "rounds", None) is not None:
            extra["rounds"] = args.rounds
        if getattr(args, "variants", None):
            extra["variants"] = [v.strip() for v in args.variants.split(",") if v.strip()]
        try:
            bench.run(
                args.json, quick=args.quick, log=lambda line: print(line, flush=True), **extra
            )
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json is not None:
            print(f"JSON report: {args.json}")
        return 0

    return run


def add_bench_parser(
    verbs: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``bench {push,registry,operator,vllm,wire,isolation,summary}`` to ``verbs``, each
    with its handler as ``func``; returns the ``bench`` parser. The `kvtopo.verbs` entry point
    names this."""
    bench = verbs.add_parser("bench", help="run a benchmark (results as JSON)")
    bench_kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    benchmarks = (
        (
            "push",
            _bench_push,
            "push data path vs raw NIXL vs a torch copy, two processes, every byte verified",
            "Measures, side by side in one run, raw NIXL WRITEs (best of progress thread "
            "on/off x 1/8 in flight, per-block and merged descriptors), the kvtopo push path "
            "(registration + match + WRITE + completion, every byte verified; 1/8/16/32 in "
            "flight, block merging off/on) and a torch copy of the same bytes; on the CPU, "
            "and on the GPU where one is present.",
            "fewer requests and repeats",
        ),
        (
            "registry",
            _bench_report("registry"),
            "registry lock critical sections and writer throughput under churn",
            "snapshot/evict critical sections (p50/p99 us) at 1, 8 and 64 ranks with 1,000 "
            "engines; registration-writer throughput alone and under eviction churn.",
            "fewer calls and shorter runs",
        ),
        (
            "operator",
            _bench_report("operator"),
            "the operator at fleet scale on a local control plane with kwok",
            "The decision alone (evaluate, 500 x 1500 engines, no cluster); then 16 x 64, "
            "32 x 1000 and 64 x 2000 pods with in-process fake worker control servers: pod "
            "serving -> pairs Connected, pod gone -> evicted, full rollout -> converged "
            "(beside the same rollout with only the control plane, measured first), "
            "operator RSS and CPU per 1,000 pod events.",
            "only the 16 x 64 size",
        ),
        (
            "vllm",
            _bench_report("vllm"),
            "KVTopoConnector beside vLLM's own NixlPushConnector (needs the vllm extra)",
            "A prefill and a decode vLLM engine per run (vLLM's NixlPushConnector; "
            "KVTopoConnector with the operator's handshakes, with its default NIXL progress "
            "thread and with vLLM's NIXL agent settings; KVTopoConnector alone), vLLM's "
            "scheduler, real KV tensors and NIXL (the forward pass stood in for), driven as "
            "a P/D proxy drives them; the variants interleaved (A B B A), each run a fresh "
            "pair: the first request once the engines serve, 512 KiB requests one at a time "
            "(latency), 8 MiB requests 4 in flight (bandwidth), each with the engines' CPU "
            "seconds, and a prefill replaced under the same address. Reports each engine's "
            "NIXL progress-thread setting, every run, the medians and named ratios.",
            "fewer requests, 20 s for the replaced prefill",
        ),
        (
            "wire",
            _bench_report("wirecalls"),
            "what one operator call to a worker costs: aiohttp's client beside the operator's",
            "PATCH calls to 200 loopback endpoints, 64 out at once, made by aiohttp's client "
            "(as the operator used it before) and by kvtopo_operator.wire, alternating A B B "
            "A: client and server CPU per call, wall time per call, connections; the ratios "
            "wire / aiohttp.",
            "one A B B A of 2,000 calls per run",
        ),
        (
            "isolation",
            _bench_report("isolation"),
            "how much a hostile peer delays another pair's requests (real workers and NIXL)",
            "A prefill and a decode carry a steady stream of verified requests while, in "
            "alternate quiet and hostile phases (A B B A per kind), the prefill is flooded: "
            "registrations from an agent it never added, garbage, and registrations nobody "
            "prefilled from a second decode it holds. Reports the pair's p50/p99 latency "
            "per phase and the p99 delay (target <= 100 ms).",
            "4 s phases instead of 10 s",
        ),
    )
    for name, func, help_, description, quick_help in benchmarks:
        kind = bench_kinds.add_parser(name, help=help_, description=description)
        kind.add_argument("--json", type=Path, metavar="PATH", help="write the JSON report here")
        kind.add_argument("--quick", action="store_true", help=quick_help)
        kind.set_defaults(func=func)
        if name == "operator":
            kind.add_argument(
                "--baseline-tree",
                type=Path,
                metavar="DIR",
                help="also run the operator of this source tree (a checkout of another "
                "commit, e.g. `git worktree add DIR COMMIT`): each size four times on one "
                "cluster, that operator and this one alternating (A B B A); every run in the "
                "report's side_by_side",
            )
            kind.add_argument(
                "--sizes",
                type=_sizes,
                default=None,
                metavar="PxD,...",
                help="the sizes to run, prefill x decode pods, e.g. 32x1000,64x2000 (default: "
                "16x64, 32x1000 and 64x2000; 16x64 with --quick)",
            )
            kind.add_argument(
                "--hostile",
                action="store_true",
                help="instead: 32 x 1000 (16 x 64 with --quick) four times on one cluster, "
                "clean, hostile, hostile, clean; in the hostile runs one decode worker "
                "answers garbage and one hangs, all along. The report's hostile section "
                "compares the healthy engines' ready -> connected p99 (target: within 1.2x) "
                "and the operator's RSS (one more decode answers 16 MiB states that change on "
                "every read: target within 1.2x of the clean runs')",
            )
            kind.add_argument(
                "--topologies",
                type=_shape,
                default=None,
                metavar="TxN",
                help="instead: T topologies of N engines in one namespace, then T x N engines "
                "as one topology, on one control plane; the report's topologies section "
                "compares the operator's idle CPU (target: within 2x), e.g. 100x10",
            )
        if name == "vllm":
            kind.add_argument(
                "--rounds",
                type=int,
                default=None,
                metavar="N",
                help="rounds of the variants, alternating their order (A B, B A, ...): each "
                "variant runs N times, each run a fresh engine pair (default 4; 2 with "
                "--quick)",
            )
            kind.add_argument(
                "--variants",
                default=None,
                metavar="A,B",
                help="the variants to run, comma-separated (default: nixl, kvtopo, "
                "kvtopo_progress_thread, kvtopo_no_operator); the ratios need nixl",
            )
        if name == "registry":
            kind.add_argument(
                "--baseline-tree",
                type=Path,
                metavar="DIR",
                help="also measure the registry of this source tree (a checkout of another "
                "commit): the 64-rank critical sections and the writer under churn, each tree "
                "in processes of its own, alternating A B B A; the report's side_by_side",
            )
        if name == "push":
            kind.add_argument(
                "--device",
                choices=("auto", "cpu", "cuda"),
                default="auto",
                help="auto (default): the CPU cases, plus the GPU variant (KV caches in GPU "
                "memory) where torch sees a CUDA device; cpu: CPU only; cuda: GPU only",
            )
            kind.add_argument(
                "--tp",
                type=int,
                choices=range(1, 9),
                default=1,
                metavar="N",
                help="tensor-parallel ranks: N prefill/decode rank pairs, each in processes "
                "of its own, move each request's share at once (default 1)",
            )

    summary = bench_kinds.add_parser(
        "summary",
        help="one table of the figures with targets, from the JSON reports",
        description="Reads push.json, registry.json and operator.json from --results and "
        "prints each figure that has a target, the target and whether it is met. Exits 1 "
        "when a target is missed or a report is missing.",
    )
    summary.add_argument(
        "--results",
        type=Path,
        default=Path("bench/results"),
        metavar="DIR",
        help="folder of the JSON reports (default: bench/results)",
    )
    summary.set_defaults(func=_bench_summary)
    return bench
