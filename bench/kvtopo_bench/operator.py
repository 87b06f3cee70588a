"""`kvtopo bench operator`: the operator at fleet scale, on a real control plane with kwok.

Owns the fleet benchmark: a tier b control plane with enough kwok nodes, the CRD and a
KVTopology, the operator as its own process, prefill and decode Deployments, and one
lightweight fake worker control server per Ready pod, all served by one asyncio loop in this
process (a thousand real workers would not fit on the machine). Each listens at its pod's IP
(kwok gives every pod a loopback address of its own) on the control port, and reports its
pod's identity, so the operator reaches it exactly as a real worker. The fake servers speak
the worker control API (`/v1/state` with its ETag and 304, `PUT|DELETE /v1/peers/{id}`,
`PATCH /v1/peers`) without NIXL.

A kubelet-like agent hears the pods through kvtopo's own pod watch (`podwatch`) and gives
each Ready pod its fake worker. The engine pods carry no endpoint annotation: the operator
calls each at its pod IP on the control port, as in a cluster whose workers listen there. (An
agent that annotated every pod once its fake worker listened made one more write per pod,
a fifth of the API server's pod writes, on the machine the control plane shares.)

First, with no cluster, the decision alone (`decision`: `evaluate` at 500 x 1500 engines).
Then, per size (16 x 64, 32 x 1000, 64 x 2000): pod serving (its fake worker listening) -> all
of its pairs Connected both ways (p50/p99), pod deleted -> evicted from every peer
(p50/p99), a full decode rollout -> converged (with its timeline: the Deployment's last
change vs the operator's tail, and beside it the same rollout with only the control plane
running, measured first in the same run), the operator's peak RSS and CPU seconds per 1,000
pod events, and this process's own CPU over
the same window (`bench_cpu_s`: the machine is shared with the control plane).

For looking into a run: `KVTOPO_BENCH_PROFILE=DIR` runs the operator under py-spy (with
`KVTOPO_BENCH_PROFILE_ARGS`, e.g. `--gil`), and `KVTOPO_BENCH_TRACE=DIR` writes each
engine's times in each size's run (serving, first read, first adds, connected, gone,
evicted; seconds from the rollout's start, with the wall clock then, to line them up with
the operator's log of its loud rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from kvtopo import launch
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from kvtopo_operator.api import GROUP, PLURAL
from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import ClusterApi
from kvtopo_operator.podwatch import EnginePod, PodStore, PodWatch
from kvtopo_worker.protocol import (
    PeerAddRequest,
    PeerChanges,
    PeerChangesResult,
    PeerOutcome,
    PeerState,
    PodIdentity,
    WorkerState,
    tag_matches,
)
from kvtopo_worker.signing import CallGuard, PublicKeys

SIZES = ((16, 64), (32, 1000), (64, 2000))
CONTROL_PORT = 8975
"""The KVTopology's default controlPort, where every fake worker listens at its pod IP."""
GRACE = 1
APP = "bench"
"""The `app` label of the benchmark's engine pods and the name of its KVTopology."""


@dataclass
class FakeWorker:
    engine_id: str
    role: str
    pod: str
    uid: str
    ip: str
    serving_at: float
    site: web.TCPSite | None = None
    peers: set[str] = field(default_factory=set)
    peer_incarnations: dict[str, str] = field(default_factory=dict)
    gone_at: float | None = None
    connected_at: float | None = None
    # Where a new engine's wait went: the operator's first read of its state, its first
    # call with adds (its own side of its pairs), then connected both ways.
    first_read_at: float | None = None
    first_adds_at: float | None = None
    evicted_at: float | None = None
    # A hostile worker (the `hostile` run): "garbage" answers every call with bytes that are
    # no JSON; "hung" accepts every call and never answers (a SIGSTOPped process). Neither
    # is measured: the run measures what they cost the healthy engines.
    hostile: str = ""
    # Its `/v1/state` answer as last encoded, and that answer's ETag; None once the peers
    # changed (as a real worker, it answers 304 to its tag while nothing changed).
    answer: tuple[bytes, str] | None = None
    generation: int = 0
    # Its guard of the operator's signed calls (None: it takes any call, for an operator
    # tree that predates signing, `--baseline-tree`).
    guard: CallGuard | None = None

    def changed(self) -> None:
        self.generation += 1
        self.answer = None


