"""The `kvtopo` command: one entry point for the benchmarks and the local control plane.

Owns argument parsing and dispatch only; each verb's work lives in its own package and is
imported lazily, so `kvtopo --help` stays fast and needs neither torch nor nixl. Verbs that
live above this package (`bench`, in kvtopo_bench) are not imported by name: a package
registers a function under the `kvtopo.verbs` entry-point group that adds its subparser
(with its handler as `func`), and :func:`build_parser` calls each one it finds installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

VERB_ENTRY_POINTS = "kvtopo.verbs"
"""The entry-point group of verbs other packages add (pyproject.toml, `[project.entry-points]`)."""


def add_registered_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the verbs registered under :data:`VERB_ENTRY_POINTS`, in the order of their names;
    each entry point names a function that adds its subparser to `verbs`."""
    for point in sorted(entry_points(group=VERB_ENTRY_POINTS), key=lambda p: p.name):
        add: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], object]
        add = point.load()
        add(verbs)


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

    add_registered_verbs(verbs)

    from kvtopo.cluster.cli import add_cluster_parser, run_cluster
    from kvtopo.drill.cli import add_drill_parser

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
