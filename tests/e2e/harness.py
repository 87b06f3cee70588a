"""The operator under test on a real API server: its process, its log, its topology's status.

Shared by the operator end-to-end tests and the chart's RBAC end-to-end test: both run the
operator as its own process (so it can be killed), pair real workers with engine pods, and
wait on the KVTopology's real status, printing the status and the operator's log when a wait
runs out.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtopo import launch
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.drill import manifests
from tests.cluster.kube import (
    create_engine_pod,
    get_json,
    identity_args,
    loopback_pod_ip,
    mark_pod_ready,
)
from tests.worker.workers import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "llama"

T = TypeVar("T")
WorkerFactory = Callable[[Sequence[str]], WorkerProcess]
"""Starts a pod's worker, given the arguments that bind it to the pod (`identity_args`)."""


@dataclass
class OperatorHarness:
    cluster: LocalCluster
    namespace: str
    tmp: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict, kw_only=True)
    operator: subprocess.Popen[bytes] | None = field(default=None, kw_only=True)
    operator_log: Path | None = field(default=None, kw_only=True)
    identities: dict[str, list[str]] = field(default_factory=dict, kw_only=True)

    def start_operator(self, args: list[str], log_name: str = "operator.log") -> None:
        self.operator_log = self.tmp / log_name
        self.operator = launch.start_operator(args, self.operator_log, cwd=ROOT)

    def operator_tail(self, lines: int = 40) -> str:
        return "" if self.operator_log is None else log_tail(self.operator_log, lines)

    def pod(
        self,
        name: str,
        role: manifests.Role,
        make: WorkerFactory,
        *,
        kv_gate: bool = False,
        node: str | None = None,
        **labels: str,
    ) -> WorkerProcess:
        """A Ready engine pod with a loopback pod IP of its own, served by the worker that
        `make` starts there (given the pod IP to bind and the pod's identity, as the downward
        API gives them); the pod is marked Ready once its worker serves (its containers
        ready only, when it lists the kv-connected readiness gate: `kv_gate`)."""
        ip = loopback_pod_ip()
        uid = create_engine_pod(
            self.cluster, self.namespace, name, role, labels or None, kv_gate=kv_gate, node=node
        )
        self.identities[name] = identity_args(self.namespace, name, uid, ip)
        w = make(self.identities[name])
        self.workers[name] = w
        mark_pod_ready(self.cluster, self.namespace, name, [ip], kv_gate=kv_gate)
        return w

    def restart(self, name: str, make: WorkerFactory) -> tuple[WorkerProcess, WorkerProcess]:
        """The engine of pod `name` restarts in place (same pod, IP and identity; a new
        process): the old worker is killed, `make` starts the new one. (old, new)."""
        old = self.workers[name]
        old.proc.kill()
        old.proc.wait(10)
        new = make(self.identities[name])
        self.workers[name] = new
        return old, new

    def status(self, name: str = TOPOLOGY) -> dict[str, Any]:
        obj = get_json(self.cluster, "kvt", name, "-n", self.namespace)
        return obj.get("status") or {}  # type: ignore[no-any-return]

    def wait(
        self, what: str, probe: Callable[[], T], timeout: float = 30, interval_s: float = 0.1
    ) -> T:
        """Polls `probe` until it returns something true; on timeout the error carries the
        topology's status and the operator's log."""
        return wait_until(
            probe,
            timeout,
            what,
            interval_s=interval_s,
            describe_last=lambda: (
                self._described() + "\n--- operator log ---\n" + self.operator_tail()
            ),
        )

    def _described(self) -> str:
        """Every topology's status of the namespace (for a wait that ran out)."""
        try:
            got = get_json(self.cluster, "kvt", "-n", self.namespace)
        except Exception as exc:  # the wait's own failure is what matters
            return f"(the topologies could not be read: {exc})"
        return "\n".join(
            f"--- {t['metadata']['name']} ---\n"
            + json.dumps(t.get("status") or {}, indent=1)[-3000:]
            for t in got.get("items") or []
        )
