"""`kvtopo drill`: roll and scale a real P/D deployment while KV flows; prove nothing is lost.

Owns the drill's orchestration: the control plane (local tier b, or `--kubeconfig`), the CRD,
the operator process, prefill/decode Deployments on kwok nodes (`manifests`), the fleet of
real workers (`fleet`), the traffic generator, and the scenario (rollout restarts, scale
down/up, optional chaos). The ledger (`ledger`) keeps the report; `report` shows it and `cli`
runs a drill from the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from kvtopo import launch
from kvtopo.cluster.binaries import find_binary
from kvtopo.cluster.images import ImageSet, repo_root
from kvtopo.drill import manifests
from kvtopo.drill.fleet import Fleet
from kvtopo.drill.gates import GateWatch
from kvtopo.drill.ledger import Ledger
from kvtopo.drill.podfleet import (
    CLIENT_TOKEN_SECRET,
    OPERATOR_KEY_OBJECT,
    PodFleet,
    engine_pod_spec,
)
from kvtopo.drill.secrets import DrillSecrets
from kvtopo.drill.trace import Trace
from kvtopo_operator.api import ENDPOINT_ANNOTATION, GROUP, PLURAL
from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import ClusterApi

log = logging.getLogger(__name__)

ENGINE_FAULTS = ("freeze-decode", "kill-prefill", "restart-engine", "node-failure")
HANG_S = 60.0  # --chaos hang-decode: how long the decode engine stays SIGSTOPped at most
HANG_AFTER_GATE_S = 5.0  # ... and at least this long after a new engine was gated meanwhile
HANG_CONVERGENCE_P99_S = 5.0  # ... and the other engines' convergence p99 limit then
NODE_EVICTION_SLACK_S = 2.0  # --chaos node-failure: evicted within the grace + this
NODE_FAILURE_GRACE_S = 20  # ... on a cluster of its own whose silent node flips this soon
NODE_FLIP_TIMEOUT_S = 120.0  # the controller's node-monitor grace (50 s by default) + slack
# --chaos abort-storm: the share of requests aborted, at random stages on either side
# (more than the 10% the drill requires, as some aborts come after the request ended).
ABORT_STORM_SHARE = 0.3
ABORT_STAGES = (
    "prefill-waiting",
    "decode-queued",
    "prefill-racing",
    "decode-later",
    "prefill-later",
)
REGISTRATION_TIMEOUT_S = 5.0  # the workers' --registration-timeout, --transfer-timeout
GIVE_UP_S = 2 * REGISTRATION_TIMEOUT_S + 2 + 1  # + the cancel margin, + slack

ROTATION_SPREAD_S = 4.0  # each phase of a credential rotation reaches every pod over ~this
# --chaos leader-kill: the replicas' Lease (seconds); the standby takes over within about
# LEASE_S + LEASE_RETRY_S of the leader's death.
LEASE_S = 4
LEASE_RENEW_S = 2.5
LEASE_RETRY_S = 0.5
APP = "drill"
"""The `app` label of the drill's engine pods and the name of its KVTopology."""
CRD_NAME = f"{PLURAL}.{GROUP}"


# Faults of the control plane: while one lasts, no readiness gate can turn True.
CONTROL_PLANE_FAULTS = (
    "operator-kill",
    "apiserver-restart",
    "leader-kill",
    "operator-upgrade",
    "apiserver-stall",
    "clock-skew",
)
# The faults run with two operator replicas electing a leader on a Lease, as the chart runs.
ELECTED = ("leader-kill", "operator-upgrade", "apiserver-stall", "clock-skew")
UPGRADES = 3  # --chaos operator-upgrade: the leader SIGTERMed and replaced this many times
STALLS = 2  # --chaos apiserver-stall: kube-apiserver SIGSTOPped this many times ...
STALL_S = 2 * LEASE_RENEW_S  # ... for twice the renew deadline each
SKEW_S = 90  # --chaos clock-skew: the standby's wall clock is this far ahead


@dataclass
class DrillOptions:
    prefill: int = 2
    decode: int = 4
    rollouts: int = 3
    prefill_rollouts: int = 0
    scale_to: int = 2
    rate: float = 40.0
    max_in_flight: int = 16
    blocks: int = 4
    block_bytes: int = 64 * 1024
    grace: int = 3
    settle_s: float = 4.0
    seed: int = 0
    chaos: str | None = None
    fault: str | None = None
    tp: int = 1
    engine: str = "emulated"  # what runs in each engine pod (kvtopo.launch.ENGINE_MODULES)
    # kwok: fake nodes, one host process per pod, the operator a host process; real: the
    # real node of tier c, the chart's operator and the worker image's pods (podfleet).
    node: str = "kwok"
    kubeconfig: Path | None = None
    # A running LocalCluster to drill on (tests share one; it is left running at the end).
    cluster: Any = None
    workdir: Path = field(default_factory=lambda: Path("out") / "drill")
    json_path: Path | None = None
    plot_path: Path | None = None
    live: bool = True
    timeout_s: float = 600.0


