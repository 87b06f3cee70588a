"""Every Kubernetes API call the operator makes gives up: against an API server that accepts
the TCP connection and never answers (a listening socket on 127.0.0.1 that nobody reads: the
kernel completes the handshake, no byte ever comes back), each call of `KubeClient` and
`ClusterApi`, built through their real constructors with a small timeout, fails within its
bound instead of hanging.

A write (PATCH, POST) is tried once, so it fails within one timeout; the client retries an
idempotent read (GET) after a failed read at most 3 times, so a read fails within 4
(`kube.REQUEST_TIMEOUT_S`). Each call runs in a thread with a hard deadline far above that
bound, so a call that hangs fails the test instead of wedging it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import REQUEST_TIMEOUT_S, ClusterApi, KubeClient

TIMEOUT_S = 0.4
HARD_DEADLINE_S = 20.0  # what "hangs" means here: far above every bound below
SLACK_S = 1.5  # a loaded 2-core machine


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections (in the listen backlog) and never
    answers; closed after the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@pytest.fixture
def kubeconfig(black_hole: int, tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "hole", "cluster": {"server": f"http://127.0.0.1:{black_hole}"}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "hole", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


def timed(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    """Runs `call` in a thread; (seconds it took, what it raised). Fails the test when it
    has not returned by the hard deadline."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    started = time.monotonic()
    future = pool.submit(call)
    try:
        future.result(HARD_DEADLINE_S)
        error: BaseException | None = None
    except concurrent.futures.TimeoutError:
        pytest.fail(f"the call still hangs after {HARD_DEADLINE_S}s")
    except Exception as exc:
        error = exc
    finally:
        pool.shutdown(wait=False)
    return time.monotonic() - started, error


TOPOLOGY = {
    "metadata": {"name": "llama", "namespace": "ns", "uid": "u1", "resourceVersion": "7"},
}

# (name, how many attempts the client makes, the call)
KUBE_CALLS: list[tuple[str, int, Callable[[KubeClient], Any]]] = [
    ("get_topology", 4, lambda k: asyncio.run(k.get_topology("ns", "llama"))),
    ("patch_status", 1, lambda k: asyncio.run(k.patch_status("ns", "llama", {}, "7"))),
    (
        "record_event",
        1,
        lambda k: asyncio.run(k.record_event(TOPOLOGY, "Normal", "Test", "a message")),
    ),
]
API_CALLS: list[tuple[str, int, Callable[[ClusterApi], Any]]] = [
    ("read_topology", 4, lambda a: a.read_topology("ns", "llama")),
    ("list_topology_uids", 4, lambda a: a.list_topology_uids("ns")),
    ("list_pods", 4, lambda a: a.list_pods("ns", "kvtopo.dev/role")),
    ("list_pods all namespaces", 4, lambda a: a.list_pods(None, "kvtopo.dev/role")),
    ("list_pods metadata", 4, lambda a: a.list_pods("ns", "x", metadata_only=True)),
    ("crd_established", 4, lambda a: a.crd_established("kvtopologies.kvtopo.dev")),
    ("create_namespace", 1, lambda a: a.create_namespace("ns")),
    ("create_topology", 1, lambda a: a.create_topology("ns", {"metadata": {"name": "x"}})),
    ("annotate_pod", 1, lambda a: a.annotate_pod("ns", "p", {"a": "b"})),
    ("apply_crd", 1, lambda a: a.apply_crd(crd_manifest())),
]


@pytest.mark.parametrize(("name", "attempts", "call"), KUBE_CALLS, ids=[c[0] for c in KUBE_CALLS])
def test_kube_client_calls_fail_within_their_timeout(
    kubeconfig: str, name: str, attempts: int, call: Callable[[KubeClient], Any]
) -> None:
    kube = KubeClient(kubeconfig, timeout_s=TIMEOUT_S)
    assert kube.request_timeout == (TIMEOUT_S, TIMEOUT_S)
    took, error = timed(lambda: call(kube))
    assert error is not None, f"{name} returned against a server that never answers"
    assert "timed out" in repr(error).lower() or "timeout" in repr(error).lower(), repr(error)
    assert took <= attempts * TIMEOUT_S + SLACK_S, f"{name} took {took:.2f}s"


@pytest.mark.parametrize(("name", "attempts", "call"), API_CALLS, ids=[c[0] for c in API_CALLS])
def test_cluster_api_calls_fail_within_their_timeout(
    kubeconfig: str, name: str, attempts: int, call: Callable[[ClusterApi], Any]
) -> None:
    api = ClusterApi(kubeconfig, timeout_s=TIMEOUT_S)
    took, error = timed(lambda: call(api))
    assert error is not None, f"{name} returned against a server that never answers"
    assert "timed out" in repr(error).lower() or "timeout" in repr(error).lower(), repr(error)
    assert took <= attempts * TIMEOUT_S + SLACK_S, f"{name} took {took:.2f}s"


def test_the_default_timeout_is_bounded() -> None:
    # Within the liveness bound (`main`: at least 120 s) even for a read retried 3 times.
    assert 0 < 4 * REQUEST_TIMEOUT_S < 120
