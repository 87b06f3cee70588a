"""The drill's stand-in for the kubelet: one real `kvtopo-worker` process per Ready pod.

Owns the engine processes of the drill. It lists the drill's pods (kwok makes them Ready
and gives each a loopback pod IP of its own), starts a `kvtopo-worker` for each Ready pod
(command line and ready line from :mod:`kvtopo.launch`) bound to the pod's IP at the control
port and told its pod's identity (namespace, name, uid), as the downward API tells a real
one, and then writes the port into the pod's `kvtopo.dev/control-endpoint` annotation (the
pod template carries "pending" until then: the engine is not serving yet). The operator
reaches each worker at its pod IP, as in a real cluster. kwok hands a freed pod IP out again
at once, where a real cluster waits for the old pod's sandbox to go: a pod whose IP an
engine still draining holds gets its engine once that one has exited.

When a pod is deleted or stops being Ready, its engine drains like a real one: the fleet
tells the engine to drain (`POST /v1/drain`; from then on the engine itself refuses new
requests with 503 `draining`), collects outcomes until the engine says it is drained (every
request it accepted has ended and its outcome has been collected; requests still held at the
engine's drain deadline fail with reason `shutdown`), and only then stops the process. Also
owns the control-API calls the drill makes to workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvtopo.drill.manifests import VERSION_LABEL
from kvtopo.drill.secrets import DrillSecrets
from kvtopo.launch import parse_ready_line, worker_command
from kvtopo_operator.api import ENDPOINT_ANNOTATION, ROLE_LABEL
from kvtopo_worker.credentials import TokenSource
from kvtopo_worker.protocol import UNHEALTHY
from kvtopo_worker.signing import (
    CallerKey,
    Challenge,
    PrivateKeys,
    parse_challenge,
    route_kind,
)

log = logging.getLogger(__name__)


def _stage_counts(raw: Any) -> dict[str, int]:
    """An engine's abort-stage counts as it reported them (untrusted: bounded, clamped)."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, int] = {}
    for stage, n in list(raw.items())[:32]:
        if isinstance(stage, str) and isinstance(n, int) and 0 < n < 1 << 31:
            out[stage[:64]] = n
    return out


@dataclass
class Engine:
    pod: str
    uid: str
    role: str
    # The worker process the drill runs for a kwok pod; None for a real pod's container,
    # which the kubelet runs (PodFleet).
    process: asyncio.subprocess.Process | None
    pod_ip: str = ""
    version: str = ""  # its pod's version label (the topology pairs engines on it)
    engine_id: str = ""
    endpoint: str = ""
    started_at: float = 0.0
    serving_at: float = 0.0  # when the worker answered and the pod was annotated
    pod_ready: bool = False  # its pod is Ready (with the kv-connected gate: KV can move)
    ready_at: float = 0.0  # when its pod was first seen Ready after it served
    draining_since: float | None = None
    peers: frozenset[str] = frozenset()
    incarnation: str = ""  # its process's boot id (new on every start, the engine id pinned)
    peer_incarnations: dict[str, str] = field(default_factory=dict)  # held peer -> its
    unhealthy: frozenset[str] = frozenset()  # held peers it reports dropped or failing
    in_flight: int = 0
    stopped: bool = False
    frozen: bool = False  # SIGSTOPped by the drill's fault (no traffic is sent to it)
    cordoned: bool = False  # no new traffic (its requests in flight finish and are collected)
    acked: int = 0  # the highest outcome number recorded (acknowledged on the next collect)

    def signal(self, sig: int) -> None:
        """Sends `sig` to the engine's process (a fault the drill injects on kwok pods)."""
        if self.process is None:
            raise RuntimeError(f"{self.pod}: a real container, not a process of the drill's")
        self.process.send_signal(sig)

    def holds(self, peer: Engine) -> bool:
        """Whether it holds `peer` as it is now, as the operator counts one half of a pair:
        not being evicted, `peer`'s current incarnation (a restarted engine keeps its id),
        and healthy (not dropped by NIXL, its transfers not failing)."""
        return (
            peer.engine_id in self.peers
            and peer.engine_id not in self.unhealthy
            and self.peer_incarnations.get(peer.engine_id, "") == peer.incarnation
        )


