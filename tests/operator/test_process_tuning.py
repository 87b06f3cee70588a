"""The operator process's interpreter settings (`kvtopo_operator.main`): the garbage
collector's thresholds and the objects left out of its passes, checked in a fresh
interpreter (the test process keeps its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import gc, json
from kvtopo_operator.main import GC_THRESHOLDS, tune_gc
import kopf  # as `main` does before it tunes: the handlers and kopf imported
from kvtopo_operator import handlers
before = gc.get_threshold()
tune_gc()
print(json.dumps({
    "before": before,
    "after": gc.get_threshold(),
    "wanted": GC_THRESHOLDS,
    "frozen": gc.get_freeze_count(),
}))
"""


def test_the_operator_collects_garbage_rarely_and_never_walks_what_it_imported() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert tuple(got["before"]) == (700, 10, 10), "a fresh interpreter starts at CPython's default"
    assert tuple(got["after"]) == tuple(got["wanted"])
    # A young collection every tens of thousands of containers, not every 700.
    assert got["after"][0] >= 10_000
    # The operator's modules, classes and functions (kopf, pydantic, its own) are frozen.
    assert got["frozen"] > 40_000
