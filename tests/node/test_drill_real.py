"""`kvtopo drill --node real`: the drill's invariants on real pods of the real node.

The chart's two operator replicas, one prefill and two decode engines of the worker image,
two decode rollouts under a steady request stream, every request verified end to end. Runs
on the session's tier-c cluster (one real node per machine) and leaves it as it found it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rich.console import Console

from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill.ledger import invariants_hold, targets
from kvtopo.drill.report import render_table
from kvtopo.drill.run import Drill, DrillOptions

pytestmark = pytest.mark.node


# The first test of the session on the real node also starts it (cluster_c): after a source
# change that imports the new images into containerd, 136 s on a clean clone; the drill
# itself has its own deadline (timeout_s) and the namespace's deletion 180 s.
@pytest.mark.timeout(1200)
def test_the_drill_on_real_pods_loses_nothing(cluster_c: LocalCluster, tmp_path: Path) -> None:
    opts = DrillOptions(
        prefill=1,
        decode=2,
        rollouts=2,
        scale_to=2,
        rate=10.0,
        node="real",
        cluster=cluster_c,
        workdir=tmp_path / "drill",
        live=False,
        timeout_s=900.0,
    )
    drill = Drill(opts, say=print)
    try:
        report = asyncio.run(drill.run())
    finally:
        # The session's cluster stays up for the other tests: the drill's release goes.
        cluster_c.kubectl("delete", "namespace", drill.namespace, "--wait=true", timeout=180)
    report["grace"], report["tp"], report["node"] = opts.grace, opts.tp, opts.node
    report["rollouts_target"], report["requests_target"] = opts.rollouts, 300
    report["targets"] = targets(report)
    Console(width=120).print(render_table(report))  # the table the note quotes (-s)
    assert invariants_hold(report), report["offending_requests"]
    assert report["rollouts"] == 2
    assert report["completed"] >= 100
    assert report["lost"] == 0 and report["failed_by_reason"] == {}
