"""The operator's end-to-end environment (tier a, real workers): `Env` and its helpers.

Pods are created directly and marked Ready by patching their status (tier a has no kubelet);
each pod gets a loopback pod IP of its own, and a real worker process bound to that IP at
the control port, told its pod's identity. The operator runs as its own process so it can
be killed mid-way. The `env` fixture is in this folder's conftest.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtopo import launch
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from tests.cluster.kube import apply
from tests.e2e.harness import OperatorHarness, WorkerFactory
from tests.e2e.replicas import Replica
from tests.worker.workers import WorkerProcess, start_worker

GRACE = 2


@dataclass
class Env(OperatorHarness):
    token_file: Path
    replicas: list[Replica] = field(default_factory=list, kw_only=True)  # leader-elected
    others: list[subprocess.Popen[bytes]] = field(default_factory=list, kw_only=True)

    # --- workers and pods ------------------------------------------------------------------

    def worker(self, role: str, *extra: str) -> WorkerFactory:
        """Starts a worker of `role` for a pod (see `OperatorHarness.pod`)."""

        def make(identity: Sequence[str]) -> WorkerProcess:
            return start_worker(
                role,
                self.token_file,
                self.tmp,
                "--num-blocks",
                "32",
                "--block-bytes",
                "4096",
                "--registration-timeout",
                "3",
                "--transfer-timeout",
                "3",
                *extra,
                *identity,
            )

        return make

    def pod(  # type: ignore[override]
        self,
        name: str,
        role: manifests.Role,
        make: WorkerFactory,
        version: str = "v1",
        *,
        kv_gate: bool = False,
        node: str | None = None,
    ) -> WorkerProcess:
        return super().pod(name, role, make, kv_gate=kv_gate, node=node, version=version)

    def delete_pod(self, name: str) -> None:
        self.cluster.kubectl("delete", "pod", name, "-n", self.namespace, "--wait=true")

    def topology(self, name: str = "llama", **spec: Any) -> None:
        spec.setdefault("eviction", {"graceSeconds": GRACE})
        body = manifests.topology(
            name, app="llama", namespace=self.namespace, pair_on=("version",), **spec
        )
        apply(self.cluster, body)

    # --- the operator ----------------------------------------------------------------------

    def start_operator(self) -> None:  # type: ignore[override]
        args = launch.operator_args(
            self.namespace,
            self.cluster.kubeconfig,
            Credentials.beside(self.token_file).operator_key,
            1,
            "--watch-nodes",
        )
        super().start_operator(args, f"operator-{time.monotonic_ns()}.log")

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.send_signal(signal.SIGKILL)
        self.operator.wait(10)


def ready_status(st: dict[str, Any]) -> str:
    return next((c["status"] for c in st.get("conditions", []) if c["type"] == "Ready"), "")


def peers(w: WorkerProcess) -> set[str]:
    return {p["engine_id"] for p in w.state()["peers"]}