@dataclass
class Fleet:
    """Engines by pod uid, and the HTTP session used to talk to them."""

    namespace: str
    secrets: DrillSecrets
    log_dir: Path
    worker_args: list[str]
    list_pods: Callable[[], list[dict[str, Any]]]
    annotate: Callable[[str, str], None]
    on_outcomes: Callable[[str, list[dict[str, Any]], float], None]
    on_going: Callable[[str, float], None]
    trace: Callable[..., None] = lambda event, **fields: None
    # A drained engine's count of blocks written after their request ended (its guard).
    on_late_writes: Callable[[str, int], None] = lambda engine_id, n: None
    # A drained engine's abort stages (where the client's aborts found its requests).
    on_abort_stages: Callable[[dict[str, int]], None] = lambda stages: None
    drain_deadline_s: float = 15.0
    engine_drain_s: float = 10.0  # the engine's own deadline: then it fails what it holds
    engines: dict[str, Engine] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    kill_without_drain: bool = False  # fault injection: a crashing decode engine
    control_port: int = 8975  # the KVTopology's controlPort: where each worker listens
    engine: str = "emulated"  # what each worker runs (kvtopo.launch.ENGINE_MODULES)
    start_timeout_s: float = 120.0  # from the process start to its ready line

    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Calls answered 401 and asked again: with the previous client token, or signed for the
    # engine's fresh challenge (its key file rotated).
    auth_fallbacks: int = 0
    # Ready pods that have no engine, and why (shown when the drill times out).
    waiting: dict[str, str] = field(default_factory=dict)
    _auth: TokenSource | None = None
    _signer: CallerKey | None = None
    _challenges: dict[str, Challenge] = field(default_factory=dict)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)  # held until done, so the loop cannot drop it
        task.add_done_callback(self.tasks.discard)

    def _http(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self.session

    async def call(self, method: str, url: str, body: object = None) -> tuple[int, Any]:
        """One call to an engine as the drill's router, with the credentials mounted like
        any pod's: the client token on the traffic routes (a 401 to the current token is
        tried again with the previous one, as every client does during a rotation), and,
        as the drill's observer, the operator's key on the admin routes (the state reads:
        signed for the engine's challenge, asked again once for a fresh one). (status, JSON
        answer or None). Raises what aiohttp raises when the engine cannot be reached."""
        mount = self.secrets.mount("router")
        if self._auth is None:
            self._auth = TokenSource(path=mount.client_token)
        if self._signer is None:
            assert mount.operator_key is not None
            self._signer = CallerKey("operator", PrivateKeys(path=mount.operator_key))
        endpoint, _, path = url.removeprefix("http://").partition("/")
        path = "/" + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        admin = route_kind(path.split("?", 1)[0]) == "admin"
        tries: list[str | None] = [None, None] if admin else list(self._auth.candidates())
        for i, token in enumerate(tries):
            sent = dict(headers)
            if admin:
                held = self._challenges.get(endpoint)
                if held is not None:
                    sent["Authorization"] = self._signer.authorization(
                        held, method, path, endpoint, data or b""
                    )
            else:
                sent["Authorization"] = f"Bearer {token}"
            resp = await self._http().request(
                method, url, data=data, headers=sent, allow_redirects=False
            )
            async with resp:
                if resp.status == 401 and i + 1 < len(tries):
                    fresh = parse_challenge(resp.headers.get("WWW-Authenticate", ""))
                    if admin and (fresh is None or fresh == self._challenges.get(endpoint)):
                        return resp.status, None
                    if admin and fresh is not None:
                        if endpoint in self._challenges:
                            self._count_fallback()  # the engine's keys changed
                        self._challenges[endpoint] = fresh
                    elif not admin:
                        self._count_fallback()
                    continue
                try:
                    answer = await resp.json(content_type=None)
                except ValueError:
                    answer = None
                return resp.status, answer
        raise AssertionError("unreachable")  # pragma: no cover

    def _count_fallback(self) -> None:
        self.auth_fallbacks += 1

    # --- engine life cycle ---------------------------------------------------------------

    async def reconcile_pods(self) -> None:
        pods = await asyncio.to_thread(self.list_pods)
        seen: set[str] = set()
        waiting: dict[str, str] = {}
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            uid = meta["uid"]
            seen.add(uid)
            conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
            # The kubelet's part: the containers run (ContainersReady). The pod's Ready
            # waits for the kv-connected readiness gate, i.e. for the operator.
            up = conditions.get("ContainersReady", conditions.get("Ready")) == "True"
            usable = up and meta.get("deletionTimestamp") is None
            eng = self.engines.get(uid)
            if eng is not None:
                was, eng.pod_ready = eng.pod_ready, conditions.get("Ready") == "True"
                if eng.pod_ready and not was and eng.serving_at and not eng.ready_at:
                    eng.ready_at = time.monotonic()  # the first time it is seen Ready
                    self.trace("pod_ready", pod=eng.pod, engine=eng.engine_id)
            ip = status.get("podIP") or ""
            holder = self._ip_holder(ip) if ip else None
            if eng is None and usable and ip and holder is None:
                await self._start(meta["name"], uid, meta["labels"][ROLE_LABEL], ip)
                self.engines[uid].version = meta["labels"].get(VERSION_LABEL, "")
            elif eng is None and usable:
                waiting[meta["name"]] = (
                    f"its IP {ip} is held by the engine of pod {holder.pod}"
                    f" (draining={holder.draining_since is not None})"
                    if holder is not None
                    else "no pod IP yet"
                )
            elif eng is not None and not usable:
                self._begin_drain(eng)
            elif eng is not None and eng.serving_at and eng.draining_since is None:
                annotated = (meta.get("annotations") or {}).get(ENDPOINT_ANNOTATION)
                if annotated != str(self.control_port):  # a patch was lost (API server down)
                    await asyncio.to_thread(self.annotate, eng.pod, str(self.control_port))
        for uid, eng in list(self.engines.items()):
            if uid not in seen:
                self._begin_drain(eng)
        serving = {e.pod for e in self.engines.values() if e.serving_at}
        for name, why in self.waiting.items():  # a failed start is kept until one serves
            if why.startswith("did not start") and name not in waiting and name not in serving:
                waiting[name] = why
        self.waiting = waiting

    def _ip_holder(self, ip: str) -> Engine | None:
        """The engine of an earlier pod still running at `ip` (kwok reused its IP), if any."""
        return next((e for e in self.engines.values() if e.pod_ip == ip and not e.stopped), None)

    def identity_args(self, pod: str, uid: str, ip: str) -> list[str]:
        """What the downward API gives a real engine: its pod IP to bind, its pod's
        identity."""
        return [
            "--host",
            ip,
            "--port",
            str(self.control_port),
            "--pod-namespace",
            self.namespace,
            "--pod-name",
            pod,
            "--pod-uid",
            uid,
        ]

    async def _exec(self, pod: str, uid: str, role: str, ip: str) -> asyncio.subprocess.Process:
        """Starts the worker process of a pod. Its engine id is pinned to the pod (its uid),
        as an engine that names itself after its pod does: a container restart keeps it."""
        log_path = self.log_dir / f"worker-{pod}.log"
        mount = self.secrets.mount(pod)  # its pod's Secret volumes
        with log_path.open("ab") as log:  # the child keeps its own descriptor
            return await asyncio.create_subprocess_exec(
                *worker_command(
                    role,
                    mount.client_token,
                    "--engine-id",
                    uid.replace("-", ""),
                    *self.worker_args,
                    *self.identity_args(pod, uid, ip),
                    engine=self.engine,
                    operator_key_file=mount.operator_public,
                ),
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )

    async def _start(self, pod: str, uid: str, role: str, ip: str) -> None:
        proc = await self._exec(pod, uid, role, ip)
        eng = Engine(
            pod=pod, uid=uid, role=role, process=proc, pod_ip=ip, started_at=time.monotonic()
        )
        self.engines[uid] = eng
        self._spawn(self._await_serving(eng), f"serve-{pod}")

    async def _await_serving(self, eng: Engine) -> None:
        proc = eng.process
        assert proc is not None and proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=self.start_timeout_s)
            ready = parse_ready_line(line)
        except (TimeoutError, ValueError):
            log_path = self.log_dir / f"worker-{eng.pod}.log"
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            log.error("worker for %s did not start (%s); see %s", eng.pod, tail[0], log_path)
            self.waiting[eng.pod] = f"did not start: {tail[0][:300]}"
            proc.kill()
            self.engines.pop(eng.uid, None)
            return
        eng.engine_id, eng.endpoint = ready.engine_id, ready.endpoint
        eng.incarnation = ready.incarnation
        try:
            await asyncio.to_thread(self.annotate, eng.pod, str(self.control_port))
        except Exception as exc:  # the pod went away meanwhile
            log.info("could not annotate %s: %s", eng.pod, exc)
        eng.serving_at = time.monotonic()
        self.trace("serving", pod=eng.pod, engine=eng.engine_id, role=eng.role)

    async def restart_engine(
        self, eng: Engine, while_down: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> None:
        """A container restart: the engine's process is SIGKILLed and started again in the
        same pod (same pod IP and port, same engine id, a new incarnation); returns once it
        serves again and `while_down` (run from the process's death on, alongside the
        start) has returned. Until then it is not serving (no traffic, not collected): what
        the dead process held ends on its peers, with a reason."""
        eng.serving_at = 0.0
        proc = eng.process
        assert proc is not None, "a real pod's container restarts through the kubelet"
        proc.kill()
        await proc.wait()
        self.trace("killed", pod=eng.pod, engine=eng.engine_id, code=proc.returncode)
        down = asyncio.create_task(while_down()) if while_down is not None else None
        try:
            eng.process = await self._exec(eng.pod, eng.uid, eng.role, eng.pod_ip)
            eng.started_at, eng.acked, eng.in_flight = time.monotonic(), 0, 0
            eng.peers, eng.peer_incarnations, eng.unhealthy = frozenset(), {}, frozenset()
            await self._await_serving(eng)
        finally:
            if down is not None:
                await down
        if not eng.serving_at:
            raise RuntimeError(f"the engine of {eng.pod} did not start again")

    def _begin_drain(self, eng: Engine) -> None:
        if eng.draining_since is not None:
            return
        eng.draining_since = time.monotonic()
        if eng.engine_id:
            self.on_going(eng.engine_id, eng.draining_since)
        self.trace("drain_begin", pod=eng.pod, engine=eng.engine_id, role=eng.role)
        self._spawn(self._drain_and_stop(eng), f"drain-{eng.pod}")

    async def _drain_and_stop(self, eng: Engine) -> None:
        proc = eng.process
        assert proc is not None
        if not (self.kill_without_drain and eng.role == "decode"):
            drained = not eng.endpoint  # an engine that never served holds nothing
            deadline = time.monotonic() + self.drain_deadline_s
            while not drained and proc.returncode is None:
                state = await self.drain(eng)
                if state is not None and state.get("drained"):
                    drained = True
                    self.on_late_writes(eng.engine_id, int(state.get("late_writes") or 0))
                    self.on_abort_stages(_stage_counts(state.get("abort_stages")))
                    break
                await self.collect(eng)
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.1)  # polling the engine's real drain state
            self.trace(
                "drained" if drained else "drain_deadline", pod=eng.pod, engine=eng.engine_id
            )
            if proc.returncode is None:  # not killed by a fault meanwhile
                proc.terminate()
            # Past the deadline the engine still hands out what it ended while it exits.
            exit_by = time.monotonic() + 2 * self.engine_drain_s + 5
            while (
                not drained
                and eng.endpoint
                and proc.returncode is None
                and time.monotonic() < exit_by
            ):
                await self.collect(eng)
                await asyncio.sleep(0.1)  # until the process exits (bounded by its own drain)
        else:
            # The injected fault: the engine dies with requests in flight (their outcomes
            # are never collected, and the drill must notice).
            deadline = time.monotonic() + 5
            while eng.endpoint and eng.in_flight == 0 and time.monotonic() < deadline:
                await self.refresh(eng)
                await asyncio.sleep(0.02)
            proc.kill()
        try:
            await asyncio.wait_for(proc.wait(), timeout=15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        eng.stopped = True
        self.secrets.unmount(eng.pod)
        self.trace("exited", pod=eng.pod, engine=eng.engine_id, code=proc.returncode)
        self.engines.pop(eng.uid, None)

    async def stop_all(self) -> None:
        for eng in list(self.engines.values()):
            self._begin_drain(eng)
        deadline = time.monotonic() + self.drain_deadline_s + 20
        while self.engines and time.monotonic() < deadline:  # noqa: ASYNC110 - polls processes
            await asyncio.sleep(0.1)
        for eng in list(self.engines.values()):
            if eng.process is not None:
                eng.process.kill()
        if self.session is not None:
            await self.session.close()

    # --- state and outcomes --------------------------------------------------------------

    def serving(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.serving_at and e.draining_since is None]

    def routable(self) -> list[Engine]:
        """Serving engines whose pod is Ready: what a router (a Service's endpoints) sends
        requests to. With the kv-connected readiness gate, only engines that move KV."""
        return [e for e in self.serving() if e.pod_ready]

    def all_known(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.serving_at and e.endpoint]

    async def refresh(self, eng: Engine) -> None:
        try:
            status, st = await self.call("GET", f"http://{eng.endpoint}/v1/state")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return
        if status != 200 or not isinstance(st, dict):
            return
        eng.peers = frozenset(p["engine_id"] for p in st["peers"] if not p.get("eviction_pending"))
        eng.incarnation = str(st.get("incarnation") or eng.incarnation)
        eng.peer_incarnations = {p["engine_id"]: str(p.get("incarnation", "")) for p in st["peers"]}
        eng.unhealthy = frozenset(
            p["engine_id"] for p in st["peers"] if p.get("health") in UNHEALTHY
        )
        eng.in_flight = int(st["requests_in_flight"])

    async def collect(self, eng: Engine) -> None:
        """Records the engine's new outcomes, acknowledging those recorded before: an
        answer lost to a timeout (a frozen engine answers late, to nobody) loses nothing,
        its outcomes come again."""
        url = f"http://{eng.endpoint}/v1/finished?ack={eng.acked}"
        try:
            status, outcomes = await self.call("GET", url)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return
        if status != 200 or not isinstance(outcomes, list):
            return
        await self.refresh(eng)
        fresh = [o for o in outcomes if int(o.get("seq", 0)) > eng.acked]
        if fresh:
            eng.acked = max(int(o["seq"]) for o in fresh)
            self.on_outcomes(eng.role, fresh, time.monotonic())

    async def drain(self, eng: Engine) -> dict[str, Any] | None:
        """Tells the engine to drain (idempotent); its drain state, or None unreachable."""
        body = {"timeout_s": self.engine_drain_s}
        try:
            status, state = await self.call("POST", f"http://{eng.endpoint}/v1/drain", body)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        return state if status == 200 and isinstance(state, dict) else None

    async def abort(self, eng: Engine, request_id: str) -> int:
        """Aborts one request on the engine (vLLM's abort: `DELETE /v1/requests/{id}`):
        202 once it is being given up, 404 when the engine no longer holds it."""
        try:
            status, _ = await self.call("DELETE", f"http://{eng.endpoint}/v1/requests/{request_id}")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0
        return status

    async def submit(self, eng: Engine, request_id: str, peer: str, num_blocks: int) -> int:
        body = {"request_id": request_id, "peer_engine_id": peer, "num_blocks": num_blocks}
        try:
            status, _ = await self.call("POST", f"http://{eng.endpoint}/v1/requests", body)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0
        return status
