"""The operator's own liveness, without a cluster.

- `Reconciler.stuck` names a loop whose round hangs (a Kubernetes client whose topology read
  blocks, the reconciler built through its real constructor), and the kopf probe on the
  liveness endpoint (`handlers.loops_probe`) then fails naming it; a loop whose rounds fail
  is not stuck, and a successful round is reported by its age.
- The request timeouts keep a loop from wedging: a reconciler with a real `KubeClient` whose
  API server accepts the connection and never answers ends its first round (failed) within
  the timeout instead of hanging in it.
- The relist rule (`handlers.LiveUids`): an indexed pod is dropped only when a list that
  started after it was indexed did not find its UID; `handlers.relist` drops, counts once,
  pokes, and keeps a pod indexed while it listed; `handlers._pod_source` hides what it
  dropped.
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
from kvtopo_operator.handlers import LiveUids
from kvtopo_operator.kube import ClusterApi, KubeClient
from kvtopo_operator.main import parse_args
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.reconcile import Reconciler, Settings
from kvtopo_operator.workers import WorkerClient

KEY = ("ns", "llama")
# kopf's decorators type what they register as kopf's callbacks; called here directly.
probe = cast(Callable[[], Awaitable[dict[str, Any]]], handlers.loops_probe)
index_pod = cast(Callable[..., dict[str, Any]], handlers.engine_pods)
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


async def until(what: str, probe: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Polls `probe` on the event loop until it is truthy; fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.01)


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


# --- the relist -----------------------------------------------------------------------------


def record(name: str, uid: str, indexed_at: float | None = None) -> dict[str, Any]:
    """An engine-pod index record, as `handlers.engine_pods` makes one from a pod."""
    pod: dict[str, Any] = {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid,
            "labels": {"kvtopo.dev/role": "prefill", "app": "llama"},
            "annotations": {},
        },
        "spec": {},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    meta: dict[str, Any] = pod["metadata"]
    (rec,) = index_pod(
        namespace="ns",
        name=name,
        uid=uid,
        labels=meta["labels"],
        annotations=meta["annotations"],
        meta=meta,
        spec=pod["spec"],
        status=pod["status"],
        body=pod,
    ).values()
    if indexed_at is not None:
        rec["indexed_at"] = indexed_at
    return cast(dict[str, Any], rec)


def test_a_pod_is_gone_only_when_a_list_that_started_after_it_was_indexed_lacks_it() -> None:
    live = LiveUids()
    old, new = record("old", "u-old", 10.0), record("new", "u-new", 20.0)
    assert not live.gone("ns", old), "no list has covered the namespace yet"

    live.observe("ns", 15.0, ["u-other"])
    assert live.gone("ns", old)  # indexed at 10, not in a list started at 15
    assert not live.gone("ns", new), "indexed after the list started: it may be newer"
    assert not live.gone("other-ns", old), "another namespace's list says nothing of it"
    assert not live.gone("ns", {"uid": "u-x", "name": "x"}), "no indexing time: kept"

    live.observe("ns", 25.0, ["u-old"])
    assert not live.gone("ns", old), "listed again"
    assert live.gone("ns", new)

    everywhere = LiveUids()
    everywhere.observe(None, 15.0, ["u-new"])  # a cluster-wide list covers every namespace
    assert everywhere.gone("ns", old) and everywhere.gone("other-ns", old)
    assert not everywhere.gone("ns", new)


def test_sweep_reports_each_gone_pod_once() -> None:
    live = LiveUids()
    index = {"ns": [record("a", "u-a", 1.0), record("b", "u-b", 1.0)], "ns2": []}
    live.observe("ns", 2.0, ["u-a"])
    assert live.sweep(index) == {"ns": ["b"]}
    assert live.sweep(index) == {}, "counted once"
    live.observe("ns", 3.0, [])
    assert live.sweep(index) == {"ns": ["a"]}


class Lister:
    """`list_pods` of a `ClusterApi`: answers `uids` by namespace; while it lists, it runs
    `during` once (what kopf may index meanwhile); `fail` namespaces raise."""

    def __init__(self, uids: dict[str | None, list[str]], fail: tuple[str, ...] = ()) -> None:
        self.uids = uids
        self.fail = fail
        self.during: Callable[[], None] = lambda: None
        self.calls: list[tuple[str | None, str, bool]] = []

    def list_pods(
        self, namespace: str | None, selector: str, *, metadata_only: bool = False
    ) -> list[dict[str, Any]]:
        self.calls.append((namespace, selector, metadata_only))
        during, self.during = self.during, lambda: None  # once
        during()
        if namespace in self.fail:
            raise TimeoutError("read timed out")
        return [{"metadata": {"uid": u}} for u in self.uids.get(namespace, [])]


class Pokes:
    def __init__(self) -> None:
        self.namespaces: list[str] = []

    def poke_namespace(self, namespace: str) -> None:
        self.namespaces.append(namespace)


@pytest.mark.asyncio
async def test_relist_drops_gone_pods_keeps_one_indexed_meanwhile_counts_and_pokes(
    state: dict[str, Any],
) -> None:
    index: dict[str, list[dict[str, Any]]] = {
        "ns": [record("alive", "u-alive"), record("gone", "u-gone")],
        "ns2": [record("elsewhere", "u-e")],
    }
    pokes = Pokes()
    state.update(engine_pods=index, reconciler=pokes, allow_endpoint_host=False)
    lister = Lister({"ns": ["u-alive"]}, fail=("ns2",))
    # A pod created while the list runs (and indexed then) is not in the list: kept.
    lister.during = lambda: index["ns"].append(record("born", "u-born"))
    metrics: OperatorMetrics = state["metrics"]

    def dropped_total() -> float | None:
        return metrics.registry.get_sample_value("kvtopo_operator_stale_pods_dropped_total")

    names = [p.name for p in handlers._pod_source("ns", 8975)]
    assert names == ["alive", "gone"], "before the relist the loops see the gone pod"

    dropped = await handlers.relist(cast(ClusterApi, lister), ["ns", "ns2"])
    assert dropped == {"ns": ["gone"]}
    assert lister.calls == [
        ("ns", "kvtopo.dev/role", True),
        ("ns2", "kvtopo.dev/role", True),
    ]
    assert [p.name for p in handlers._pod_source("ns", 8975)] == ["alive", "born"]
    # The namespace whose list failed keeps its pods.
    assert [p.name for p in handlers._pod_source("ns2", 8975)] == ["elsewhere"]
    assert pokes.namespaces == ["ns"]
    assert dropped_total() == 1.0
    assert metrics.registry.get_sample_value("kvtopo_operator_relist_failures_total") == 1.0

    # The next relist finds nothing new to drop: no count, no poke.
    lister.uids["ns"] = ["u-alive", "u-born"]
    assert await handlers.relist(cast(ClusterApi, lister), ["ns"]) == {}
    assert dropped_total() == 1.0 and pokes.namespaces == ["ns"]


# --- the command line -----------------------------------------------------------------------


def test_the_liveness_flags(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    base = ["--namespace", "ns", "--worker-token-file", str(token)]
    args = parse_args(base)
    assert args.relist_seconds == 60.0 and args.stuck_after_seconds is None
    args = parse_args([*base, "--relist-seconds", "0", "--stuck-after-seconds", "30"])
    assert args.relist_seconds == 0.0 and args.stuck_after_seconds == 30.0
    for bad in (["--relist-seconds", "-1"], ["--stuck-after-seconds", "0"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
