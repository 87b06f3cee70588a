"""The chart's part in the operator's own liveness: the periodic relist and the stuck-loop
bound reach the operator's command line (as `kvtopo-operator` parses it), and the liveness
probe hits kopf's liveness endpoint, where the operator's loops probe runs."""

from __future__ import annotations

from typing import Any

import pytest

from kvtopo_operator.main import parse_args
from tests.helm.chart import FULL_VALUES, Helm, container, render

# These run the helm binary from the control-plane toolchain (`make toolchain`).
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm-home"))


@pytest.mark.parametrize(
    ("values", "relist_s", "stuck_after_s"),
    [
        ({}, 60.0, None),  # the operator's default bound: max(120, 10 x resync)
        ({"operator": {"relistSeconds": 0, "stuckAfterSeconds": 45}}, 0.0, 45.0),
    ],
    ids=["default", "set"],
)
def test_the_relist_and_the_stuck_bound_reach_the_operator(
    helm: Helm, values: dict[str, Any], relist_s: float, stuck_after_s: float | None
) -> None:
    c = container(render(helm, values))
    args = parse_args(c["args"])
    assert args.relist_seconds == relist_s
    assert args.stuck_after_seconds == stuck_after_s
    liveness = next(a for a in c["args"] if a.startswith("--liveness="))
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "health")
    assert liveness == f"--liveness=http://0.0.0.0:{port}/healthz"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_the_full_values_set_both(helm: Helm) -> None:
    args = parse_args(container(render(helm, None, FULL_VALUES))["args"])
    assert (args.relist_seconds, args.stuck_after_seconds) == (30.0, 300.0)
