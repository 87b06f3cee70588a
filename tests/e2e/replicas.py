"""Operator replicas under leader election, as separate processes: their /metrics and Lease.

Shared by the fail-static tests and the leader-election tests on the real API server.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtopo import launch
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.localkeys import Credentials
from kvtopo.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LEASE = "kvtopo-operator"


@dataclass
class Replica:
    identity: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics samples ({} while it does not serve)."""
        assert self.proc.poll() is None, f"{self.identity} exited:\n{log_tail(self.log, 40)}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def leading(self) -> float | None:
        return self.metrics().get("kvtopo_operator_leader")

    def reconciles(self) -> float:
        return self.metrics().get("kvtopo_operator_reconcile_seconds_count", 0.0)

    def rounds(self) -> float:
        """Every round this replica ran: full ones and quiet ones (nothing changed since a
        round with nothing to do, whose decision stands)."""
        m = self.metrics()
        return m.get("kvtopo_operator_reconcile_seconds_count", 0.0) + m.get(
            "kvtopo_operator_quiet_rounds_total", 0.0
        )

    def writes(self) -> float:
        """Every write this replica made to the API server or to a worker."""
        return sum(
            v for k, v in self.metrics().items() if k.startswith("kvtopo_operator_writes_total{")
        )

    def tail(self, lines: int = 40) -> str:
        return f"--- {self.identity} ---\n{log_tail(self.log, lines)}"


def start_replica(
    cluster: LocalCluster,
    namespace: str,
    tmp: Path,
    token_file: Path,
    identity: str,
    *,
    lease_s: int,
    renew_s: float,
    retry_s: float,
    resync_s: int = 1,
    clock_ahead_s: int = 0,
) -> Replica:
    """One `kvtopo-operator --leader-elect` replica of the namespace's topologies;
    `clock_ahead_s`: its wall clock that far ahead (`launch.clock_ahead_env`)."""
    port = free_port()
    args = launch.operator_args(
        namespace,
        cluster.kubeconfig,
        Credentials.beside(token_file).operator_key,
        resync_s,
        f"--metrics-port={port}",
        *launch.leader_election_args(
            identity, lease_s=lease_s, renew_s=renew_s, retry_s=retry_s, lease_name=LEASE
        ),
    )
    log = tmp / f"{identity}.log"
    env = launch.clock_ahead_env(clock_ahead_s) if clock_ahead_s else None
    proc = launch.start_operator(args, log, cwd=ROOT, append=True, env=env)
    return Replica(identity, port, log, proc)


def lease_holder(cluster: LocalCluster, namespace: str) -> str:
    """The Lease's holderIdentity ("" while there is no Lease or no holder)."""
    got = cluster.kubectl("get", "lease", LEASE, "-n", namespace, "-o", "json", check=False)
    if got.returncode != 0:
        return ""
    return str(json.loads(got.stdout)["spec"].get("holderIdentity", ""))