class FakeFleet:
    """Many fake worker control servers, one per pod IP, on one aiohttp runner. With
    `operator_keys`, each worker takes only calls the operator signed for it (a key and a
    challenge of its own, as a real worker), so the operator's signing is in the figures."""

    def __init__(self, namespace: str, operator_keys: PublicKeys | None = None) -> None:
        self.namespace = namespace
        self.operator_keys = operator_keys
        self.adds_without_ticket = 0
        self.by_ip: dict[str, FakeWorker] = {}
        self.by_engine: dict[str, FakeWorker] = {}
        app = web.Application()
        app.router.add_get("/v1/state", self._state)
        app.router.add_put("/v1/peers/{engine_id}", self._put)
        app.router.add_delete("/v1/peers/{engine_id}", self._delete)
        app.router.add_patch("/v1/peers", self._patch)
        self.runner = web.AppRunner(app, access_log=None)
        self.requests = 0
        self.refused = 0  # calls answered 401 (unsigned, or signed for another challenge)
        self.patches = 0  # PATCH /v1/peers calls taken
        self.patch_items = 0  # ... and the adds and evictions in them
        # ... of which changed nothing: an add of a peer held at the same incarnation, an
        # eviction of a peer not held (a half made again)
        self.patch_items_redundant = 0
        self.patch_evictions_redundant = 0  # ... of which evictions
        self.state_reads = 0
        self.not_modified = 0  # state reads answered 304
        self.never = asyncio.Event()  # what a hung worker's calls wait for (set at cleanup)
        self.hostile_calls = 0
        self.huge_reads = 0

    async def start(self) -> None:
        await self.runner.setup()

    def holds(self, ip: str) -> bool:
        """Whether a worker still listens at `ip` (kwok hands freed pod IPs out again)."""
        return ip in self.by_ip

    async def add(self, pod: str, role: str, uid: str, ip: str) -> FakeWorker:
        site = web.TCPSite(self.runner, ip, CONTROL_PORT)
        await site.start()
        w = FakeWorker(f"fake-{pod}", role, pod, uid, ip, 0.0, site)
        if self.operator_keys is not None:
            # Its challenge names its process (its incarnation, the engine id here), as a
            # worker's does: without it the operator minted no ticket for any add of it and
            # dropped its challenge each time, so the next call to it was asked afresh.
            w.guard = CallGuard(
                {"operator": self.operator_keys}, pod_uid=uid, incarnation=w.engine_id
            )
        self.by_ip[ip] = w
        self.by_engine[w.engine_id] = w
        return w

    async def remove(self, w: FakeWorker) -> None:
        """The pod is gone: its worker stops listening (its pod IP may be reused)."""
        if w.site is not None:
            await w.site.stop()
            w.site = None
        if self.by_ip.get(w.ip) is w:
            del self.by_ip[w.ip]

    def _worker(self, request: web.Request) -> FakeWorker:
        transport = request.transport
        if transport is None:
            raise web.HTTPServiceUnavailable(text="connection closed")
        w = self.by_ip.get(str(transport.get_extra_info("sockname")[0]))
        if w is None:  # a connection accepted just before its worker stopped listening
            raise web.HTTPServiceUnavailable(text="no worker listens here any more")
        return w

    async def _refused(self, w: FakeWorker, request: web.Request) -> web.Response | None:
        """401 with the worker's challenge unless the call is signed for it (None: it is)."""
        if w.guard is None:
            return None
        accepted = w.guard.accepts(
            "operator",
            request.headers.get("Authorization", ""),
            request.method,
            request.path_qs,
            [f"{w.ip}:{CONTROL_PORT}"],
            await request.read(),
        )
        if accepted is not None:
            return None
        self.refused += 1
        return web.Response(status=401, headers={"WWW-Authenticate": w.guard.challenge("operator")})

    async def _hostile(self, w: FakeWorker, request: web.Request) -> web.Response | None:
        """What a hostile worker answers, or a refusal of an unsigned call (None: neither)."""
        if not w.hostile:
            return await self._refused(w, request)
        self.hostile_calls += 1
        if w.hostile == "hung":
            await self.never.wait()
        if w.hostile == "huge":
            if request.path != "/v1/state":
                return await self._refused(w, request)  # its peer calls are a worker's
            return web.Response(body=self._huge_state(w), content_type="application/json")
        return web.Response(body=b"\x00\xffnot json {{{", content_type="application/json")

    def _huge_state(self, w: FakeWorker) -> bytes:
        """A 16 MiB state, new on every read: the peers it holds, the first reported failing
        with a reason of nearly all those bytes (issue 54: a decode answering so grew the
        operator from 79 to 885 MiB)."""
        self.huge_reads += 1
        state = msgspec.json.decode(self._encode_state(w))
        peers = state["peers"] or [{"engine_id": "nobody"}]
        peers[0].update(health="failing", health_reason="")
        state["peers"] = peers
        room = HUGE_STATE_BYTES - len(msgspec.json.encode(state))
        peers[0]["health_reason"] = (f"read {self.huge_reads} " + "r" * room)[:room]
        return msgspec.json.encode(state)

    def stop_hostile(self) -> None:
        """Lets the hung workers' calls end (the run is over)."""
        self.never.set()

    async def _state(self, request: web.Request) -> web.Response:
        self.requests += 1
        w = self._worker(request)
        if (answer := await self._hostile(w, request)) is not None:
            return answer
        if w.answer is None:
            w.answer = (self._encode_state(w), f'"{w.engine_id}-{w.generation}"')
        body, tag = w.answer
        self.state_reads += 1
        if w.first_read_at is None:
            w.first_read_at = time.monotonic()
        if tag_matches(request.headers.get("If-None-Match"), tag):
            self.not_modified += 1
            return web.Response(status=304, headers={"ETag": tag})
        return web.Response(body=body, content_type="application/json", headers={"ETag": tag})

    def _encode_state(self, w: FakeWorker) -> bytes:
        state = WorkerState(
            engine_id=w.engine_id,
            role=w.role,  # type: ignore[arg-type]
            compat_hash="bench",
            protocol_version=1,
            peers=[
                PeerState(
                    engine_id=p,
                    agents={0: p},
                    transfers_in_flight=0,
                    eviction_pending=False,
                    idle_s=0.0,
                    incarnation=w.peer_incarnations.get(p, ""),
                )
                for p in sorted(w.peers)
            ],
            failures={},
            requests_done=0,
            requests_failed=0,
            requests_in_flight=0,
            started_at=0.0,
            incarnation=w.engine_id,
            pod=PodIdentity(namespace=self.namespace, name=w.pod, uid=w.uid),
        )
        return msgspec.json.encode(state)

    async def _put(self, request: web.Request) -> web.Response:
        self.requests += 1
        w = self._worker(request)
        if (answer := await self._hostile(w, request)) is not None:
            return answer
        body = msgspec.json.decode(await request.read(), type=PeerAddRequest)
        eid = request.match_info["engine_id"]
        result = "present" if eid in w.peers else "added"
        w.peers.add(eid)
        w.peer_incarnations[eid] = body.incarnation
        w.changed()
        return web.json_response({"engine_id": eid, "result": result, "agents": {"0": eid}})

    async def _delete(self, request: web.Request) -> web.Response:
        self.requests += 1
        w = self._worker(request)
        if (answer := await self._hostile(w, request)) is not None:
            return answer
        eid = request.match_info["engine_id"]
        result = "evicted" if eid in w.peers else "absent"
        w.peers.discard(eid)
        w.changed()
        return web.json_response({"engine_id": eid, "result": result})

    async def _patch(self, request: web.Request) -> web.Response:
        self.requests += 1
        w = self._worker(request)
        if (answer := await self._hostile(w, request)) is not None:
            return answer
        changes = msgspec.json.decode(await request.read(), type=PeerChanges)
        self.patches += 1
        if changes.add and w.first_adds_at is None:
            w.first_adds_at = time.monotonic()
        self.patch_items += len(changes.add) + len(changes.evict)
        results = []
        for item in changes.add:
            if w.guard is not None and not item.ticket:
                self.adds_without_ticket += 1
            result = "present" if item.engine_id in w.peers else "added"
            if result == "present" and w.peer_incarnations.get(item.engine_id) == item.incarnation:
                self.patch_items_redundant += 1
            w.peers.add(item.engine_id)
            w.peer_incarnations[item.engine_id] = item.incarnation
            results.append(
                PeerOutcome(
                    engine_id=item.engine_id,
                    op="add",
                    status=200,
                    result=result,
                    agents={0: item.engine_id},
                )
            )
        for eid in changes.evict:
            result = "evicted" if eid in w.peers else "absent"
            if result == "absent":
                self.patch_items_redundant += 1
                self.patch_evictions_redundant += 1
            w.peers.discard(eid)
            results.append(PeerOutcome(engine_id=eid, op="evict", status=200, result=result))
        if results:
            w.changed()
        body = msgspec.json.encode(PeerChangesResult(results=results))
        return web.Response(body=body, content_type="application/json")


