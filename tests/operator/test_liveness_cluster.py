"""The operator's liveness endpoint on a real API server (tier a): `kvtopo-operator
--liveness` serves kopf's /healthz, which reports each topology loop's seconds since its last
successful round, and turns to HTTP 500, naming the loop, once a round has not ended for
--stuck-after-seconds.

An engine pod whose "worker" accepts connections at its pod IP and control port and never
answers no longer holds a round (it waited out the spec's handshake timeout, 30 s, far past
the 3 s bound, on 9cfedae): the endpoint stays healthy past the bound plus kopf's 10 s cache
of a healthy answer. A round held for real failing the endpoint is
`test_operator_liveness.py`'s. Every wait polls the endpoint with a deadline.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtopo import launch
from kvtopo.cluster.deadlines import DeadlineExceededError, wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from kvtopo.ports import free_port
from tests.cluster.kube import (
    CONTROL_PORT,
    apply,
    create_engine_pod,
    create_namespace,
    loopback_pod_ip,
    mark_pod_ready,
)

ROOT = Path(__file__).resolve().parents[2]
STUCK_AFTER_S = 3


def healthz(port: int) -> tuple[int, Any]:
    """(HTTP status, body: JSON when it is JSON); (0, reason) while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


@pytest.fixture
def ns(cluster_a: LocalCluster) -> Iterator[str]:
    cluster_a.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    cluster_a.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    name = create_namespace(cluster_a, "kvt-live", wait_for_sa=False)
    yield name
    cluster_a.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_the_liveness_endpoint_fails_while_a_loop_is_stuck(
    cluster_a: LocalCluster, ns: str, tmp_path: Path
) -> None:
    apply(
        cluster_a,
        manifests.topology("llama", app="llama", namespace=ns, handshake={"timeoutSeconds": 30}),
    )
    token = Credentials.beside(tmp_path / "token").operator_key
    port = free_port()
    args = launch.operator_args(
        ns,
        cluster_a.kubeconfig,
        token,
        1,
        f"--liveness=http://127.0.0.1:{port}/healthz",
        f"--stuck-after-seconds={STUCK_AFTER_S}",
    )
    log = tmp_path / "operator.log"
    proc = launch.start_operator(args, log, cwd=ROOT)
    hole = socket.socket()
    try:

        def answer() -> tuple[int, Any]:
            assert proc.poll() is None, f"the operator exited:\n{log_tail(log, 40)}"
            return healthz(port)

        def tail() -> str:
            return log_tail(log, 40)

        def healthy() -> tuple[int, Any] | None:
            status, body = answer()
            ok = status == 200 and body["loops"]["since_success_s"].get(f"{ns}/llama") is not None
            return (status, body) if ok else None

        def failing() -> tuple[int, Any] | None:
            status, body = answer()
            return (status, body) if status not in (0, 200) else None

        # Healthy: the loop of llama has run a successful round (no engines yet).
        got = wait_until(healthy, 60, "a healthy answer with llama's loop", describe_last=tail)
        assert got is not None
        status, body = got
        assert body["loops"]["leading"] is True
        assert 0 <= body["loops"]["since_success_s"][f"{ns}/llama"] < 30

        # An engine whose worker never answers (its read's deadline is 30 s). On 9cfedae the
        # next round waited it out and the endpoint failed; now a round waits at most half a
        # second for one worker, so the loop goes on ending rounds and the endpoint stays
        # healthy past the bound (plus kopf's 10 s cache). (A round held for real still
        # fails it: `test_operator_liveness.py`.)
        ip = loopback_pod_ip()
        hole.bind((ip, CONTROL_PORT))
        hole.listen(16)
        create_engine_pod(cluster_a, ns, "p0", "prefill")
        mark_pod_ready(cluster_a, ns, "p0", [ip])
        with pytest.raises(DeadlineExceededError):
            wait_until(failing, STUCK_AFTER_S + 15, "the liveness endpoint to fail")
        status, body = answer()
        assert status == 200, (status, body)
        assert body["loops"]["since_success_s"][f"{ns}/llama"] < STUCK_AFTER_S + 11, body
        text = log.read_text(errors="replace")
        assert "topology loops have not ended a round" not in text, tail()
    finally:
        hole.close()
        launch.stop_process(proc, 10)
