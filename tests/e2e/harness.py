"""The operator under test on a real API server: its process, its log, its topology's status.

Shared by the operator end-to-end tests and the chart's RBAC end-to-end test: both run the
operator as its own process (so it can be killed), pair real workers with engine pods, and
wait on the KVTopology's real status, printing the status and the operator's log when a wait
runs out.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtopo import launch
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.drill import manifests
from tests.cluster.kube import get_json, ready_engine_pod
from tests.worker.workers import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = "llama"

T = TypeVar("T")


@dataclass
class OperatorHarness:
    cluster: LocalCluster
    namespace: str
    tmp: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict, kw_only=True)
    operator: subprocess.Popen[bytes] | None = field(default=None, kw_only=True)
    operator_log: Path | None = field(default=None, kw_only=True)

    def start_operator(self, args: list[str], log_name: str = "operator.log") -> None:
        self.operator_log = self.tmp / log_name
        self.operator = launch.start_operator(args, self.operator_log, cwd=ROOT)

    def operator_tail(self, lines: int = 40) -> str:
        return "" if self.operator_log is None else log_tail(self.operator_log, lines)

    def pod(self, name: str, role: manifests.Role, w: WorkerProcess, **labels: str) -> None:
        """A Ready engine pod whose endpoint annotation names worker `w`."""
        self.workers[name] = w
        ready_engine_pod(self.cluster, self.namespace, name, role, w.endpoint, labels or None)

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
                json.dumps(self.status(), indent=1)[-3000:]
                + "\n--- operator log ---\n"
                + self.operator_tail()
            ),
        )
