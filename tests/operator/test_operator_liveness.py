"""The operator's own liveness, without a cluster.

- `Reconciler.stuck` names a loop whose round hangs (a Kubernetes client whose topology read
  blocks, the reconciler built through its real constructor), and the kopf probe on the
  liveness endpoint (`handlers.loops_probe`) then fails naming it; a loop whose rounds fail
  is not stuck, and a successful round is reported by its age.
- The request timeouts keep a loop from wedging: a reconciler with a real `KubeClient` whose
  API server accepts the connection and never answers ends its first round (failed) within
  the timeout instead of hanging in it.
- (The relist that drops pods whose deletion a watch missed: `test_podwatch.py` and
  `test_relist_cluster.py`.)
- The command line's --relist-seconds and --stuck-after-seconds.

Every wait polls real state with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import kopf
import pytest

from kvtopo_operator import handlers
from kvtopo_operator.kube import KubeClient
from kvtopo_operator.main import parse_args
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient
from tests.operator.polling import until

KEY = ("ns", "llama")
# kopf's decorators type what they register as kopf's callbacks; called here directly.
probe = cast(Callable[[], Awaitable[dict[str, Any]]], handlers.loops_probe)
SPEC = {
    "prefill": {"selector": {"matchLabels": {"kvtopo.dev/role": "prefill"}}},
    "decode": {"selector": {"matchLabels": {"kvtopo.dev/role": "decode"}}},
}
BODY = {
    "apiVersion": "kvtopo.dev/v1alpha1",
    "kind": "KVTopology",
    "metadata": {
        "name": "llama",
        "namespace": "ns",
        "uid": "t1",
        "generation": 1,
        "resourceVersion": "5",
        "creationTimestamp": "2026-01-01T00:00:00Z",
    },
    "spec": SPEC,
}


class GatedKube:
    """`get_topology` blocks until `gate` is set, then answers `answer` (raised when it is
    an exception); the writes succeed."""

    def __init__(self) -> None:
        self.reads = 0
        self.gate = asyncio.Event()
        self.answer: Any = None

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        await self.gate.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return cast(dict[str, Any] | None, self.answer)

    async def patch_status(self, *_: Any) -> bool:
        return True

    async def record_event(self, *_: Any) -> None:
        return None

    async def patch_pod_condition(self, *_: Any) -> bool:
        return True


class Workers:
    async def state(self, *_: Any, **__: Any) -> Any:
        raise AssertionError("no worker is read in these tests")

    async def close(self) -> None:
        return None


def reconciler(kube: Any, resync_s: float = 0.05) -> Reconciler:
    return Reconciler(
        kube=cast(KubeClient, kube),
        workers=cast(WorkerClient, Workers()),
        pods=lambda namespace, port: [],
        metrics=OperatorMetrics(),
        settings=Settings(resync_s=resync_s),
    )


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    s: dict[str, Any] = {"metrics": OperatorMetrics(), "leading": True, "known": {}}
    monkeypatch.setattr(handlers, "_state", s)
    return s


# --- per-loop liveness ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_loop_whose_round_hangs_is_stuck_and_fails_the_probe(
    state: dict[str, Any],
) -> None:
    kube = GatedKube()
    r = reconciler(kube)
    state.update(reconciler=r, stuck_after_s=3600.0)
    try:
        assert await probe() == {"leading": True, "since_success_s": {}}
        r.ensure(KEY, 1)
        await until("the first round to read its topology", lambda: kube.reads == 1)
        # In its round, and not for long yet: alive, never succeeded.
        assert r.stuck(3600) == []
        assert await probe() == {
            "leading": True,
            "since_success_s": {"ns/llama": None},
        }

        # The read hangs: the loop is stuck once the bound passes, and the probe fails.
        state["stuck_after_s"] = 0.3
        await until("the loop to be stuck", lambda: r.stuck(0.3) == [KEY])
        with pytest.raises(kopf.PermanentError, match=r"1 topology loops .* 0\.3s: ns/llama"):
            await probe()

        # The read fails at last: the round ended, so the loop is not stuck, only failing.
        kube.answer = RuntimeError("the API server is down")
        kube.gate.set()
        loop = r._loops[KEY]
        await until("the round to fail", lambda: loop.failed_rounds == 1)
        assert r.stuck(0.3) == []
        assert r.since_success() == {KEY: None}

        # The next round (after its backoff) succeeds: reported by its age.
        state["stuck_after_s"] = 3600.0
        kube.answer = BODY
        await until("a successful round", lambda: r.since_success()[KEY] is not None)
        result = await probe()
        assert result["leading"] is True
        assert 0 <= result["since_success_s"]["ns/llama"] < 60
    finally:
        await r.stop()
    # No loop runs (a standby, or stopped): nothing is stuck.
    assert r.stuck(0) == [] and r.since_success() == {}
    assert (await probe())["since_success_s"] == {}


@pytest.fixture
def black_hole_kubeconfig(tmp_path: Path) -> Iterator[str]:
    """A kubeconfig whose API server accepts connections (the kernel's listen backlog) and
    never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        path = tmp_path / "kubeconfig"
        cluster = {"server": f"http://127.0.0.1:{s.getsockname()[1]}"}
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "hole", "cluster": cluster}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "hole", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        yield str(path)


@pytest.mark.asyncio
async def test_request_timeouts_end_a_round_against_an_api_server_that_never_answers(
    black_hole_kubeconfig: str,
) -> None:
    timeout_s = 0.2
    r = reconciler(KubeClient(black_hole_kubeconfig, timeout_s=timeout_s), resync_s=60)
    try:
        r.ensure(KEY, 1)
        loop = r._loops[KEY]
        # The read is tried 4 times at most (the client's retries), each within the timeout.
        began = time.monotonic()
        await until("the round to fail on the timeout", lambda: loop.failed_rounds >= 1, 20)
        assert time.monotonic() - began < 4 * timeout_s + 3
        assert r.stuck(10) == []
    finally:
        await r.stop()


# --- the command line -----------------------------------------------------------------------


def test_the_liveness_flags(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    base = ["--namespace", "ns", "--worker-key-file", str(token)]
    args = parse_args(base)
    assert args.relist_seconds == 60.0 and args.stuck_after_seconds is None
    args = parse_args([*base, "--relist-seconds", "0", "--stuck-after-seconds", "30"])
    assert args.relist_seconds == 0.0 and args.stuck_after_seconds == 30.0
    for bad in (["--relist-seconds", "-1"], ["--stuck-after-seconds", "0"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