class Drill:
    def __init__(self, opts: DrillOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.rng = random.Random(opts.seed)
        self.ledger = Ledger(t0=time.monotonic())
        self.trace = Trace(opts.workdir / "trace.jsonl", self.ledger.t0)
        self.phase = "starting"
        self.rollout_label = "-"
        self.operator: subprocess.Popen[bytes] | None = None
        self.standby: subprocess.Popen[bytes] | None = None  # leader-kill: the second replica
        self.replicas = 0  # operator replicas started so far (their identities are numbered)
        self.cluster: Any = None
        self.kube: ClusterApi | None = None
        self.fleet: Fleet | None = None
        self.secrets = DrillSecrets(opts.workdir / "secrets")
        self.namespace = "kvtopo-drill"
        self.seq = 0
        self.converged_at: dict[str, float] = {}
        self.traffic_on = False
        self.stop_traffic = asyncio.Event()
        self._serving_log: dict[str, float] = {}  # engine -> when it began serving
        self._aborts: set[asyncio.Task[None]] = set()  # --chaos abort-storm's pending aborts
        if opts.chaos == "abort-storm":
            self.ledger.abort_share = ABORT_STORM_SHARE
        if opts.chaos == "node-failure":
            self.ledger.node_failure_limit_s = opts.grace + NODE_EVICTION_SLACK_S
        if opts.chaos == "hang-decode":
            self.ledger.convergence_p99_limit_s = HANG_CONVERGENCE_P99_S
        self._thaw: asyncio.Task[None] | None = None  # --chaos hang-decode's SIGCONT
        self.gates: GateWatch | None = None

    # --- set-up ----------------------------------------------------------------------------

    def _kubeconfig(self) -> Path:
        if self.opts.kubeconfig is not None:
            return self.opts.kubeconfig
        if self.opts.cluster is not None:
            return Path(self.opts.cluster.kubeconfig)
        from kvtopo.cluster.local_cluster import LocalCluster, Tier

        if self.opts.node == "real":
            self.say(
                "starting the local control plane with a real node (tier c: + containerd and "
                "a kubelet running kvtopo's images)"
            )
            tier: Tier = "c"
        else:
            self.say(
                "starting the local control plane (tier b: etcd, kube-apiserver, "
                "controller manager, scheduler, kwok)"
            )
            tier = "b"
        # --chaos node-failure waits for the node lifecycle controller to give up on the
        # silenced node: its own cluster's grace is 20 s (kwok renews each node's Lease every
        # 5 s), not Kubernetes' 50 s.
        grace = NODE_FAILURE_GRACE_S if self.opts.chaos == "node-failure" else None
        self.cluster = LocalCluster(
            self.opts.workdir / "cluster", tier, progress=self.say, node_grace_s=grace
        )
        self.cluster.up()
        return Path(self.cluster.kubeconfig)

    def _operator_key(self) -> Path:
        """The operator replicas' mounted private key."""
        key = self.secrets.mount("operator").operator_key
        assert key is not None
        return key

    def _start_operator(
        self, kubeconfig: Path, token_file: Path, *, clock_ahead_s: int = 0
    ) -> subprocess.Popen[bytes]:
        """Starts an operator replica (watching Nodes, as the chart's do); with the faults
        of `ELECTED` each replica runs with leader election (a short Lease, so the drill
        sees the take-over), as the chart's replicas do. `clock_ahead_s`: its wall clock
        that far ahead (libfaketime)."""
        extra: list[str] = ["--watch-nodes"]
        log_path = self.opts.workdir / "operator.log"
        if self.opts.chaos in ELECTED:
            self.replicas += 1
            identity = f"operator-{self.replicas}"
            extra += launch.leader_election_args(
                identity, lease_s=LEASE_S, renew_s=LEASE_RENEW_S, retry_s=LEASE_RETRY_S
            )
            log_path = self.opts.workdir / f"{identity}.log"
        args = launch.operator_args(self.namespace, kubeconfig, token_file, 1, *extra)
        env = launch.clock_ahead_env(clock_ahead_s) if clock_ahead_s else None
        # Appended to: the operator restarted by the chaos fault logs on in the same file.
        return launch.start_operator(args, log_path, append=True, env=env)

    async def setup(self) -> None:
        self.opts.workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = await asyncio.to_thread(self._kubeconfig)
        kube = self.kube = await asyncio.to_thread(ClusterApi, kubeconfig)
        self.secrets = DrillSecrets(self.opts.workdir / "secrets")
        token_file = self._operator_key()
        real = self.opts.node == "real"
        if not real:
            self.say("installing the KVTopology CRD")
            await asyncio.to_thread(kube.apply_crd, crd_manifest())
            await self._until("CRD established", lambda: kube.crd_established(CRD_NAME), 30)
        await asyncio.to_thread(kube.create_namespace, self.namespace)
        # Every gate change of the namespace's pods, for `gate_drops_while_connected`.
        self.gates = await asyncio.to_thread(GateWatch(kube, self.namespace).start)
        await self._until(
            "default ServiceAccount",
            lambda: bool(kube.core.list_namespaced_service_account(self.namespace).items),
            60,
        )
        if real:
            await self._install_chart(kube, kubeconfig)
            await self._until("CRD established", lambda: kube.crd_established(CRD_NAME), 30)
        else:
            self.say("starting the operator")
            self.operator = self._start_operator(kubeconfig, token_file)
        if self.opts.chaos in ELECTED:
            skew = SKEW_S if self.opts.chaos == "clock-skew" else 0
            ahead = f" (its wall clock {skew} s ahead)" if skew else ""
            self.say(f"starting a second operator replica{ahead} (leader election on a Lease)")
            await self._until(
                "the first replica holding the Lease", lambda: bool(self._holder()), LEASE_S + 30
            )
            self.standby = self._start_operator(kubeconfig, token_file, clock_ahead_s=skew)
        worker_args = [
            "--num-blocks",
            str(self.opts.blocks * 64),
            "--block-bytes",
            str(self.opts.block_bytes),
            "--registration-timeout",
            str(REGISTRATION_TIMEOUT_S),
            "--kv-lease",
            str(REGISTRATION_TIMEOUT_S),
            "--transfer-timeout",
            str(REGISTRATION_TIMEOUT_S),
            "--tp",
            str(self.opts.tp),
        ]

        def list_pods() -> list[dict[str, Any]]:
            return kube.list_pods(self.namespace, f"app={APP}")

        def annotate(pod: str, endpoint: str) -> None:
            kube.annotate_pod(self.namespace, pod, {ENDPOINT_ANNOTATION: endpoint})

        fleet_class = PodFleet if real else Fleet
        self.fleet = fleet_class(
            namespace=self.namespace,
            secrets=self.secrets,
            log_dir=self.opts.workdir,
            worker_args=worker_args,
            list_pods=list_pods,
            # A real pod's worker is reached at its pod IP: no endpoint annotation.
            annotate=(lambda pod, endpoint: None) if real else annotate,
            on_outcomes=self._record_outcomes,
            on_going=self.ledger.going_away,
            on_late_writes=self._late_writes,
            on_abort_stages=self.ledger.count_abort_stages,
            trace=self.trace,
            kill_without_drain=self.opts.fault == "crash-decode",
            engine=self.opts.engine,
            start_timeout_s=120.0 if self.opts.engine == "emulated" else 300.0,
        )
        where = "on the real node" if real else "on kwok nodes"
        self.say(f"creating the KVTopology and the prefill/decode Deployments {where}")
        body = manifests.topology(
            APP,
            app=APP,
            pair_on=(manifests.VERSION_LABEL,),
            eviction={"graceSeconds": self.opts.grace},
            handshake={"timeoutSeconds": 5},
        )
        await asyncio.to_thread(kube.create_topology, self.namespace, body)
        roles: tuple[tuple[manifests.Role, int], ...] = (
            ("prefill", self.opts.prefill),
            ("decode", self.opts.decode),
        )
        for role, n in roles:
            # The pods list the kv-connected readiness gate: Ready (and counted available by
            # the rollout) only once the operator has connected their engine to its partners.
            pod_spec = (
                engine_pod_spec(self._images().worker, role, worker_args, self.fleet.control_port)
                if real
                else None
            )
            deployment = manifests.engine_deployment(
                role,
                app=APP,
                role=role,
                replicas=n,
                min_ready_seconds=3,
                kv_gate=True,
                endpoint=None if real else manifests.ENDPOINT_PENDING,
                pod_spec=pod_spec,
            )
            await asyncio.to_thread(
                kube.apps.create_namespaced_deployment, self.namespace, deployment
            )

    def _images(self) -> ImageSet:
        cluster = self.cluster or self.opts.cluster
        if cluster is None or cluster.images is None:
            raise RuntimeError("--node real runs on the local tier-c cluster (no --kubeconfig)")
        images: ImageSet = cluster.images
        return images

    async def _install_chart(self, kube: ClusterApi, kubeconfig: Path) -> None:
        """`helm install` of the chart with its defaults (two operator replicas, leader
        election), the operator image built here, and the drill's key pair as the existing
        Secret and ConfigMap (so the drill's observer signs what the workers verify); the
        client token as the Secret the engine pods mount."""
        images = self._images()
        mount = self.secrets.mount("router")
        assert mount.operator_key is not None
        ns = self.namespace
        key = {"name": OPERATOR_KEY_OBJECT}
        await asyncio.to_thread(
            kube.core.create_namespaced_secret,
            ns,
            {"metadata": key, "stringData": {"operator.key": mount.operator_key.read_text()}},
        )
        await asyncio.to_thread(
            kube.core.create_namespaced_config_map,
            ns,
            {"metadata": key, "data": {"operator.pem": mount.operator_public.read_text()}},
        )
        await asyncio.to_thread(
            kube.core.create_namespaced_secret,
            ns,
            {
                "metadata": {"name": CLIENT_TOKEN_SECRET},
                "stringData": {"token": mount.client_token.read_text().split()[0]},
            },
        )
        repository, _, tag = images.operator.rpartition(":")
        home = self.opts.workdir / "helm"
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        argv = [
            str(find_binary("helm")), "install", "kvtopo", str(repo_root() / "helm" / "kvtopo"),
            "--namespace", ns,
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            "--set", f"operatorKey.existingSecret={OPERATOR_KEY_OBJECT}",
            "--set", f"operatorKey.existingConfigMap={OPERATOR_KEY_OBJECT}",
            "--wait", "--timeout", "300s",
        ]  # fmt: skip
        self.say("helm install of the chart (two operator replicas, leader election)")
        result = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, env=env, timeout=330, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"helm install failed: {result.stderr.strip()[-2000:]}")

    def _late_writes(self, engine_id: str, n: int) -> None:
        if n:
            self.trace("late_writes", engine=engine_id, blocks=n)
        self.ledger.late_writes += n

    async def _abort_later(self, rid: str, eng: Any, delay: float) -> None:
        """--chaos abort-storm: aborts `rid` on `eng` after `delay` (a random stage: before
        or with its registration, while its KV waits, during or after its WRITE)."""
        await asyncio.sleep(delay)
        assert self.fleet is not None
        status = await self.fleet.abort(eng, rid)
        self.trace("abort", rid=rid, engine=eng.engine_id, answer=status)
        if status == 202:
            self.ledger.aborted.add(rid)

    def _record_outcomes(self, role: str, outcomes: list[dict[str, Any]], t: float) -> None:
        for outcome in outcomes:
            self.trace(
                "outcome",
                rid=outcome.get("request_id"),
                side=role,
                status=outcome.get("status"),
                reason=outcome.get("reason"),
            )
            self.ledger.outcome(role, outcome, t)

    async def _until(
        self,
        what: str,
        probe: Callable[[], bool],
        limit_s: float,
        describe: Callable[[], str] | None = None,
    ) -> None:
        # A vLLM engine takes tens of seconds to start (importing vLLM), several at once on
        # a small machine minutes: every wait that may hang on engines starting gets that.
        limit_s += 0.0 if self.opts.engine == "emulated" else 300.0
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                if await asyncio.to_thread(probe):
                    return
            except Exception as exc:  # the API server may be restarting (chaos)
                log.info("waiting for %s: %s", what, exc)
            await asyncio.sleep(0.2)
        detail = ""
        if describe is not None:
            try:
                detail = "\n" + await asyncio.to_thread(describe)
            except Exception as exc:
                detail = f"\n(could not describe the state: {exc})"
        raise TimeoutError(f"timed out after {limit_s:.0f}s waiting for {what}{detail}")

    # --- background loops ------------------------------------------------------------------

    async def pods_loop(self) -> None:
        assert self.fleet is not None
        while True:
            try:
                await self.fleet.reconcile_pods()
            except Exception as exc:  # the API server may be restarting (chaos)
                log.info("listing pods: %s", exc)
            # Often enough to time engine serving -> pod Ready (the gate) to about 0.1 s.
            await asyncio.sleep(0.1)

    async def sample_loop(self) -> None:
        fleet = self.fleet
        assert fleet is not None
        while True:
            known = fleet.all_known()
            # A frozen engine answers nothing until it thaws (its outcomes are collected
            # then): waiting for it would stall every sample by the call's timeout.
            await asyncio.gather(*(fleet.collect(e) for e in known if not e.frozen))
            now = time.monotonic()
            serving = fleet.serving()
            pairs = frozenset(
                (p.engine_id, d.engine_id)
                for p in serving
                if p.role == "prefill"
                for d in serving
                if d.role == "decode"
                if p.holds(d) and d.holds(p)  # the current incarnations, healthy
            )
            self.ledger.sample(now, pairs)
            # The readiness gate: from the moment the engine can be connected (it serves,
            # and so does a partner: an engine of the other role and the same version) to
            # its pod seen Ready. Before a partner serves, no gate can turn True.
            for e in serving:
                if e.ready_at and e.engine_id not in self.ledger.gate_seen:
                    self.ledger.gate_seen.add(e.engine_id)
                    partners = [
                        o.serving_at
                        for o in fleet.engines.values()
                        if o.role != e.role
                        and o.version == e.version
                        and o.serving_at
                        and o.serving_at <= e.ready_at
                    ]
                    if partners:
                        up = max(e.serving_at, min(partners))
                        self.ledger.gate.append((e.engine_id, up, e.ready_at))
            # Convergence: a serving engine with all of its pairs connected.
            for e in serving:
                if e.engine_id in self.converged_at:
                    continue
                others = [o for o in serving if o.role != e.role]
                if others and all(
                    (
                        (e.engine_id, o.engine_id)
                        if e.role == "prefill"
                        else (o.engine_id, e.engine_id)
                    )
                    in pairs
                    for o in others
                ):
                    # From the engine serving (its pod annotated) to all pairs Connected.
                    self.converged_at[e.engine_id] = now
                    self.ledger.convergence.append((e.engine_id, now - e.serving_at))
            # Eviction: a gone engine no longer held by any other worker.
            measured = {eid for eid, _ in self.ledger.eviction}
            for eid, since in self.ledger.going.items():
                if eid in measured:
                    continue
                holders = [o for o in known if o.engine_id != eid and eid in o.peers]
                if not holders and now - since > 0:
                    self.ledger.eviction.append((eid, now - since))
            await asyncio.sleep(0.2)

    def _spawn_abort(self, rid: str, eng: Any, delay: float) -> None:
        task = asyncio.create_task(self._abort_later(rid, eng, delay))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def traffic_loop(self) -> None:
        fleet = self.fleet
        assert fleet is not None
        interval = 1.0 / self.opts.rate
        while not self.stop_traffic.is_set():
            await asyncio.sleep(interval)
            if not self.traffic_on or self.ledger.in_flight() >= self.opts.max_in_flight:
                continue
            if not self.ledger.samples_pairs:
                continue
            # Like a router behind a Service: only engines whose pod is Ready (the gate).
            serving = {e.engine_id: e for e in fleet.routable() if not e.frozen and not e.cordoned}
            pairs = sorted(
                p for p in self.ledger.samples_pairs[-1] if p[0] in serving and p[1] in serving
            )
            if not pairs:
                continue
            pid, did = self.rng.choice(pairs)
            self.seq += 1
            rid = f"drill-{self.opts.seed}-{self.seq}"
            stage = ""
            if self.opts.chaos == "abort-storm" and self.rng.random() < ABORT_STORM_SHARE:
                stage = self.rng.choice(ABORT_STAGES)
            status = await fleet.submit(serving[pid], rid, did, self.opts.blocks)
            self.trace("submit", rid=rid, side="prefill", engine=pid, answer=status)
            if status != 202:  # e.g. 503 draining: pick another pair next time
                continue
            # Booked before the decode side is asked: its outcome can be collected before
            # the answer to this very call arrives.
            self.ledger.submitted(rid, pid, did, time.monotonic())
            self.trace("booked", rid=rid, prefill=pid, decode=did)
            if stage == "prefill-waiting":  # its KV waits for a registration not sent yet
                await self._abort_later(rid, serving[pid], 0.0)
            status = await fleet.submit(serving[did], rid, pid, self.opts.blocks)
            self.trace("submit", rid=rid, side="decode", engine=did, answer=status)
            if status != 202:  # refused (503 draining): it never started on the decode side
                self.ledger.withdraw(rid)
            elif stage == "decode-queued":  # its registration queued or just sent
                await self._abort_later(rid, serving[did], 0.0)
            elif stage == "prefill-racing":  # the registration is on its way to the prefill
                await self._abort_later(rid, serving[pid], 0.0)
            elif stage:  # later, on either side: while or after its KV is written
                side = serving[did] if stage == "decode-later" else serving[pid]
                self._spawn_abort(rid, side, self.rng.uniform(0.0005, 0.02))

    # --- the scenario ----------------------------------------------------------------------

    def _deploy_state(self, name: str) -> tuple[bool, int]:
        assert self.kube is not None
        return manifests.rolled_out(self.kube.apps.read_namespaced_deployment(name, self.namespace))

    async def converged(self, timeout: float = 120) -> None:  # noqa: ASYNC109
        """Deployments rolled out, one serving engine per pod, no engine draining, every pair
        connected, and the KVTopology Ready."""
        assert self.fleet is not None and self.kube is not None
        fleet, kube = self.fleet, self.kube

        def check() -> bool:
            dp, np_ = self._deploy_state("prefill")
            dd, nd = self._deploy_state("decode")
            serving = fleet.serving()
            if not (dp and dd) or any(e.draining_since for e in fleet.engines.values()):
                return False
            if (
                sum(e.role == "prefill" for e in serving) != np_
                or sum(e.role == "decode" for e in serving) != nd
            ):
                return False
            if not self.ledger.samples_pairs or len(self.ledger.samples_pairs[-1]) != np_ * nd:
                return False
            obj = kube.read_topology(self.namespace, APP) or {}
            conds = (obj.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        def describe() -> str:
            lines = []
            for name in ("prefill", "decode"):
                d = kube.apps.read_namespaced_deployment(name, self.namespace)
                st = d.status
                lines.append(
                    f"deployment {name}: replicas {d.spec.replicas}, updated "
                    f"{st.updated_replicas}, available {st.available_replicas}, total {st.replicas}"
                )
            for e in fleet.engines.values():
                lines.append(
                    f"engine {e.pod} {e.role} {e.engine_id[:8]} serving={bool(e.serving_at)} "
                    f"draining={e.draining_since is not None} peers={len(e.peers)}"
                )
            for pod, why in fleet.waiting.items():
                lines.append(f"pod {pod} has no engine: {why}")
            pairs = self.ledger.samples_pairs[-1] if self.ledger.samples_pairs else frozenset()
            lines.append(f"connected pairs in the last sample: {len(pairs)}")
            obj = kube.read_topology(self.namespace, APP) or {}
            status = obj.get("status") or {}
            lines.append(f"KVTopology summary {status.get('summary')}")
            for c in status.get("conditions") or []:
                lines.append(f"  {c['type']}={c['status']} {c['reason']}: {c.get('message', '')}")
            lines.append(f"operator log: {self.opts.workdir / 'operator.log'}")
            return "\n".join(lines)

        await self._until("the topology to converge", check, timeout, describe)

    async def _restart(self, name: str) -> None:
        assert self.kube is not None
        patch = manifests.rollout_restart_patch(datetime.now(UTC))
        await asyncio.to_thread(
            self.kube.apps.patch_namespaced_deployment, name, self.namespace, patch
        )

    async def _scale(self, name: str, replicas: int) -> None:
        assert self.kube is not None
        await asyncio.to_thread(
            self.kube.apps.patch_namespaced_deployment_scale,
            name,
            self.namespace,
            {"spec": {"replicas": replicas}},
        )

    async def _chaos(self) -> None:
        await asyncio.sleep(1.0)  # let the rollout get going before the fault
        t = time.monotonic()
        if self.opts.chaos == "operator-kill" and self.operator is not None:
            self.ledger.mark(t, "chaos", "operator SIGKILL")
            self.operator.send_signal(signal.SIGKILL)
            self.operator.wait(10)
            await asyncio.sleep(2.0)  # the operator stays down a while: that is the fault
            assert self.kube is not None
            kubeconfig = self.opts.kubeconfig or Path(self.cluster.kubeconfig)
            self.operator = self._start_operator(kubeconfig, self._operator_key())
            self.ledger.mark(time.monotonic(), "chaos", "operator restarted")
        elif self.opts.chaos == "leader-kill":
            await self._kill_leader(t)
        elif self.opts.chaos == "operator-upgrade":
            for n in range(UPGRADES):
                await self._replace_leader(f"upgrade {n + 1}/{UPGRADES}")
        elif self.opts.chaos == "clock-skew":
            await self._replace_leader(f"the standby {SKEW_S} s ahead takes over")
        elif self.opts.chaos == "apiserver-stall":
            cluster = self.cluster or self.opts.cluster
            if cluster is None:
                raise RuntimeError("--chaos apiserver-stall needs the drill's own control plane")
            for n in range(STALLS):
                self.ledger.mark(time.monotonic(), "chaos", f"kube-apiserver SIGSTOP {n + 1}")
                took = await asyncio.to_thread(cluster.pause_component, "kube-apiserver", STALL_S)
                self.ledger.mark(time.monotonic(), "chaos", f"kube-apiserver SIGCONT ({took} s)")
                await asyncio.sleep(2 * LEASE_S)  # a leader again before the next stall
        elif self.opts.chaos == "rotate-credentials":
            assert self.fleet is not None

            def mark(what: str) -> None:
                self.ledger.mark(time.monotonic(), "chaos", what)

            await self.secrets.rotate(ROTATION_SPREAD_S, self.rng, mark)
            fallbacks = self.fleet.auth_fallbacks
            mark(
                f"rotation done; the router asked {fallbacks} calls again (a fresh challenge "
                "or the previous token)"
            )
        elif self.opts.chaos == "hang-decode":
            self._hang_decode(t)
        elif self.opts.chaos == "apiserver-restart" and self.cluster is not None:
            self.ledger.mark(t, "chaos", "kube-apiserver restart")
            took = await asyncio.to_thread(self.cluster.restart_apiserver)
            self.ledger.mark(time.monotonic(), "chaos", f"kube-apiserver back ({took:.1f}s)")

    def _holder(self) -> str:
        """Who holds the operators' Lease now ("" when nobody)."""
        assert self.kube is not None
        lease = self.kube.custom.get_namespaced_custom_object(
            "coordination.k8s.io", "v1", self.namespace, "leases", "kvtopo-operator"
        )
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    async def _kill_leader(self, t: float) -> None:
        """SIGKILLs the replica holding the Lease mid-rollout; the standby must take over and
        the topology converge within the Lease duration + 5 s. The dead replica is started
        again afterwards (as its Deployment would), to stand by."""
        assert self.operator is not None and self.standby is not None
        holder = await asyncio.to_thread(self._holder)
        replicas = {self._identity(p): p for p in (self.operator, self.standby)}
        if holder not in replicas:
            raise RuntimeError(f"no operator replica holds the Lease (holder: {holder!r})")
        leader = replicas.pop(holder)
        (standby_id, standby) = next(iter(replicas.items()))
        self.ledger.mark(t, "chaos", f"SIGKILL the leader {holder} ({standby_id} stands by)")
        leader.send_signal(signal.SIGKILL)
        await asyncio.to_thread(leader.wait, 10)
        killed = time.monotonic()
        await self._until(
            "the standby holding the Lease",
            lambda: self._holder() == standby_id,
            LEASE_S + 10,
        )
        leads = time.monotonic()
        self.ledger.mark(leads, "chaos", f"{standby_id} leads ({leads - killed:.1f} s)")
        await self._until(
            "the new leader to connect every pair of serving engines",
            lambda: self._caught_up(after=leads),
            LEASE_S + 30,
        )
        took = time.monotonic() - killed
        self.ledger.mark(
            time.monotonic(), "chaos", f"every pair connected {took:.1f} s after the kill"
        )
        self.ledger.leader_takeover_s.append(took)
        await self.converged()  # the rollout goes on: it finishes under the new leader
        assert self.kube is not None
        kubeconfig = self.opts.kubeconfig or Path(self.cluster.kubeconfig)
        self.operator = standby
        self.standby = self._start_operator(kubeconfig, self._operator_key())
        self.ledger.mark(time.monotonic(), "chaos", "the killed replica restarted as standby")

    async def _replace_leader(self, label: str) -> None:
        """What a Deployment's rolling update does to the leader (`helm upgrade`): a new
        replica starts and stands by, then the leader gets SIGTERM (it releases the Lease)
        and a standby takes over. Nothing any replica controls may change meanwhile (the
        gates: `gate_drops_while_connected`)."""
        assert self.operator is not None and self.standby is not None
        kubeconfig = self.opts.kubeconfig or Path(self.cluster.kubeconfig)
        holder = await asyncio.to_thread(self._holder)
        replicas = {self._identity(p): p for p in (self.operator, self.standby)}
        if holder not in replicas:
            raise RuntimeError(f"no operator replica holds the Lease (holder: {holder!r})")
        leader = replicas.pop(holder)
        standby = next(iter(replicas.values()))
        surge = None
        if self.opts.chaos == "operator-upgrade":  # the new pod first (maxSurge)
            surge = self._start_operator(kubeconfig, self._operator_key())
            await asyncio.sleep(2.0)  # it starts, lists and watches (its readiness)
        t = time.monotonic()
        self.ledger.mark(t, "chaos", f"{label}: SIGTERM the leader {holder}")
        leader.send_signal(signal.SIGTERM)
        await asyncio.to_thread(leader.wait, 30)
        await self._until(
            "a standby holding the Lease",
            lambda: self._holder() not in ("", holder),
            LEASE_S + 10,
        )
        leads = time.monotonic()
        new_holder = await asyncio.to_thread(self._holder)
        self.ledger.mark(leads, "chaos", f"{new_holder} leads ({leads - t:.1f} s)")
        self.ledger.leader_takeover_s.append(leads - t)
        if surge is None:  # the stopped replica's pod comes back, standing by
            surge = self._start_operator(kubeconfig, self._operator_key())
        self.operator, self.standby = standby, surge
        if self._identity(surge) == new_holder:
            self.operator, self.standby = surge, standby

    def _caught_up(self, after: float) -> bool:
        """Whether a connectivity sample taken after `after` shows every pair the topology
        wants among the serving engines (same version label) connected both ways."""
        assert self.fleet is not None
        if not self.ledger.samples_t or self.ledger.samples_t[-1] <= after:
            return False
        serving = [e for e in self.fleet.serving() if not e.frozen]
        wanted = {
            (p.engine_id, d.engine_id)
            for p in serving
            if p.role == "prefill"
            for d in serving
            if d.role == "decode" and d.version == p.version
        }
        return bool(wanted) and wanted <= self.ledger.samples_pairs[-1]

    def _identity(self, replica: subprocess.Popen[bytes]) -> str:
        args = [str(a) for a in replica.args]  # type: ignore[union-attr]
        flag = next(a for a in args if a.startswith("--leader-elect-identity="))
        return flag.split("=", 1)[1]

    def _hang_decode(self, t: float) -> None:
        """hang-decode: one serving decode engine is SIGSTOPped while the rollout goes on
        (hung, not dead: its sockets accept and nothing answers), until a new engine was
        gated meanwhile and `HANG_AFTER_GATE_S` more, at most `HANG_S`; the operator must
        decide about every other engine as fast as without it."""
        assert self.fleet is not None
        decodes = [e for e in self.fleet.serving() if e.role == "decode" and not e.frozen]
        if not decodes:
            raise RuntimeError("no serving decode engine to hang")
        victim = self.rng.choice(decodes)
        victim.frozen = True
        victim.signal(signal.SIGSTOP)
        self.ledger.mark(
            t,
            "chaos",
            f"SIGSTOP decode {victim.pod} until a new engine is gated and {HANG_AFTER_GATE_S:g} s "
            f"more (at most {HANG_S:g} s)",
        )
        self.ledger.impair(victim.engine_id, t, t + HANG_S + GIVE_UP_S)

        async def thaw() -> None:
            # The fault lasts until an engine that began serving during it was gated (its
            # pod Ready: the operator connected it while one of its peers hung) and a few
            # rounds more, at most `HANG_S`: what follows (the Deployment waits for the hung
            # pod to go) tests nothing more, and took a minute of every suite run.
            assert self.fleet is not None
            fleet = self.fleet
            deadline = t + HANG_S
            gated_at: float | None = None
            try:
                while time.monotonic() < deadline:
                    if gated_at is None:
                        gated_at = next(
                            (
                                e.ready_at
                                for e in fleet.engines.values()
                                if e is not victim and e.serving_at > t and e.ready_at
                            ),
                            None,
                        )
                    elif time.monotonic() >= gated_at + HANG_AFTER_GATE_S:
                        break
                    await asyncio.sleep(0.1)  # polling the fleet's own gate records
            finally:
                with contextlib.suppress(ProcessLookupError):
                    victim.signal(signal.SIGCONT)
                victim.frozen = False
                now = time.monotonic()
                self.ledger.impair_until(victim.engine_id, t, min(now, deadline) + GIVE_UP_S)
                meanwhile = (
                    f"a new engine gated {now - gated_at:.1f} s before"
                    if gated_at is not None
                    else "no new engine gated meanwhile"
                )
                self.ledger.mark(now, "chaos", f"SIGCONT decode {victim.pod} ({meanwhile})")

        self._thaw = asyncio.create_task(thaw(), name="hang-decode-thaw")

    def _cut_off(self, node: str, cut: bool) -> None:
        """Cuts the kubelet of fake node `node` (kwok, which plays every node's) off the API
        server, or lets it back: a ValidatingAdmissionPolicy refuses its Lease renewals and
        any write to the node's or its pods' status by anyone but the node lifecycle
        controller. kwok itself runs on for the other nodes."""
        assert self.kube is not None
        base = "/apis/admissionregistration.k8s.io/v1"
        name = "kvtopo-drill-node-failure"
        if not cut:
            for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
                with contextlib.suppress(Exception):  # already gone
                    self.kube.request("DELETE", f"{base}/{kind}/{name}")
            return
        controller = "system:serviceaccount:kube-system:node-controller"
        rules = [
            {
                "apiGroups": ["coordination.k8s.io"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["leases"],
            },
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["UPDATE"],
                "resources": ["nodes", "nodes/status", "pods/status"],
            },
        ]
        silent = (
            f"!(request.resource.resource == 'leases' && object.metadata.name == '{node}')"
            f" && (request.userInfo.username == '{controller}'"
            f" || !(request.resource.resource == 'nodes' && object.metadata.name == '{node}')"
            f" && !(request.resource.resource == 'pods' && object.spec.nodeName == '{node}'))"
        )
        policy = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": rules},
                "validations": [{"expression": silent, "message": f"node {node} is down"}],
            },
        }
        binding = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        }
        self.kube.request("POST", f"{base}/validatingadmissionpolicies", body=policy)
        self.kube.request("POST", f"{base}/validatingadmissionpolicybindings", body=binding)

    async def _node_failure(self) -> None:
        """node-failure: a fake node fails while traffic flows. Its engines' processes are
        SIGKILLed and its kubelet is cut off (`_cut_off`); the node lifecycle
        controller flips the node's Ready to Unknown once its heartbeats are overdue
        (20 s on the drill's own cluster, Kubernetes' 50 s on one given) and marks
        its pods not Ready (their ContainersReady, last reported by the silent
        kubelet, stays True; the pods are only deleted by the taint eviction,
        minutes later). From that flip, the operator must evict those engines from
        every peer within the grace + 2 s. Then the pods are deleted (as an
        administrator does for a node that is gone) and the node comes back."""
        assert self.fleet is not None and self.kube is not None
        fleet, kube = self.fleet, self.kube
        self.phase = "chaos: node-failure"
        pods = await asyncio.to_thread(kube.core.list_namespaced_pod, self.namespace)
        node_of = {p.metadata.name: p.spec.node_name for p in pods.items if p.spec.node_name}
        serving = [e for e in fleet.serving() if not e.frozen and e.pod in node_of]
        prefills = sum(e.role == "prefill" for e in serving)
        by_node: dict[str, list[Any]] = {}
        for e in serving:
            by_node.setdefault(node_of[e.pod], []).append(e)
        # A node with a decode engine that does not hold every prefill (traffic goes on).
        candidates = sorted(
            (sum(e.role == "prefill" for e in es), node)
            for node, es in by_node.items()
            if any(e.role == "decode" for e in es)
            and sum(e.role == "prefill" for e in es) < prefills
        )
        if not candidates:
            raise RuntimeError(f"no node to fail: engines by node {sorted(by_node)}")
        node = candidates[0][1]
        victims = by_node[node]
        # What this fault measures is the eviction, not the requests a dying node takes
        # with it (their decode side never answers: the ledger could only call them lost):
        # the node's engines get no new traffic, and those in flight finish first.
        for e in victims:
            e.cordoned = True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            await asyncio.gather(*(fleet.refresh(e) for e in victims))
            if all(e.in_flight == 0 for e in victims):
                break
            await asyncio.sleep(0.05)  # polling the engines' own in-flight counts
        await asyncio.gather(*(fleet.collect(e) for e in victims))
        # The kubelet goes first (a real node's dies with its engines): nothing but the node
        # lifecycle controller may write its pods' status from now on, not kwok answering a
        # gate the operator turns False. The policy takes a moment to apply: a dry-run write
        # of a victim's status tells when it does.
        await asyncio.to_thread(self._cut_off, node, True)

        def cut() -> bool:
            try:
                kube.request(
                    "PATCH",
                    f"/api/v1/namespaces/{self.namespace}/pods/{victims[0].pod}/status",
                    query=[("dryRun", "All")],
                    body={"metadata": {"annotations": {"kvtopo.dev/drill-probe": "x"}}},
                    content_type="application/merge-patch+json",
                )
            except Exception as exc:
                return "is down" in str(getattr(exc, "body", "") or exc)
            return False

        await self._until("the node's kubelet cut off", cut, 30)
        t = time.monotonic()
        names = ", ".join(f"{e.role} {e.pod}" for e in victims)
        self.ledger.mark(t, "chaos", f"node {node} fails: SIGKILL {names}; its kubelet stops")
        for e in victims:
            e.frozen = True  # no more traffic to it
            self.ledger.going_away(e.engine_id, t)
            self.ledger.impair(e.engine_id, t, t + NODE_FLIP_TIMEOUT_S + GIVE_UP_S)
            with contextlib.suppress(ProcessLookupError):
                e.signal(signal.SIGKILL)

        def flipped() -> bool:
            obj = kube.core.read_node_status(node)
            conds = {c.type: c.status for c in obj.status.conditions or []}
            return conds.get("Ready") != "True"

        await self._until("the node's Ready to flip", flipped, NODE_FLIP_TIMEOUT_S)
        flip = time.monotonic()
        self.ledger.mark(flip, "chaos", f"node {node} Ready flipped ({flip - t:.1f} s)")
        lost = {e.engine_id for e in victims}
        deadline = flip + 60
        while True:  # polling the peers' own registries (their /v1/state)
            holders = []
            for o in [o for o in fleet.serving() if not o.frozen]:
                try:
                    status, state = await fleet.call("GET", f"http://{o.endpoint}/v1/state")
                except (aiohttp.ClientError, TimeoutError, OSError):
                    status, state = 0, None
                held = {p.get("engine_id") for p in (state or {}).get("peers", [])}
                if status != 200 or lost & held:
                    holders.append(o.pod)
            if not holders:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the lost node's engines are still held 60 s after the flip by {holders}"
                )
            await asyncio.sleep(0.05)
        took = time.monotonic() - flip
        self.ledger.node_failure_evicted_s.append(took)
        self.ledger.mark(
            time.monotonic(), "chaos", f"its engines evicted {took:.1f} s after the flip"
        )
        for e in victims:
            await asyncio.to_thread(
                kube.core.delete_namespaced_pod, e.pod, self.namespace, grace_period_seconds=0
            )
        await asyncio.to_thread(self._cut_off, node, False)
        self.ledger.mark(time.monotonic(), "chaos", f"pods deleted; node {node} back")

    async def _engine_fault(self) -> None:
        """freeze-decode, kill-prefill or restart-engine, struck while traffic flows."""
        assert self.fleet is not None and self.kube is not None
        if self.opts.chaos == "node-failure":
            fault = time.monotonic()
            await self._node_failure()
            await self.converged()
            self.ledger.chaos_recovery_s.append(time.monotonic() - fault)
            return
        fleet = self.fleet
        role = "decode" if self.opts.chaos == "freeze-decode" else "prefill"
        self.phase = f"chaos: {self.opts.chaos}"
        # An engine of the role with requests in flight (a fault on an idle engine tests
        # nothing); the traffic keeps them coming.
        victim = None
        deadline = time.monotonic() + 10
        while victim is None and time.monotonic() < deadline:
            busy = [e for e in fleet.serving() if e.role == role and e.in_flight > 0]
            victim = self.rng.choice(busy) if busy else None
            if victim is None:
                await asyncio.sleep(0.05)  # polling the workers' own in-flight counts
        if victim is None:
            raise RuntimeError(f"no {role} engine had requests in flight to strike")
        # Requests that are surely held when the fault strikes: their decode side has
        # registered them, their prefill side has no KV for them yet (still computing).
        others = [e for e in fleet.serving() if e.role != role and not e.frozen]
        parked = await self._park(victim, others)
        t = time.monotonic()
        if self.opts.chaos == "restart-engine":
            await self._restart_engine(victim, others, len(parked))
        elif self.opts.chaos == "freeze-decode":
            freeze_s = 2 * REGISTRATION_TIMEOUT_S
            self.ledger.mark(
                t, "chaos", f"SIGSTOP decode {victim.pod} for {freeze_s:g} s ({len(parked)} parked)"
            )
            victim.frozen = True
            victim.signal(signal.SIGSTOP)
            try:
                # Half the parked requests get their KV while the decode is frozen: their
                # WRITEs land in a stopped process, their completions wait for it.
                for rid, prefill, _ in parked[::2]:
                    status = await fleet.submit(prefill, rid, victim.engine_id, self.opts.blocks)
                    self.trace(
                        "submit", rid=rid, side="prefill", engine=prefill.engine_id, answer=status
                    )
                await asyncio.sleep(freeze_s)  # the fault's length
            finally:
                victim.signal(signal.SIGCONT)
                victim.frozen = False
            resumed = time.monotonic()
            self.ledger.mark(resumed, "chaos", f"SIGCONT decode {victim.pod}")
            # Its requests may fail until the last of them has been given up.
            self.ledger.impair(victim.engine_id, t, resumed + GIVE_UP_S)
        else:
            # WRITEs surely in flight: one decode stops for a moment, and the prefill gets
            # the KV of that decode's parked requests; their WRITEs cannot finish into a
            # stopped process (UCX needs the receiver's progress), so the kill meets them.
            hold = parked[0][2] if parked else None
            writing = 0
            if hold is not None:
                hold.frozen = True
                hold.signal(signal.SIGSTOP)
                self.ledger.mark(t, "chaos", f"SIGSTOP decode {hold.pod} (WRITEs stall)")
                for rid, _, decode in parked:
                    if decode is hold:
                        await fleet.submit(victim, rid, hold.engine_id, self.opts.blocks)
                writing = await self._writes_in_flight(victim, hold.engine_id)
            held = victim.in_flight + len(parked)
            t = time.monotonic()
            self.ledger.mark(
                t, "chaos", f"SIGKILL prefill {victim.pod} ({held} held, {writing} WRITEs)"
            )
            self.ledger.going_away(victim.engine_id, t)
            self.ledger.impair(victim.engine_id, t, t + GIVE_UP_S)
            victim.signal(signal.SIGKILL)
            if hold is not None:
                hold.signal(signal.SIGCONT)
                hold.frozen = False
                resumed = time.monotonic()
                self.ledger.mark(resumed, "chaos", f"SIGCONT decode {hold.pod}")
                self.ledger.impair(hold.engine_id, t, resumed + GIVE_UP_S)
            # The kubelet would report the container dead; the drill replaces the pod.
            await asyncio.to_thread(
                self.kube.core.delete_namespaced_pod,
                victim.pod,
                self.namespace,
                grace_period_seconds=0,
            )
        fault_over = time.monotonic()
        await self.converged()
        self.ledger.chaos_recovery_s.append(time.monotonic() - fault_over)

    async def _restart_engine(self, victim: Any, others: list[Any], parked: int) -> None:
        """restart-engine: the prefill engine's process is SIGKILLed and started again in
        its pod (a container restart: same pod, IP, port and engine id, a new incarnation).
        Its peers' NIXL agents of it are dead (remote disconnect): what it held fails on
        them, with a reason, and they report it dropped; the operator must re-handshake
        every pair of it with no manual action. Records the time from the kill to every
        pair of the serving engines connected again (the new incarnation held both ways)."""
        assert self.fleet is not None
        t = time.monotonic()
        held = victim.in_flight + parked
        self.ledger.mark(
            t, "chaos", f"restart prefill {victim.pod}: SIGKILL its engine ({held} held)"
        )
        # Its requests may fail until the last of them has been given up on its peers.
        self.ledger.impair(victim.engine_id, t, t + GIVE_UP_S)
        old = victim.incarnation

        async def while_down() -> None:
            # A router that has not noticed yet: requests to its decodes, whose
            # registrations go to the dead process's agent (NIXL: remote disconnect).
            late = await self._park(victim, others)
            n, why = await self._peers_report_dropped(victim, others)
            self.ledger.mark(
                time.monotonic(),
                "chaos",
                f"{n}/{len(others)} of its peers report it dropped "
                f"{time.monotonic() - t:.1f} s after the kill ({len(late)} requests sent to "
                f"it by a router that had not noticed){': ' + why[:120] if why else ''}",
            )

        await self.fleet.restart_engine(victim, while_down)
        serving = time.monotonic()
        self.ledger.mark(
            serving,
            "chaos",
            f"{victim.pod} serves again after {serving - t:.1f} s (engine {victim.engine_id[:8]}"
            f", incarnation {old[:8]} -> {victim.incarnation[:8]})",
        )
        await self._until(
            "every pair connected to the restarted engine's new incarnation",
            lambda: self._caught_up(after=serving),
            60,
        )
        took = time.monotonic() - t
        self.ledger.mark(
            time.monotonic(), "chaos", f"every pair connected {took:.1f} s after the restart"
        )
        self.ledger.restart_recovery_s.append(took)

    async def _peers_report_dropped(self, victim: Any, peers: list[Any]) -> tuple[int, str]:
        """Polls the peers' own state (5 s at most) until each reports `victim` dropped, or
        no longer holds it; returns how many reported it dropped, and one's reason."""
        assert self.fleet is not None
        said: dict[str, str] = {}
        pending = list(peers)
        deadline = time.monotonic() + 5
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                try:
                    status, state = await self.fleet.call("GET", f"http://{peer.endpoint}/v1/state")
                except (aiohttp.ClientError, TimeoutError, OSError):
                    continue
                held = [
                    p
                    for p in (state or {}).get("peers", [])
                    if p.get("engine_id") == victim.engine_id
                ]
                if status != 200 or (held and held[0].get("health") != "dropped"):
                    continue
                pending.remove(peer)
                if held:
                    said[peer.engine_id] = str(held[0].get("health_reason", ""))
            await asyncio.sleep(0.05)  # polling the peers' own health reports
        return len(said), next(iter(said.values()), "")

    async def _writes_in_flight(self, prefill: Any, decode_id: str) -> int:
        """Waits (polling the prefill's own registry state, 5 s at most) until it has WRITEs
        in flight to `decode_id`; returns how many (0 when none came)."""
        assert self.fleet is not None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                status, state = await self.fleet.call("GET", f"http://{prefill.endpoint}/v1/state")
            except (aiohttp.ClientError, TimeoutError, OSError):
                status, state = 0, None
            if status != 200 or not isinstance(state, dict):
                state = {"peers": []}
            for peer in state["peers"]:
                if peer["engine_id"] == decode_id and peer["transfers_in_flight"] > 0:
                    return int(peer["transfers_in_flight"])
            await asyncio.sleep(0.02)
        return 0

    async def _park(self, victim: Any, others: list[Any]) -> list[tuple[str, Any, Any]]:
        """Books two requests per engine of the other role paired with `victim` and submits
        them to the decode side only (registrations out, no KV on the prefill yet); returns
        (request id, its prefill engine, its decode engine) of those the decode took."""
        assert self.fleet is not None
        parked: list[tuple[str, Any, Any]] = []
        for other in others:
            prefill, decode = (victim, other) if victim.role == "prefill" else (other, victim)
            for _ in range(2):
                self.seq += 1
                rid = f"drill-{self.opts.seed}-{self.seq}-parked"
                self.ledger.submitted(rid, prefill.engine_id, decode.engine_id, time.monotonic())
                self.trace("booked", rid=rid, prefill=prefill.engine_id, decode=decode.engine_id)
                status = await self.fleet.submit(decode, rid, prefill.engine_id, self.opts.blocks)
                self.trace("submit", rid=rid, side="decode", engine=decode.engine_id, answer=status)
                if status == 202:
                    parked.append((rid, prefill, decode))
                else:
                    self.ledger.withdraw(rid)
        return parked

    async def _rollout(self, name: str, label: str, chaos: bool) -> None:
        self.rollout_label = label
        self.phase = f"rolling {name}"
        start = time.monotonic()
        self.ledger.mark(start, "rollout", label)
        await self._restart(name)
        if chaos:
            fault_start = time.monotonic()
            await self._chaos()
            fault_over = time.monotonic()
        await self.converged()
        if chaos:
            self.ledger.chaos_recovery_s.append(time.monotonic() - fault_over)
            if self.opts.chaos in CONTROL_PLANE_FAULTS:
                self.ledger.control_faults.append((fault_start, time.monotonic()))
        new = [
            (eid, s)
            for eid, s in self.ledger.convergence
            if self._serving_at(eid) and self._serving_at(eid) >= start
        ]
        if new:
            last = max(new, key=lambda es: self._serving_at(es[0]))
            self.ledger.rollout_convergence.append(last[1])

    def _serving_at(self, engine_id: str) -> float:
        return self._serving_log.get(engine_id, 0.0)

    async def scenario(self) -> None:
        opts = self.opts
        self.phase = "waiting for the first engines"
        await self.converged(timeout=180)
        self.traffic_on = True
        self.phase = "steady traffic"
        await asyncio.sleep(opts.settle_s)
        engine_fault = opts.chaos in ENGINE_FAULTS
        for i in range(opts.rollouts):
            # abort-storm is in the traffic itself, through every rollout: no one-shot fault.
            chaos = (
                opts.chaos is not None
                and opts.chaos != "abort-storm"
                and i == min(1, opts.rollouts - 1)
            )
            await self._rollout(
                "decode", f"decode rollout {i + 1}/{opts.rollouts}", chaos and not engine_fault
            )
            self.phase = "steady traffic"
            await asyncio.sleep(opts.settle_s)
            if chaos and engine_fault:
                await self._engine_fault()
                await self.converged()
                self.phase = "steady traffic"
                await asyncio.sleep(opts.settle_s)
        for i in range(opts.prefill_rollouts):
            await self._rollout(
                "prefill", f"prefill rollout {i + 1}/{opts.prefill_rollouts}", False
            )
            await asyncio.sleep(opts.settle_s)
        if opts.scale_to != opts.decode:
            self.rollout_label = f"scale decode {opts.decode} -> {opts.scale_to}"
            self.phase = "scaling down"
            self.ledger.mark(time.monotonic(), "scale", self.rollout_label)
            await self._scale("decode", opts.scale_to)
            await self.converged()
            await asyncio.sleep(opts.settle_s)
            self.rollout_label = f"scale decode {opts.scale_to} -> {opts.decode}"
            self.phase = "scaling up"
            self.ledger.mark(time.monotonic(), "scale", self.rollout_label)
            await self._scale("decode", opts.decode)
            await self.converged()
            await asyncio.sleep(opts.settle_s)
        self.phase = "checking for stale peers"
        await self._no_stale_peers()
        self.phase = "draining the last requests"
        self.traffic_on = False
        deadline = time.monotonic() + 20
        while self.ledger.in_flight() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)

    async def _no_stale_peers(self) -> None:
        """Every worker's registry names only engines that exist (waits out one grace)."""
        assert self.fleet is not None
        deadline = time.monotonic() + self.opts.grace + 10
        stale: list[str] = []
        while time.monotonic() < deadline:
            serving = self.fleet.serving()
            live = {e.engine_id for e in serving}
            stale = [f"{e.pod} -> {p}" for e in serving for p in sorted(e.peers - live)]
            if not stale:
                break
            await asyncio.sleep(0.2)
        self.ledger.stale_peers_at_end = stale

    # --- run -------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        tasks: list[asyncio.Task[None]] = []
        try:
            await self.setup()
            assert self.fleet is not None
            tasks = [
                asyncio.create_task(c)
                for c in (
                    self.pods_loop(),
                    self.sample_loop(),
                    self.traffic_loop(),
                    self._track_serving(),
                )
            ]
            try:
                await asyncio.wait_for(self.scenario(), timeout=self.opts.timeout_s)
            except TimeoutError as exc:
                if str(exc):  # a wait of the scenario's own, which says what it waited for
                    raise
                raise TimeoutError(
                    f"the drill did not finish within {self.opts.timeout_s:g} s (--timeout); "
                    f"it was {self.phase}"
                ) from None
        finally:
            self.stop_traffic.set()
            self.phase = "stopping"
            for t in tasks:
                t.cancel()
            for t in list(self._aborts):
                t.cancel()
            if self._thaw is not None:
                self._thaw.cancel()  # SIGCONTs the hung engine
                await asyncio.gather(self._thaw, return_exceptions=True)
            if self.opts.chaos == "node-failure" and self.kube is not None:
                with contextlib.suppress(Exception):  # a cluster that is not ours any more
                    await asyncio.to_thread(self._cut_off, "", False)
            self._gate_drops()
            if self.fleet is not None:
                await self.fleet.stop_all()
            for replica in (self.operator, self.standby):
                if replica is not None:
                    launch.stop_process(replica, 10)
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.down)
            self.trace.close()
        report = self.ledger.report()
        report["trace"] = str(self.trace.path)
        return report

    def _gate_drops(self) -> None:
        """Hands the ledger every gate that turned from True to False (a pod not being
        deleted), with the engine of its pod and why the operator said it did."""
        gates, fleet = self.gates, self.fleet
        if gates is None or fleet is None:
            return
        gates.stop()
        for _, drop in gates.drops():
            engine = fleet.engines.get(drop.uid)
            self.ledger.gate_dropped(
                drop.at,
                drop.pod,
                engine.engine_id if engine is not None else "",
                engine.role if engine is not None else "",
                f"{drop.reason}: {drop.message}",
            )

    async def _track_serving(self) -> None:
        assert self.fleet is not None
        while True:
            for e in self.fleet.engines.values():
                if e.serving_at and e.engine_id and e.engine_id not in self._serving_log:
                    self._serving_log[e.engine_id] = e.serving_at
            await asyncio.sleep(0.1)