class _TouchedPods(PodStore):
    """The agent's pod store: it also keeps each pod by uid and notes the uids every change
    touched, so a poll looks at those pods only."""

    def __init__(self) -> None:
        super().__init__()
        self.latest: dict[str, EnginePod] = {}
        self.touched: set[str] = set()

    def put(self, pod: EnginePod) -> tuple[bool, EnginePod | None]:
        self.latest[pod.uid] = pod
        self.touched.add(pod.uid)
        return super().put(pod)

    def remove(self, namespace: str, uid: str) -> bool:
        self.latest.pop(uid, None)
        self.touched.add(uid)
        return super().remove(namespace, uid)

    def replace(
        self, scope: str | None, pods: Iterable[EnginePod]
    ) -> tuple[set[str], list[EnginePod]]:
        listed = list(pods)
        self.touched.update(self.latest)
        self.latest = {p.uid: p for p in listed}
        self.touched.update(self.latest)
        return super().replace(scope, listed)


def _wait_parts(workers: list[FakeWorker]) -> dict[str, dict[str, float]]:
    """Where the new engines' wait from serving to connected went (p50 and p99 of each
    part): until the operator first read the engine's state, from there until its first
    call with adds reached the engine, and from there until every pair was connected both
    ways (the other side's adds)."""
    spans: dict[str, list[float]] = {
        "to_first_read": [],
        "read_to_adds": [],
        "adds_to_connected": [],
    }
    for w in workers:
        if w.first_read_at is None or w.first_adds_at is None or w.connected_at is None:
            continue
        spans["to_first_read"].append(w.first_read_at - w.serving_at)
        spans["read_to_adds"].append(w.first_adds_at - w.first_read_at)
        spans["adds_to_connected"].append(max(0.0, w.connected_at - w.first_adds_at))
    return {
        name: {"p50": round(_pct(v, 0.5), 3), "p99": round(_pct(v, 0.99), 3), "n": len(v)}
        for name, v in spans.items()
    }


