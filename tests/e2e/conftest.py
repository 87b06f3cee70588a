"""The `env` fixture of the operator's end-to-end tests (see `tests.e2e.env`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtopo import launch
from kvtopo.cluster.local_cluster import LocalCluster
from tests.cluster.kube import create_namespace
from tests.e2e.env import Env
from tests.e2e.harness import ROOT
from tests.worker.workers import stop_operator_and_workers


@pytest.fixture
def env(cluster_a: LocalCluster, tmp_path: Path) -> Iterator[Env]:
    cluster_a.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    cluster_a.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    token = tmp_path / "token"
    token.write_text("e2e-token\n")
    e = Env(cluster_a, create_namespace(cluster_a, "kvt-e2e", wait_for_sa=False), tmp_path, token)
    try:
        yield e
    finally:
        for replica in e.replicas:
            launch.stop_process(replica.proc, 10)
        for proc in e.others:
            launch.stop_process(proc, 5)
        stop_operator_and_workers(e.operator, 10, e.workers.values())
