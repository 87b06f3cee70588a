"""The engine-pod watch (`podwatch`), without a cluster: the real `PodWatch` and `PodStore`
with an injected API (pages and watch lines as the API server sends them).

- A pod is decoded from the API server's JSON with only what the operator reads (unknown
  fields ignored); ContainersReady wins over Ready; the gate, the IPs, the annotation.
- The store pokes only on changes the operator reads; a list replaces its scope and names
  the pods it dropped; a namespace not listed yet is refused, not answered empty.
- The watch lists (paged), follows ADDED/MODIFIED/DELETED, skips and counts a malformed line,
  lists afresh after "410 Gone" (dropping and reporting pods deleted in the gap) and every
  `relist_s`, and retries a failed list.

Every wait polls real state with a deadline.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvtopo_operator import handlers
from kvtopo_operator.metrics import OperatorMetrics
from kvtopo_operator.podwatch import (
    EnginePod,
    NotListedYet,
    PodStore,
    PodWatch,
    decode_pod,
)
from tests.operator.polling import until


def pod_json(
    name: str,
    uid: str | None = None,
    *,
    namespace: str = "ns",
    role: str = "decode",
    rv: str = "1",
    ready: bool = False,
    ip: str = "10.0.0.1",
    **extra_meta: Any,
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"u-{name}",
            "resourceVersion": rv,
            "labels": {"kvtopo.dev/role": role, "app": "llama"},
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:x": {}}}],
            **extra_meta,
        },
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
        "status": {
            "podIP": ip,
            "conditions": [
                {
                    "type": "ContainersReady",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        },
    }


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


# --- decoding and the store -----------------------------------------------------------------


def test_a_pod_is_decoded_with_what_the_operator_reads_and_nothing_else() -> None:
    body = pod_json("d0", ready=True, annotations={"kvtopo.dev/control-endpoint": ":8976"})
    body["status"]["conditions"].append(
        {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"}
    )
    body["status"]["conditions"].append({"type": "kvtopo.dev/kv-connected", "status": "False"})
    body["status"]["podIPs"] = [{"ip": "10.0.0.9"}, {"ip": "fd00::9"}]
    body["spec"]["readinessGates"] = [{"conditionType": "kvtopo.dev/kv-connected"}]
    body["status"]["somethingNew"] = {"from": "a newer API server"}
    pod = decode_pod(json.dumps(body).encode())
    assert pod == EnginePod(
        namespace="ns",
        name="d0",
        uid="u-d0",
        role="decode",
        labels={"kvtopo.dev/role": "decode", "app": "llama"},
        ready=True,  # ContainersReady: Ready waits for the gate
        ready_since=1767225600.0,
        deleting=False,
        pod_ips=("10.0.0.9", "fd00::9"),
        endpoint=":8976",
        gated=True,
        gate="False",
    )
    # Ready where a pod has no ContainersReady; podIP where it has no podIPs.
    body = pod_json("p0", role="prefill", deletionTimestamp="2026-01-01T00:00:01Z")
    body["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.ready_since, pod.pod_ips, pod.deleting) == (
        True,
        None,
        ("10.0.0.1",),
        True,
    )
    huge = pod_json("h", annotations={"kvtopo.dev/control-endpoint": "x" * 5000})
    assert len(decode_pod(json.dumps(huge).encode()).endpoint) == 256


def test_a_pod_its_nodes_lifecycle_marked_not_ready_is_lost_not_up() -> None:
    """The node lifecycle controller sets a pod's Ready False when its node goes NotReady
    or unreachable, keeping the reason of the Ready True it was; ContainersReady (the
    kubelet's, now silent) stays True. The kubelet itself always gives Ready False a reason
    (ReadinessGatesNotReady while the gate waits, ContainersNotReady). So Ready False with
    ready containers and none of the kubelet's reasons is that mark: the engine is not up,
    and lost since Ready's flip, whatever the gate says (the operator turns it False)."""
    body = pod_json("d0", ready=True)
    body["spec"]["readinessGates"] = [{"conditionType": "kvtopo.dev/kv-connected"}]
    conds = body["status"]["conditions"]
    conds.append({"type": "kvtopo.dev/kv-connected", "status": "True"})
    conds.append({"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"})
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.lost_since) == (True, None)
    conds[-1] = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:01:00Z"}
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.lost_since) == (False, 1767225660.0)
    conds[1] = {"type": "kvtopo.dev/kv-connected", "status": "False"}  # the operator's doing
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.lost_since) == (False, 1767225660.0), "it stays lost"
    # The kubelet's own not-Ready: waiting for the gate, or a container not ready.
    conds[-1] = {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"}
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.lost_since) == (True, None)
    conds[0] = {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"}
    conds[-1] = {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}
    pod = decode_pod(json.dumps(body).encode())
    assert (pod.ready, pod.lost_since) == (False, None)


def test_the_store_reports_only_changes_the_operator_reads() -> None:
    store = PodStore()
    with pytest.raises(NotListedYet):
        store.pods("ns")
    changed, dropped = store.replace("ns", [decode_pod(json.dumps(pod_json("a")).encode())])
    assert (changed, dropped) == ({"ns"}, [])
    assert [p.name for p in store.pods("ns")] == ["a"]
    with pytest.raises(NotListedYet):
        store.pods("other")
    # A new resourceVersion alone (a kubelet heartbeat) changes nothing read here.
    assert not store.upsert(decode_pod(json.dumps(pod_json("a", rv="2")).encode()))
    assert store.upsert(decode_pod(json.dumps(pod_json("a", rv="3", ready=True)).encode()))
    assert store.remove("ns", "u-a") and not store.remove("ns", "u-a")
    # A cluster-wide list covers every namespace.
    store.upsert(decode_pod(json.dumps(pod_json("b", namespace="x")).encode()))
    changed, dropped = store.replace(None, [decode_pod(json.dumps(pod_json("c")).encode())])
    assert changed == {"ns", "x"} and [p.name for p in dropped] == ["b"]
    assert store.pods("other") == [] and store.namespaces() == ["ns"]


# --- the watch ------------------------------------------------------------------------------


class Api:
    """The watch's API calls: lists answer `pods` (namespace "ns"), in pages of `PAGE`; each
    watch request serves the lines the test puts on `lines` (None ends that request).
    `fail_lists` makes that many lists raise first."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 10
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.fail_lists = 0
        self.list_calls: list[tuple[str | None, str]] = []
        self.watches: list[tuple[str, int]] = []
        self.closed = threading.Event()

    def list_pods_raw(
        self, namespace: str | None, selector: str, *, limit: int, cont: str
    ) -> bytes:
        assert selector == "kvtopo.dev/role"
        self.list_calls.append((namespace, cont))
        if self.fail_lists:
            self.fail_lists -= 1
            raise TimeoutError("read timed out")
        names = sorted(self.pods)
        start = int(cont or 0)
        page = names[start : start + limit]
        more = start + limit < len(names)
        return json.dumps(
            {
                "kind": "PodList",
                "metadata": {
                    "resourceVersion": str(self.rv),
                    "continue": str(start + limit) if more else "",
                },
                "items": [self.pods[n] for n in page],
            }
        ).encode()

    def watch_pods_raw(
        self, namespace: str | None, selector: str, *, resource_version: str, timeout_s: int
    ) -> Iterator[bytes]:
        self.watches.append((resource_version, timeout_s))
        while not self.closed.is_set():
            try:
                item = self.lines.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item


class Watched:
    """A real PodWatch over `Api`, with its callbacks recorded."""

    def __init__(self, api: Api, **kwargs: Any) -> None:
        self.store = PodStore()
        self.pokes: list[str] = []
        self.dropped: list[str] = []
        self.failures: list[str] = []
        self.malformed = 0

        def count_malformed() -> None:
            self.malformed += 1

        self.watch = PodWatch(
            api,
            ["ns"],
            self.store,
            on_change=self.pokes.append,
            dropped=lambda pods: self.dropped.extend(p.name for p in pods),
            failed=lambda scope, exc: self.failures.append(str(exc)),
            malformed=count_malformed,
            backoff_s=0.01,
            **kwargs,
        )

    def names(self) -> list[str]:
        return sorted(p.name for p in self.store.pods("ns")) if self.store.listed("ns") else []


@pytest.fixture
def api() -> Iterator[Api]:
    api = Api()
    yield api
    api.closed.set()


@pytest.mark.asyncio
async def test_the_watch_lists_in_pages_then_follows_events_and_skips_a_malformed_line(
    api: Api,
) -> None:
    PodWatch.PAGE, page = 2, PodWatch.PAGE
    try:
        for n in ("a", "b", "c"):
            api.pods[n] = pod_json(n)
        w = Watched(api)
        w.watch.start()
        assert await w.watch.wait_listed(10)
        assert w.names() == ["a", "b", "c"] and api.list_calls == [("ns", ""), ("ns", "2")]
        assert w.pokes == ["ns"]
        await until("the watch to start from the list's version", lambda: api.watches)
        assert api.watches[0][0] == "10"

        api.lines.put(line("ADDED", pod_json("d", rv="11")))
        api.lines.put(b'{"type": "MODIFIED", "object": {"metadata": {"name": 7}}}')
        api.lines.put(b"not json at all")
        api.lines.put(line("MODIFIED", pod_json("a", rv="12", ready=True)))
        api.lines.put(line("DELETED", pod_json("b", rv="13")))
        await until("the events", lambda: w.names() == ["a", "c", "d"])
        await until("a ready", lambda: next(p for p in w.store.pods("ns") if p.name == "a").ready)
        assert w.malformed == 2 and w.dropped == [] and w.failures == []
        n = len(w.pokes)
        api.lines.put(line("MODIFIED", pod_json("c", rv="14")))  # nothing read here changed
        api.lines.put(line("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "20"}}))
        api.lines.put(None)  # the server ends the request: the next resumes where it stopped
        await until("the watch to resume", lambda: len(api.watches) == 2)
        assert api.watches[1][0] == "20" and len(w.pokes) == n
    finally:
        PodWatch.PAGE = page
        w.watch.stop()


@pytest.mark.asyncio
async def test_after_410_gone_a_fresh_list_drops_the_pods_deleted_in_the_gap(api: Api) -> None:
    for n in ("keep", "gone"):
        api.pods[n] = pod_json(n)
    w = Watched(api)
    w.watch.start()
    assert await w.watch.wait_listed(10)
    await until("the watch", lambda: api.watches)
    # In the gap "gone" is deleted and "again" created; the watch hears none of it.
    del api.pods["gone"]
    api.pods["again"] = pod_json("again")
    api.rv = 30
    api.lines.put(
        line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})
    )
    await until("the relist", lambda: w.names() == ["again", "keep"])
    assert w.dropped == ["gone"] and len(api.list_calls) == 2
    await until("the watch from the new list", lambda: len(api.watches) == 2)
    assert api.watches[1][0] == "30"
    w.watch.stop()


@pytest.mark.asyncio
async def test_the_scope_is_listed_afresh_every_relist_period_and_a_failed_list_retried(
    api: Api,
) -> None:
    api.pods["a"] = pod_json("a")
    api.fail_lists = 2
    now = [0.0]
    w = Watched(api, relist_s=60.0, clock=lambda: now[0])
    w.watch.start()
    assert await w.watch.wait_listed(10)
    assert len(w.failures) == 2 and "read timed out" in w.failures[0]
    await until("the watch", lambda: api.watches)
    assert api.watches[0][1] == 55  # never past the relist period's end, at most WATCH_S
    api.pods["stale-free"] = pod_json("stale-free")
    del api.pods["a"]  # deleted, and the watch never says so
    now[0] = 61.0
    api.lines.put(None)  # the request ends; the period is over: list afresh
    await until("the periodic relist", lambda: w.names() == ["stale-free"])
    assert w.dropped == ["a"]
    w.watch.stop()


@pytest.mark.asyncio
async def test_the_loops_see_the_pods_of_the_store_and_wait_for_its_first_list(
    monkeypatch: pytest.MonkeyPatch, api: Api
) -> None:
    metrics = OperatorMetrics()
    monkeypatch.setattr(handlers, "_state", {"metrics": metrics, "allow_endpoint_host": False})
    with pytest.raises(NotListedYet):
        list(handlers._pod_source("ns", 8975))
    api.pods["d0"] = pod_json("d0", ready=True, ip="10.1.2.3")
    api.fail_lists = 10**6  # nothing listed yet
    watch = handlers.start_pod_watch(api, ["ns"], relist_s=0)
    try:
        assert not await watch.wait_listed(0.2)
        with pytest.raises(NotListedYet):
            list(handlers._pod_source("ns", 8975))
        api.fail_lists = 0
        assert await watch.wait_listed(10)
        (view,) = handlers._pod_source("ns", 8975)
        assert (view.name, view.ready, view.endpoint) == ("d0", True, "10.1.2.3:8975")
        (again,) = handlers._pod_source("ns", 8975)
        assert again is view, "a pod's view is built once per version and port"
        (other,) = handlers._pod_source("ns", 9000)
        assert other.endpoint == "10.1.2.3:9000"
        failures = metrics.registry.get_sample_value("kvtopo_operator_relist_failures_total")
        assert failures is not None and failures >= 1
        # A line the watch cannot decode is counted; a deleted pod's view goes with it.
        await until("the watch", lambda: api.watches)
        api.lines.put(b"{not json")
        api.lines.put(line("DELETED", pod_json("d0", ready=True, ip="10.1.2.3")))
        malformed = "kvtopo_operator_pod_watch_malformed_total"
        await until(
            "the malformed line counted", lambda: metrics.registry.get_sample_value(malformed)
        )
        await until("the deletion", lambda: not list(handlers._pod_source("ns", 8975)))
        assert handlers._state["views"]["ns"] == {}
    finally:
        watch.stop()


def test_a_gated_pod_that_leaves_the_watch_with_its_gate_true_is_remembered() -> None:
    """A pod whose role label is removed is reported DELETED by the filtered watch while it
    runs on: with its gate True (and not being deleted) it is remembered until the operator
    settles it or it comes back; a pod really being deleted, or with its gate False, is not."""
    gated = {"readinessGates": [{"conditionType": "kvtopo.dev/kv-connected"}]}
    ok = {"type": "kvtopo.dev/kv-connected", "status": "True", "reason": "KVConnected"}

    def engine(name: str, gate: dict[str, str] | None, **meta: Any) -> EnginePod:
        raw = pod_json(name, ready=True, **meta)
        raw["spec"].update(gated)
        if gate is not None:
            raw["status"]["conditions"].append(gate)
        return decode_pod(json.dumps(raw).encode())

    store = PodStore()
    store.replace("ns", [])
    left = engine("d0", ok)
    assert store.depart(left) and [p.uid for p in store.departed("ns")] == ["u-d0"]
    assert not store.depart(engine("d1", {**ok, "status": "False"}))
    assert not store.depart(engine("d2", ok, deletionTimestamp="2026-01-01T00:00:00Z"))
    store.upsert(left)  # back in the watch (labelled again)
    assert store.departed("ns") == []
    store.depart(left)
    store.settle("ns", left.uid)
    assert store.departed("ns") == []
