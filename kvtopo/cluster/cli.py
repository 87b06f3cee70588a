"""``kvtopo cluster up|down|env``: the local control plane from the command line.

Owns the argparse wiring and the user-facing lines of the three commands:

- ``up [--tier a|b|c] [--dir DIR]`` starts a cluster, returns once it is ready and leaves it
  running detached (until ``down``); prints progress, the kubeconfig path and the
  ``export KUBECONFIG=...`` line.
- ``down [--dir DIR]`` stops the cluster recorded in DIR, from any process.
- ``env [--dir DIR]`` prints ``export KUBECONFIG=...`` for ``eval "$(kvtopo cluster env)"``.

``kvtopo/cli.py`` mounts :func:`add_cluster_parser` and dispatches to :func:`run_cluster`;
``python -m kvtopo.cluster.cli`` runs the same commands on their own.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType

from kvtopo.cluster.binaries import BinariesMissingError
from kvtopo.cluster.deadlines import DeadlineExceededError
from kvtopo.cluster.images import ImageBuildError
from kvtopo.cluster.local_cluster import (
    TIERS,
    ClusterAlreadyRunningError,
    ClusterState,
    LocalCluster,
    Tier,
    default_cluster_dir,
    running_cluster,
    stop_cluster,
)
from kvtopo.cluster.processes import ControlPlaneProcessError
from kvtopo.cluster.real_node import RealNodeError


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _complain(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _progress(line: str) -> None:
    _say(f"[cluster] {line}")


def _export_line(kubeconfig: str) -> str:
    return f"export KUBECONFIG={shlex.quote(kubeconfig)}"


def add_cluster_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``cluster {up,down,env}`` to ``subparsers``; returns the ``cluster`` parser.

    The parsed namespace carries ``cluster_command`` ('up'|'down'|'env'), ``dir`` (a Path or
    None for the default) and, for ``up``, ``tier``; pass it to :func:`run_cluster`.
    """
    cluster = subparsers.add_parser(
        "cluster",
        help="run a local Kubernetes control plane (etcd, kube-apiserver, ...) on loopback",
        description="A real local control plane on 127.0.0.1. Tier a: etcd + kube-apiserver. "
        "Tier b: + controller manager, scheduler and kwok fake nodes. Tier c: + one real node "
        "(containerd, a CNI bridge, a kubelet; root only) running kvtopo's own images, built "
        "with buildah from docker/ and uv.lock the first time.",
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    dir_help = f"cluster directory (default: {default_cluster_dir()})"

    up = commands.add_parser("up", help="start a cluster and leave it running until `down`")
    tiers = "a: API server; b: + kwok nodes; c: + one real node"
    up.add_argument("--tier", choices=TIERS, default="a", help=tiers)
    up.add_argument("--dir", type=Path, default=None, help=dir_help)

    down = commands.add_parser("down", help="stop the cluster started by `up`")
    down.add_argument("--dir", type=Path, default=None, help=dir_help)

    env = commands.add_parser("env", help="print `export KUBECONFIG=...` (for eval)")
    env.add_argument("--dir", type=Path, default=None, help=dir_help)
    return cluster


def run_cluster(args: argparse.Namespace) -> int:
    """Run the parsed ``cluster`` command; returns the process exit code."""
    directory = (args.dir or default_cluster_dir()).resolve()
    command = args.cluster_command
    if command == "up":
        return _up(directory, args.tier)
    if command == "down":
        return _down(directory)
    if command == "env":
        return _env(directory)
    raise ValueError(f"unknown cluster command {command!r}")


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalCluster.up, which stops everything


def _up(directory: Path, tier: Tier) -> int:
    already = running_cluster(directory)
    if already is not None:
        if already.tier != tier:
            _complain(
                f"a tier-{already.tier} cluster already runs in {directory}; "
                f"run `kvtopo cluster down --dir {directory}` first"
            )
            return 1
        _progress(f"tier-{tier} cluster already running in {directory}")
        _print_access(already)
        return 0
    cluster = LocalCluster(directory, tier, die_with_parent=False, progress=_progress)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        cluster.up()
    except KeyboardInterrupt:
        _complain("[cluster] interrupted: everything started was stopped")
        return 130
    except (
        BinariesMissingError,
        ControlPlaneProcessError,
        DeadlineExceededError,
        ClusterAlreadyRunningError,
        ImageBuildError,
        RealNodeError,
    ) as error:
        _complain(f"[cluster] failed: {error}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    _progress(
        f"tier-{tier} cluster ready in {cluster.ready_s} s; stop it with "
        f"`kvtopo cluster down --dir {directory}`"
    )
    _print_access(cluster.state())
    return 0


def _print_access(state: ClusterState) -> None:
    _say(f"kubeconfig: {state.kubeconfig}")
    _say(f"API server: {state.server_url}")
    _say(_export_line(state.kubeconfig))


def _down(directory: Path) -> int:
    if stop_cluster(directory, progress=_progress):
        _progress(f"stopped the cluster in {directory}")
    else:
        _progress(f"no cluster recorded in {directory}: nothing to stop")
    return 0


def _env(directory: Path) -> int:
    state = running_cluster(directory)
    if state is None:
        _complain(f"no running cluster in {directory}; start one with `kvtopo cluster up`")
        return 1
    _say(_export_line(state.kubeconfig))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtopo.cluster.cli up|down|env ...`` (the same as ``kvtopo cluster``)."""
    parser = argparse.ArgumentParser(prog="python -m kvtopo.cluster.cli")
    add_cluster_parser(parser.add_subparsers(dest="command", required=True))
    return run_cluster(parser.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