def _write_trace(path: Path, t0: float, workers: Iterable[FakeWorker]) -> None:
    """Each engine's times (seconds from the rollout's start, monotonic; None: never) and
    the wall clock at that start, to line them up with the operator's log."""

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    rows = [
        {
            "pod": w.pod,
            "role": w.role,
            "serving": rel(w.serving_at),
            "first_read": rel(w.first_read_at),
            "first_adds": rel(w.first_adds_at),
            "connected": rel(w.connected_at),
            "gone": rel(w.gone_at),
            "evicted": rel(w.evicted_at),
        }
        for w in workers
        if not w.hostile
    ]
    wall = time.time() - (time.monotonic() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rollout_started_wall": wall, "engines": rows}) + "\n")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _proc_cpu_rss(pid: int) -> tuple[float, float]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return cpu, hwm


class SizeRun:
    def __init__(
        self,
        cluster: Any,
        prefill: int,
        decode: int,
        log: Callable[[str], None],
        *,
        operator_tree: Path | None = None,
        run_name: str = "",
        hostile: bool = False,
    ) -> None:
        """One size's run; `operator_tree`: run the operator of that source tree (its
        `operator/` and `worker/` first on PYTHONPATH) instead of the installed one;
        `run_name` tells this run's namespace from others of the same size; `hostile`: one
        decode worker answers garbage and one is hung, all along (a hostile worker's pod
        replaced gets a hostile worker again); they are not measured."""
        self.hostile = hostile  # one decode answering garbage, one hung, one huge
        self.api = api = ClusterApi(cluster.kubeconfig)
        self.core: Any = api.core
        self.apps: Any = api.apps
        self.cluster = cluster
        self.prefill, self.decode = prefill, decode
        self.operator_tree = operator_tree
        self.ns = f"bench-{prefill}x{decode}{'-' + run_name if run_name else ''}"
        self.log = log
        self.fleet = FakeFleet(self.ns)
        self.by_uid: dict[str, FakeWorker] = {}
        self.events = 0
        self.starting: set[str] = set()
        self.operator: subprocess.Popen[bytes] | None = None
        self.pods_at_start = 0

    async def agent(self) -> None:
        """Gives each Ready pod a fake worker and notices pods going (the kubelet's part)."""

        async def serve(name: str, role: str, uid: str, ip: str) -> None:
            w = await self.fleet.add(name, role, uid, ip)
            if self.hostile and role == "decode":
                kinds = {o.hostile for o in self.live()}
                w.hostile = next((k for k in ("garbage", "hung", "huge") if k not in kinds), "")
            self.by_uid[uid] = w
            w.serving_at = time.monotonic()

        # The pods come from a watch (kvtopo's own engine-pod watch), as a kubelet hears of
        # its pods: listing a thousand pods every poll cost the API server and this process
        # more CPU than the operator under test. Each poll looks at the pods the watch
        # touched since the last one (looking at all of them, 50 times a second, was most
        # of this process's CPU at 64 x 2000).
        changed = asyncio.Event()
        store = _TouchedPods()
        watch = PodWatch(self.api, [self.ns], store, on_change=lambda ns: changed.set())
        watch.start()
        again: set[str] = set()  # pods whose IP's old worker was still going: look again
        try:
            while True:
                await changed.wait()
                changed.clear()
                if not store.listed(self.ns):
                    continue
                self.events += 1
                touched, store.touched = store.touched | again, set()
                again = set()
                stopping: list[FakeWorker] = []
                starts: list[tuple[str, str, str, str]] = []
                claimed: set[str] = set()
                for uid in touched:
                    p = store.latest.get(uid)
                    w = self.by_uid.get(uid)
                    usable = p is not None and p.ready and not p.deleting
                    if w is not None:
                        if not usable and w.gone_at is None:
                            w.gone_at = time.monotonic()
                        if w.gone_at is not None and w.site is not None:
                            stopping.append(w)
                        continue
                    ip = p.pod_ips[0] if p is not None and p.pod_ips else ""
                    if p is not None and usable and ip and uid not in self.starting:
                        if ip in claimed:
                            again.add(uid)  # its IP's old worker is still going
                        else:
                            claimed.add(ip)
                            starts.append((p.name, p.role, uid, ip))
                for w in stopping:
                    await self.fleet.remove(w)
                starting = []
                for name, role, uid, ip in starts:
                    if self.fleet.holds(ip):  # its IP's old worker is still going
                        again.add(uid)
                        continue
                    self.starting.add(uid)
                    starting.append(serve(name, role, uid, ip))
                if starting:
                    await asyncio.gather(*starting)
                if again:  # look again shortly (polling the bench's own fleet, not the API)
                    await asyncio.sleep(0.05)
                    changed.set()
        finally:
            watch.stop()

    async def measure(self) -> None:
        """Timestamps connectivity and eviction every 100 ms, independent of the agent."""
        while True:
            self._measure()
            await asyncio.sleep(0.1)

    def live(self) -> list[FakeWorker]:
        return [w for w in self.by_uid.values() if w.gone_at is None]

    def healthy(self) -> list[FakeWorker]:
        """The live workers that are not hostile (what is measured)."""
        return [w for w in self.live() if not w.hostile]

    def _measure(self) -> None:
        now = time.monotonic()
        live = self.healthy()
        ps = [w for w in live if w.role == "prefill"]
        ds = [w for w in live if w.role == "decode"]
        for w in live:
            if w.connected_at is not None or w.serving_at == 0.0:
                continue
            # A pod is connected when it is paired both ways with every engine of the other
            # role that was serving when it started serving; later engines' pairs count
            # towards their own latency. A pod with no such engine is not measured.
            others = [
                o
                for o in (ds if w.role == "prefill" else ps)
                if o.serving_at <= w.serving_at and o.serving_at > 0
            ]
            if not others:
                continue
            if all(o.engine_id in w.peers and w.engine_id in o.peers for o in others):
                w.connected_at = now
        # Evicted: no live engine of the other role holds it (only they hold it). This runs
        # every 100 ms beside the operator: a gone decode is checked against the prefills,
        # not against every live engine.
        for w in self.by_uid.values():
            if w.gone_at is not None and w.evicted_at is None and not w.hostile:
                holders = ds if w.role == "prefill" else ps
                if not any(w.engine_id in o.peers for o in holders):
                    w.evicted_at = now

    def all_connected(self) -> bool:
        live = self.healthy()
        hostile = sum(1 for w in self.live() if w.hostile)
        return (
            sum(w.role == "prefill" for w in live) == self.prefill
            and sum(w.role == "decode" for w in live) + hostile == self.decode
            and all(
                w.evicted_at is not None
                for w in self.by_uid.values()
                if w.gone_at and not w.hostile
            )
            # Cheap first: an engine holding fewer peers than there are live engines of
            # the other role is not meshed; the set inclusions only when none does.
            and all(
                len(w.peers) >= (self.decode - hostile if w.role == "prefill" else self.prefill)
                for w in live
            )
            and self._meshed(live)
        )

    @staticmethod
    def _meshed(live: list[FakeWorker]) -> bool:
        """Every live prefill and decode hold each other (set inclusions, not pair by pair:
        this runs every 200 ms beside the operator)."""
        ps = {w.engine_id for w in live if w.role == "prefill"}
        ds = {w.engine_id for w in live if w.role == "decode"}
        return all(ds <= w.peers for w in live if w.role == "prefill") and all(
            ps <= w.peers for w in live if w.role == "decode"
        )

    async def until(self, what: str, probe: Callable[[], bool], limit_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if probe():
                return time.monotonic() - t0
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{what}: not within {limit_s:.0f}s")

    def _status_written(self) -> bool:
        obj = self.api.read_topology(self.ns, APP) or {}
        return bool((obj.get("status") or {}).get("conditions"))

    async def _child_of(self, pid: int) -> int:
        """The operator process that py-spy started (for its CPU and RSS)."""
        path = Path(f"/proc/{pid}/task/{pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = await asyncio.to_thread(lambda: path.read_text().split())
            if children:
                return int(children[0])
            await asyncio.sleep(0.05)
        raise RuntimeError("py-spy did not start the operator within 10 s")

    def _deployment_done(self, ns: str, replicas: int, generation: int) -> bool:
        """Whether the decode Deployment in `ns` has rolled out `generation` whole: every
        replica updated and available, and no old pod left."""
        st = self.apps.read_namespaced_deployment("decode", ns).status
        return (
            (st.observed_generation or 0) >= generation
            and (st.updated_replicas or 0) == replicas
            and (st.available_replicas or 0) == replicas
            and (st.replicas or 0) == replicas
        )

    async def bare_rollout(self) -> float:
        """The same decode rollout with nothing but the control plane: the same Deployment
        in a namespace of its own, no operator, no fake workers, no agent (measured before
        the operator starts, side by side in the same run). The machine is shared and its
        speed drifts; the operator's rollout is read against this."""
        ns = f"{self.ns}-bare"
        await asyncio.to_thread(self.api.create_namespace, ns)
        await self.until(
            "ServiceAccount (bare rollout)",
            lambda: bool(self.core.list_namespaced_service_account(ns).items),
            60,
        )
        deployment = manifests.engine_deployment(
            "decode",
            app=APP,
            role="decode",
            replicas=self.decode,
            version=None,
            max_surge="25%",
            max_unavailable="25%",
            termination_grace_seconds=0,
            endpoint=None,
        )
        await asyncio.to_thread(self.apps.create_namespaced_deployment, ns, deployment)
        limit = 120 + self.decode * 0.6
        await self.until(
            "bare deployment available",
            lambda: self._deployment_done(ns, self.decode, 1),
            limit,
        )
        stamp = datetime.now(UTC).isoformat()
        t0 = time.monotonic()
        patched = await asyncio.to_thread(
            self.apps.patch_namespaced_deployment,
            "decode",
            ns,
            {"spec": {"template": {"metadata": {"annotations": {"bench/restartedAt": stamp}}}}},
        )
        generation = patched.metadata.generation
        await self.until(
            "bare rollout",
            lambda: self._deployment_done(ns, self.decode, generation),
            limit * 2,
        )
        took = time.monotonic() - t0
        # Its pods gone before the measured run starts (they would load the machine).
        await asyncio.to_thread(
            self.apps.patch_namespaced_deployment, "decode", ns, {"spec": {"replicas": 0}}
        )
        await self.until(
            "bare pods gone",
            lambda: not self.core.list_namespaced_pod(ns, limit=1).items,
            limit,
        )
        await asyncio.to_thread(self.core.delete_namespace, ns)
        return took

    def _operator_args(self, token_file: Path) -> list[str]:
        """The operator's arguments: its private key beside `token_file`; an operator tree
        that predates signed calls (`--baseline-tree` at an older commit) is given the
        token file itself, as it was then."""
        args = launch.operator_args(
            self.ns, self.cluster.kubeconfig, Credentials.beside(token_file).operator_key, 2
        )
        if not self._signs():
            i = args.index("--worker-key-file")
            args[i : i + 2] = ["--worker-token-file", str(token_file)]
        return args

    def _signs(self) -> bool:
        """Whether the operator under test signs its calls (this tree's does; a
        `--baseline-tree` from before signed calls does not)."""
        if self.operator_tree is None:
            return True
        main = self.operator_tree / "operator" / "kvtopo_operator" / "main.py"
        return "--worker-key-file" in main.read_text()

    async def run(self, token_file: Path, log_dir: Path) -> dict[str, Any]:
        if self._signs():  # an operator that signs (a baseline too): the workers check it
            public = Credentials.beside(token_file).operator_public
            self.fleet.operator_keys = PublicKeys(path=public)
        await self.fleet.start()
        # Pods already on the cluster (earlier runs' not yet gone): they load its control
        # plane, so the report says how many there were (0 when each run removes its own).
        earlier = await asyncio.to_thread(self.core.list_pod_for_all_namespaces)
        self.pods_at_start = len(earlier.items)
        bare_s = await self.bare_rollout()
        self.log(f"  the control plane alone rolls the {self.decode} decodes out in {bare_s:.1f} s")
        await asyncio.to_thread(self.api.create_namespace, self.ns)
        await self.until(
            "ServiceAccount",
            lambda: bool(self.core.list_namespaced_service_account(self.ns).items),
            60,
        )
        topo = manifests.topology(
            APP,
            app=APP,
            eviction={"graceSeconds": GRACE},
            handshake={"maxConcurrent": 256},
        )
        await asyncio.to_thread(self.api.create_topology, self.ns, topo)
        profile = os.environ.get("KVTOPO_BENCH_PROFILE")  # a folder: run under py-spy
        if profile and shutil.which("py-spy") is None:
            raise RuntimeError(
                "KVTOPO_BENCH_PROFILE needs py-spy on PATH (pip install py-spy into the venv)"
            )
        if profile:
            os.makedirs(profile, exist_ok=True)
        wrap = (
            [
                "py-spy",
                "record",
                "--rate",
                "50",
                "--format",
                "raw",
                "-o",
                str(Path(profile) / f"operator-{self.ns}.folded"),
                # e.g. "--gil": only the samples of the thread holding the interpreter lock
                *os.environ.get("KVTOPO_BENCH_PROFILE_ARGS", "").split(),
                "--",
            ]
            if profile
            else []
        )
        env = None
        if self.operator_tree is not None:
            tree = self.operator_tree.resolve()
            env = {**os.environ, "PYTHONPATH": f"{tree / 'operator'}:{tree / 'worker'}"}
        self.operator = await asyncio.to_thread(
            functools.partial(
                launch.start_operator,
                self._operator_args(token_file),
                log_dir / f"operator-{self.ns}.log",
                wrapper=wrap,
                env=env,
            )
        )
        pid = self.operator.pid
        if profile:  # measure the operator, not py-spy
            pid = await self._child_of(pid)
        agent = asyncio.create_task(self.agent())
        measure = asyncio.create_task(self.measure())
        try:
            # The operator is up once it has written the (still empty) topology's status.
            await self.until("operator start", self._status_written, 60)
            cpu0, _ = _proc_cpu_rss(pid)
            own0 = time.process_time()
            ev0 = self.events
            reads0, unmodified0 = self.fleet.state_reads, self.fleet.not_modified
            window0 = time.monotonic()
            roles: tuple[tuple[manifests.Role, int], ...] = (
                ("prefill", self.prefill),
                ("decode", self.decode),
            )
            for role, n in roles:
                deployment = manifests.engine_deployment(
                    role,
                    app=APP,
                    role=role,
                    replicas=n,
                    version=None,
                    max_surge="25%",
                    max_unavailable="25%",
                    termination_grace_seconds=0,
                    endpoint=None,
                )
                await asyncio.to_thread(self.apps.create_namespaced_deployment, self.ns, deployment)
            limit = 120 + (self.prefill + self.decode) * 0.6
            await self.until("initial convergence", self.all_connected, limit)
            initial = [w.connected_at - w.serving_at for w in self.healthy() if w.connected_at]
            # Delete a tenth of the decode pods; the Deployment replaces them.
            victims = [w for w in self.healthy() if w.role == "decode"][: max(1, self.decode // 10)]
            t_del = time.monotonic()
            for w in victims:
                w.gone_at = time.monotonic()  # the deletion is ours: its time is exact
                await asyncio.to_thread(
                    self.core.delete_namespaced_pod, w.pod, self.ns, grace_period_seconds=0
                )
            await self.until("replacement convergence", self.all_connected, limit)
            gone = [w.evicted_at - w.gone_at for w in victims]  # type: ignore[operator]
            replaced = [
                w.connected_at - w.serving_at
                for w in self.healthy()
                if w.serving_at >= t_del and w.connected_at
            ]
            # A full decode rollout.
            stamp = datetime.now(UTC).isoformat()
            t_roll = time.monotonic()
            await asyncio.to_thread(
                self.apps.patch_namespaced_deployment,
                "decode",
                self.ns,
                {"spec": {"template": {"metadata": {"annotations": {"bench/restartedAt": stamp}}}}},
            )
            await self.until(
                "rollout started",
                lambda: any(w.gone_at and w.gone_at >= t_roll for w in self.by_uid.values()),
                60,
            )
            await self.until("rollout convergence", self.all_connected, limit * 2)
            rollout_s = time.monotonic() - t_roll
            later = [
                w.connected_at - w.serving_at
                for w in self.healthy()
                if w.serving_at >= t_roll and w.connected_at
            ]
            cpu1, rss = _proc_cpu_rss(pid)
            own = time.process_time() - own0
            # Where the rollout's time went: the Deployment replacing its pods (the last new
            # engine serving, the last old pod gone) vs the operator's tail after that.
            new = [w for w in self.by_uid.values() if w.serving_at >= t_roll and not w.hostile]
            old = [
                w
                for w in self.by_uid.values()
                if w.gone_at and w.gone_at >= t_roll and not w.hostile
            ]
            timeline = {
                "last_new_serving_s": max((w.serving_at for w in new), default=t_roll) - t_roll,
                "last_old_gone_s": max((w.gone_at or t_roll for w in old), default=t_roll) - t_roll,
                "last_connected_s": max((w.connected_at or t_roll for w in new), default=t_roll)
                - t_roll,
                "last_evicted_s": max((w.evicted_at or t_roll for w in old), default=t_roll)
                - t_roll,
            }
            parts = _wait_parts(
                [w for w in self.healthy() if w.serving_at >= t_roll and w.connected_at]
            )
            trace = os.environ.get("KVTOPO_BENCH_TRACE")  # a folder: each engine's times
            if trace:
                _write_trace(Path(trace) / f"{self.ns}.json", t_roll, self.by_uid.values())
            pod_events = max(1, len(self.by_uid) * 3)  # add, bind, ready (+delete) per pod
            ready = initial + replaced + later
            return {
                "size": f"{self.prefill}x{self.decode}",
                "hostile": self.hostile,
                "hostile_calls": self.fleet.hostile_calls,
                "huge_reads": self.fleet.huge_reads,
                "adds_without_ticket": self.fleet.adds_without_ticket,
                "fleet_requests": self.fleet.requests,
                "fleet_refused": self.fleet.refused,
                "fleet_patches": self.fleet.patches,
                "fleet_patch_items": self.fleet.patch_items,
                "fleet_patch_items_redundant": self.fleet.patch_items_redundant,
                "fleet_patch_evictions_redundant": self.fleet.patch_evictions_redundant,
                "pods": self.prefill + self.decode,
                "ready_to_connected_p50_s": round(_pct(ready, 0.5), 3),
                "ready_to_connected_p99_s": round(_pct(ready, 0.99), 3),
                "ready_to_connected_p99_by_phase_s": {
                    phase: round(_pct(v, 0.99), 3)
                    for phase, v in (
                        ("initial", initial),
                        ("replacement", replaced),
                        ("rollout", later),
                    )
                },
                "rollout_ready_to_connected_parts_s": parts,
                "gone_to_evicted_p50_s": round(_pct(gone, 0.5), 3),
                "gone_to_evicted_p99_s": round(_pct(gone, 0.99), 3),
                "grace_s": GRACE,
                "rollout_converge_s": round(rollout_s, 2),
                # The same rollout on the same cluster in the same run, control plane only:
                # what this machine allows right now; the ratio is the operator's and the
                # harness's share.
                "rollout_control_plane_only_s": round(bare_s, 2),
                "rollout_vs_control_plane_only": round(rollout_s / bare_s, 2),
                "rollout_timeline_s": {k: round(v, 2) for k, v in timeline.items()},
                "operator_rss_mb": round(rss, 1),
                "operator_cpu_s": round(cpu1 - cpu0, 2),
                "pod_events_estimate": pod_events,
                "cpu_s_per_1k_events": round((cpu1 - cpu0) / pod_events * 1000, 2),
                "agent_polls": self.events - ev0,  # the agent's passes over the pods
                # The benchmark's own load (fake workers, the agent, sampling), same window.
                "bench_cpu_s": round(own, 2),
                # The operator's state reads the fake workers answered (and of them, 304s).
                "state_reads": self.fleet.state_reads - reads0,
                "state_reads_not_modified": self.fleet.not_modified - unmodified0,
                # The window the CPU and read figures cover: the operator's start to the end
                # of the rollout (initial fleet, replacements, rollout).
                "window_s": round(time.monotonic() - window0, 1),
                "cluster_pods_at_start": self.pods_at_start,
            }
        finally:
            self.fleet.stop_hostile()
            agent.cancel()
            measure.cancel()
            if self.operator is not None:
                # Under py-spy: SIGINT, on which py-spy writes its profile.
                sig = signal.SIGINT if profile else signal.SIGTERM
                launch.stop_process(self.operator, 10, sig=sig)
            await self.fleet.runner.cleanup()

    async def remove(self) -> None:
        """Scales the engines to none, waits for their pods to go, and deletes the
        namespace: a run's thousand idle pods would load the next run's cluster."""
        for name in ("prefill", "decode"):
            with contextlib.suppress(Exception):  # a Deployment never created
                await asyncio.to_thread(
                    self.apps.patch_namespaced_deployment, name, self.ns, {"spec": {"replicas": 0}}
                )
        await self.until(
            "pods gone", lambda: not self.core.list_namespaced_pod(self.ns, limit=1).items, 300
        )
        with contextlib.suppress(Exception):  # a namespace never made
            await asyncio.to_thread(self.core.delete_namespace, self.ns)


SIDE_BY_SIDE_KEYS = (
    "size",
    "operator",
    "ready_to_connected_p50_s",
    "ready_to_connected_p99_s",
    "gone_to_evicted_p99_s",
    "rollout_converge_s",
    "rollout_control_plane_only_s",
    "rollout_vs_control_plane_only",
    "operator_rss_mb",
    "operator_cpu_s",
    "bench_cpu_s",
    "fleet_requests",
    "fleet_refused",
    "fleet_patches",
    "fleet_patch_items",
    "fleet_patch_items_redundant",
    "fleet_patch_evictions_redundant",
)


def _run_and_remove(size_run: SizeRun, token: Path, workdir: Path) -> dict[str, Any]:
    """One run of a size that shares its cluster with others: its result, its pods and
    namespace removed afterwards (a run's idle pods would load the next one's cluster)."""

    async def one() -> dict[str, Any]:
        try:
            return await size_run.run(token, workdir)
        finally:
            await size_run.remove()

    return asyncio.run(one())


HOSTILE_SIZE = (32, 1000)  # the size the hostile run is measured at (16 x 64 when quick)
HUGE_STATE_BYTES = 16 << 20  # a hostile worker's state answer ("huge")


def run(
    json_path: Path | None,
    quick: bool,
    log: Callable[[str], None] = print,
    baseline_tree: Path | None = None,
    hostile: bool = False,
    sizes: Sequence[tuple[int, int]] | None = None,
    topologies: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Runs each size (16 x 64 only when `quick`; `sizes` when given, as (prefill, decode)
    pairs) and writes the report to `json_path`.
    With `baseline_tree` (a source tree of another commit) each size runs four times on the
    same cluster, the operator of that tree and this one alternating (A B B A, so a drift of
    the machine's speed cancels out); the report's `sizes` are this operator's first runs
    and `side_by_side` lists every run. With `hostile`, only `HOSTILE_SIZE` runs, four times
    on one cluster: clean, hostile, hostile, clean (one decode worker answering garbage and
    one hung, all along); the report's `hostile` compares the healthy engines' ready ->
    connected p99 of the two kinds (`p99_ratio`: hostile over clean, each the mean of its
    two runs)."""
    if hostile:
        return _run_hostile(json_path, quick, log)
    if topologies is not None:
        from kvtopo_bench import topologies as many

        return many.run(json_path, topologies, log)
    from kvtopo.cluster.local_cluster import LocalCluster

    if baseline_tree is not None and not (baseline_tree / "operator" / "kvtopo_operator").is_dir():
        raise RuntimeError(
            f"{baseline_tree} is not a kvtopo source tree (no operator/kvtopo_operator): make "
            "one with `git worktree add DIR COMMIT` or `git archive COMMIT | tar -x -C DIR`"
        )
    from kvtopo_bench import decision

    log("kvtopo bench operator: the decision alone (evaluate), 500 prefill x 1500 decode")
    decided = decision.measure(500, 1500, rounds=3 if quick else 7)
    log("  " + json.dumps(decided))
    if sizes is None:
        sizes = SIZES[:1] if quick else SIZES
    nodes = max(3, (max(p + d for p, d in sizes) * 2) // 100 + 1)
    workdir = Path("out") / "bench-operator"  # beside the drill's, under the working folder
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "token"
    token.write_text("bench\n")
    results = []
    with LocalCluster(workdir / "cluster", "b", fake_nodes=nodes, progress=log) as cluster:
        api = ClusterApi(cluster.kubeconfig)
        api.apply_crd(crd_manifest())
        crd = f"crd/{PLURAL}.{GROUP}"
        cluster.kubectl("wait", "--for=condition=Established", crd, "--timeout=60s")
        side_by_side: list[dict[str, Any]] = []
        for p, d in sizes:
            log(f"kvtopo bench operator: {p} prefill x {d} decode pods on {nodes} kwok nodes")
            if baseline_tree is None:
                # Removed afterwards as in a side by side: the 16 x 64 and 32 x 1,000 runs'
                # 1,096 idle pods loaded the 64 x 2,000 run's cluster until 2026-12-06
                # (its p99 2.65-3.45 s in such runs, 1.56-2.11 s run alone, same tree).
                res = _run_and_remove(SizeRun(cluster, p, d, log), token, workdir)
                log("  " + json.dumps(res))
                results.append(res)
                continue
            first: dict[str, Any] | None = None
            for i, tree in enumerate((baseline_tree, None, None, baseline_tree)):
                which = "baseline" if tree is not None else "this"
                size_run = SizeRun(cluster, p, d, log, operator_tree=tree, run_name=f"{which}{i}")
                res = _run_and_remove(size_run, token, workdir)
                res["operator"] = which
                log(f"  {which}: " + json.dumps(res))
                side_by_side.append({k: res.get(k) for k in SIDE_BY_SIDE_KEYS})
                if first is None and tree is None:
                    first = res
            assert first is not None
            results.append(first)
    report: dict[str, Any] = {
        "benchmark": "operator",
        "quick": quick,
        "decision": decided,
        "sizes": results,
    }
    if baseline_tree is not None:
        report["side_by_side"] = side_by_side
        report["baseline_tree"] = str(baseline_tree)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _run_hostile(json_path: Path | None, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    from kvtopo.cluster.local_cluster import LocalCluster

    p, d = (16, 64) if quick else HOSTILE_SIZE
    nodes = max(3, ((p + d) * 2) // 100 + 1)
    workdir = Path("out") / "bench-operator"
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "token"
    token.write_text("bench\n")
    runs: list[dict[str, Any]] = []
    with LocalCluster(workdir / "cluster", "b", fake_nodes=nodes, progress=log) as cluster:
        api = ClusterApi(cluster.kubeconfig)
        api.apply_crd(crd_manifest())
        crd = f"crd/{PLURAL}.{GROUP}"
        cluster.kubectl("wait", "--for=condition=Established", crd, "--timeout=60s")
        for i, kind in enumerate(("clean", "hostile", "hostile", "clean")):
            log(f"kvtopo bench operator: {p} x {d}, {kind} run {i + 1}/4")
            size_run = SizeRun(cluster, p, d, log, run_name=f"{kind}{i}", hostile=kind == "hostile")
            res = _run_and_remove(size_run, token, workdir)
            log(f"  {kind}: " + json.dumps(res))
            runs.append(res)

    def mean(kind: bool, key: str) -> float:
        values = [float(r[key]) for r in runs if r["hostile"] == kind]
        return sum(values) / len(values)

    clean_p99 = mean(False, "ready_to_connected_p99_s")
    hostile_p99 = mean(True, "ready_to_connected_p99_s")
    clean_rss, hostile_rss = mean(False, "operator_rss_mb"), mean(True, "operator_rss_mb")
    report: dict[str, Any] = {
        "benchmark": "operator",
        "quick": quick,
        "hostile": {
            "size": f"{p}x{d}",
            "workers": "one decode answering garbage, one hung (SIGSTOP-like), one answering "
            f"{HUGE_STATE_BYTES >> 20} MiB states that change on every read, all along",
            "clean_ready_to_connected_p99_s": round(clean_p99, 3),
            "hostile_ready_to_connected_p99_s": round(hostile_p99, 3),
            "p99_ratio": round(hostile_p99 / clean_p99, 3) if clean_p99 else None,
            "target_ratio": 1.2,
            "clean_operator_peak_rss_mb": round(clean_rss, 1),
            "hostile_operator_peak_rss_mb": round(hostile_rss, 1),
            "rss_ratio": round(hostile_rss / clean_rss, 3) if clean_rss else None,
            "target_rss_ratio": 1.2,
            "runs": [
                {
                    k: r.get(k)
                    for k in ("hostile", *SIDE_BY_SIDE_KEYS, "hostile_calls", "huge_reads")
                }
                for r in runs
            ],
        },
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
