"""pytest plugin: session-scoped local control planes for integration tests.

Owns the fixtures ``cluster_a`` (etcd + kube-apiserver), ``cluster_b`` (+ controller
manager, scheduler, kwok fake nodes) and ``cluster_c`` (+ one real node: containerd and a
kubelet running kvtopo's images; its ``host_before`` is the machine as it was before), each
a ready :class:`LocalCluster` with
``.kubeconfig``, ``.server_url`` and ``.kubectl(*args)``, started once per session on first
use and stopped at its end (also on Ctrl-C; a killed run's components follow it by
parent-death signal). Missing binaries FAIL the tests that need them, naming the fix
(``make toolchain``): ``make test`` builds them first, so a skip would only hide a broken
setup. Tests using a cluster get the ``cluster`` marker (``-m "not cluster"`` deselects
them), and a failing one gets the tails of the components' logs in its report.

Loaded by ``tests/conftest.py`` through ``pytest_plugins``.
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Iterator

import pytest

from kvtopo.cluster.binaries import BinariesMissingError
from kvtopo.cluster.deadlines import DeadlineExceededError
from kvtopo.cluster.images import ImageBuildError
from kvtopo.cluster.local_cluster import LocalCluster, Tier
from kvtopo.cluster.processes import ControlPlaneProcessError
from kvtopo.cluster.real_node import RealNodeError

CLUSTER_FIXTURES: dict[str, Tier] = {"cluster_a": "a", "cluster_b": "b", "cluster_c": "c"}


def _session_cluster(
    tmp_path_factory: pytest.TempPathFactory, tier: Tier
) -> Iterator[LocalCluster]:
    def progress(line: str) -> None:  # shown with -s, and in a failing test's report
        sys.stderr.write(f"[cluster {tier}] {line}\n")

    cluster = LocalCluster(tmp_path_factory.mktemp(f"cluster-{tier}"), tier, progress=progress)
    try:
        cluster.up()
    except (
        BinariesMissingError,
        ControlPlaneProcessError,
        DeadlineExceededError,
        ImageBuildError,
        RealNodeError,
    ) as error:
        pytest.fail(f"local control plane (tier {tier}) did not start: {error}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def cluster_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A ready tier-a cluster: etcd + kube-apiserver (no controllers: Pods stay as
    created, tests patch their status; no ServiceAccount admission)."""
    yield from _session_cluster(tmp_path_factory, "a")


@pytest.fixture(scope="session")
def cluster_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A ready tier-b cluster: + controller manager, scheduler and kwok fake nodes, so
    Deployments roll out (pods need :data:`kvtopo.cluster.fake_nodes.FAKE_NODE_PLACEMENT`)."""
    yield from _session_cluster(tmp_path_factory, "b")


@pytest.fixture(scope="session")
def cluster_c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A ready tier-c cluster: tier b + the real node ``kvtopo-node`` (root only), whose pods
    run the images in ``cluster.images``. Its teardown puts the machine back; a test may call
    ``down()`` itself to compare the machine with ``cluster.host_before``."""
    yield from _session_cluster(tmp_path_factory, "c")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        if any(name in fixturenames for name in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        funcargs = getattr(item, "funcargs", {})
        for name in CLUSTER_FIXTURES:
            cluster = funcargs.get(name)
            if isinstance(cluster, LocalCluster) and cluster.logs:
                report.sections.append((f"{name} component logs", cluster.log_tails()))
    return report
