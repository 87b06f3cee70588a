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


def _call(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvtopo.localkeys import ControlClient
    from kvtopo_worker.credentials import TokenError
    from kvtopo_worker.signing import CallerKey, PrivateKeys

    try:
        caller = CallerKey("operator", PrivateKeys(path=Path(args.key)))
        token = Path(args.token).read_text().split()[0] if args.token else ""
    except (TokenError, OSError, IndexError) as exc:
        print(f"kvtopo call: {exc}", file=sys.stderr)
        return 2
    client = ControlClient(caller, token)
    body = json.loads(args.body) if args.body else None
    fetcher = None
    if args.method.upper() == "PUT" and args.path.startswith("/v1/peers/"):
        # The ticket is minted for the worker called: its engine id and incarnation.
        status, state = client.call("GET", args.endpoint, "/v1/state")
        if status != 200 or not isinstance(state, dict):
            print(f"kvtopo call: reading {args.endpoint}'s state: HTTP {status}", file=sys.stderr)
            return 1
        fetcher = (str(state["engine_id"]), str(state.get("incarnation", "")))
    status, answer = client.call(
        args.method.upper(), args.endpoint, args.path, body, fetcher=fetcher
    )
    print(json.dumps(answer, indent=2) if not isinstance(answer, str) else answer)
    return 0 if 200 <= status < 300 else 1


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

    call = verbs.add_parser(
        "call",
        help="call a worker's control API as the operator (signed with its private key)",
        description="One call to a worker's control API with the credential its route takes: "
        "admin routes (/v1/state, /v1/peers, /v1/settings) signed with the operator's private "
        "key for the challenge the worker answers; traffic routes with the client token. A "
        "peer add (PUT /v1/peers/{id} naming an endpoint) gets the ticket the operator would "
        "mint. Example: kvtopo call --key operator.key PUT 127.0.0.1:8976 /v1/peers/<prefill "
        'engine id> \'{"endpoint": "127.0.0.1:8975", "role": "prefill"}\'',
    )
    call.add_argument("--key", required=True, help="the operator's private key (PEM)")
    call.add_argument("--token", help="a file holding the client token (traffic routes)")
    call.add_argument("method", help="GET, PUT, PATCH, DELETE or POST")
    call.add_argument("endpoint", help="the worker's control API, ip:port")
    call.add_argument("path", help="e.g. /v1/state")
    call.add_argument("body", nargs="?", help="a JSON body")
    call.set_defaults(func=_call)

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
