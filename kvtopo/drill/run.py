"""`kvtopo drill`: roll and scale a real P/D deployment while KV flows; prove nothing is lost.

Owns the drill's orchestration: the control plane (local tier b, or `--kubeconfig`), the CRD,
the operator process, prefill/decode Deployments on kwok nodes, the fleet of real workers
(`fleet`), the traffic generator, the scenario (rollout restarts, scale down/up, optional
chaos), live progress, and the report (`ledger`), table and timeline plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from kvtopo.cluster.fake_nodes import FAKE_NODE_PLACEMENT
from kvtopo.drill.fleet import Fleet
from kvtopo.drill.ledger import Ledger, invariants_hold
from kvtopo_operator.api import ENDPOINT_ANNOTATION

log = logging.getLogger(__name__)

ROOT_CRD = Path(__file__).resolve().parents[2] / "crds" / "kvtopology.yaml"


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
    kubeconfig: Path | None = None
    workdir: Path = field(default_factory=lambda: Path("out") / "drill")
    json_path: Path | None = None
    plot_path: Path | None = None
    live: bool = True
    timeout_s: float = 600.0


class Kube:
    """The few API calls the drill makes, through the official client."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(kubeconfig))
        # The client's generated models are loosely typed; the drill reads them as Any.
        self.core: Any = client.CoreV1Api(api)
        self.apps: Any = client.AppsV1Api(api)
        self.custom: Any = client.CustomObjectsApi(api)
        self.ext: Any = client.ApiextensionsV1Api(api)

    def apply_crd(self, path: Path) -> None:
        from kubernetes.client.exceptions import ApiException

        body = yaml.safe_load(path.read_text())
        try:
            self.ext.create_custom_resource_definition(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = self.ext.read_custom_resource_definition(body["metadata"]["name"])
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            self.ext.replace_custom_resource_definition(body["metadata"]["name"], body)

    def crd_established(self, name: str) -> bool:
        crd = self.ext.read_custom_resource_definition(name)
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )


def _deployment(name: str, role: str, replicas: int) -> dict[str, Any]:
    labels = {"app": "drill", "kvtopo.dev/role": role}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "minReadySeconds": 3,
            "selector": {"matchLabels": labels},
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {**labels, "app.kubernetes.io/version": "v1"},
                    "annotations": {ENDPOINT_ANNOTATION: "pending"},
                },
                "spec": {
                    **FAKE_NODE_PLACEMENT,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "engine", "image": "ghcr.io/kvtopo/worker:0.1.0"}],
                },
            },
        },
    }


def _topology(grace: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvtopo.dev/v1alpha1",
        "kind": "KVTopology",
        "metadata": {"name": "drill"},
        "spec": {
            "prefill": {
                "selector": {"matchLabels": {"app": "drill", "kvtopo.dev/role": "prefill"}}
            },
            "decode": {"selector": {"matchLabels": {"app": "drill", "kvtopo.dev/role": "decode"}}},
            "pairing": {"matchLabels": ["app.kubernetes.io/version"]},
            "eviction": {"graceSeconds": grace},
            "handshake": {"timeoutSeconds": 5},
        },
    }


class Drill:
    def __init__(self, opts: DrillOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.rng = random.Random(opts.seed)
        self.ledger = Ledger(t0=time.monotonic())
        self.phase = "starting"
        self.rollout_label = "-"
        self.operator: subprocess.Popen[bytes] | None = None
        self.cluster: Any = None
        self.kube: Kube | None = None
        self.fleet: Fleet | None = None
        self.namespace = "kvtopo-drill"
        self.seq = 0
        self.converged_at: dict[str, float] = {}
        self.traffic_on = False
        self.stop_traffic = asyncio.Event()
        self._serving_log: dict[str, float] = {}  # engine -> when it began serving

    # --- set-up ----------------------------------------------------------------------------

    def _kubeconfig(self) -> Path:
        if self.opts.kubeconfig is not None:
            return self.opts.kubeconfig
        from kvtopo.cluster.local_cluster import LocalCluster

        self.say(
            "starting the local control plane (tier b: etcd, kube-apiserver, "
            "controller manager, scheduler, kwok)"
        )
        self.cluster = LocalCluster(self.opts.workdir / "cluster", "b", progress=self.say)
        self.cluster.up()
        return Path(self.cluster.kubeconfig)

    def _start_operator(self, kubeconfig: Path, token_file: Path) -> None:
        log_path = self.opts.workdir / "operator.log"
        self.operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtopo_operator.main",
                "--namespace",
                self.namespace,
                "--kubeconfig",
                str(kubeconfig),
                "--worker-token-file",
                str(token_file),
                "--metrics-port",
                "0",
                "--resync-seconds",
                "1",
            ],
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )

    async def setup(self) -> None:
        from kubernetes.client.exceptions import ApiException

        self.opts.workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = await asyncio.to_thread(self._kubeconfig)
        kube = self.kube = Kube(kubeconfig)
        token = f"drill-{os.getpid()}-{time.time_ns()}"
        token_file = self.opts.workdir / "worker-token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        self.say("installing the KVTopology CRD")
        await asyncio.to_thread(kube.apply_crd, ROOT_CRD)
        await self._until(
            "CRD established", lambda: kube.crd_established("kvtopologies.kvtopo.dev"), 30
        )
        with contextlib.suppress(ApiException):
            await asyncio.to_thread(
                kube.core.create_namespace, {"metadata": {"name": self.namespace}}
            )
        await self._until(
            "default ServiceAccount",
            lambda: bool(kube.core.list_namespaced_service_account(self.namespace).items),
            60,
        )
        self.say("starting the operator")
        self._start_operator(kubeconfig, token_file)
        worker_args = [
            "--num-blocks",
            str(self.opts.blocks * 64),
            "--block-bytes",
            str(self.opts.block_bytes),
            "--registration-timeout",
            "5",
            "--kv-lease",
            "5",
        ]

        def list_pods() -> list[dict[str, Any]]:
            items = kube.core.list_namespaced_pod(self.namespace, label_selector="app=drill").items
            return [kube.core.api_client.sanitize_for_serialization(p) for p in items]

        def annotate(pod: str, endpoint: str) -> None:
            kube.core.patch_namespaced_pod(
                pod, self.namespace, {"metadata": {"annotations": {ENDPOINT_ANNOTATION: endpoint}}}
            )

        self.fleet = Fleet(
            namespace=self.namespace,
            token=token,
            token_file=token_file,
            log_dir=self.opts.workdir,
            worker_args=worker_args,
            list_pods=list_pods,
            annotate=annotate,
            on_outcomes=self._record_outcomes,
            on_going=self.ledger.going_away,
            kill_without_drain=self.opts.fault == "crash-decode",
        )
        self.say("creating the KVTopology and the prefill/decode Deployments on kwok nodes")
        await asyncio.to_thread(
            kube.custom.create_namespaced_custom_object,
            "kvtopo.dev",
            "v1alpha1",
            self.namespace,
            "kvtopologies",
            _topology(self.opts.grace),
        )
        for name, role, n in (
            ("prefill", "prefill", self.opts.prefill),
            ("decode", "decode", self.opts.decode),
        ):
            await asyncio.to_thread(
                kube.apps.create_namespaced_deployment, self.namespace, _deployment(name, role, n)
            )

    def _record_outcomes(self, role: str, outcomes: list[dict[str, Any]], t: float) -> None:
        for outcome in outcomes:
            self.ledger.outcome(role, outcome, t)

    async def _until(
        self,
        what: str,
        probe: Callable[[], bool],
        limit_s: float,
        describe: Callable[[], str] | None = None,
    ) -> None:
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
            await asyncio.sleep(0.25)

    async def sample_loop(self) -> None:
        fleet = self.fleet
        assert fleet is not None
        while True:
            known = fleet.all_known()
            await asyncio.gather(*(fleet.collect(e) for e in known))
            now = time.monotonic()
            serving = fleet.serving()
            pairs = frozenset(
                (p.engine_id, d.engine_id)
                for p in serving
                if p.role == "prefill"
                for d in serving
                if d.role == "decode"
                if d.engine_id in p.peers and p.engine_id in d.peers
            )
            self.ledger.sample(now, pairs)
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
            serving = {e.engine_id: e for e in fleet.serving()}
            pairs = sorted(
                p for p in self.ledger.samples_pairs[-1] if p[0] in serving and p[1] in serving
            )
            if not pairs:
                continue
            pid, did = self.rng.choice(pairs)
            self.seq += 1
            rid = f"drill-{self.opts.seed}-{self.seq}"
            if await fleet.submit(serving[pid], rid, did, self.opts.blocks) != 202:
                continue
            # Booked before the decode side is asked: its outcome can be collected before
            # the answer to this very call arrives.
            self.ledger.submitted(rid, pid, did, time.monotonic())
            status = await fleet.submit(serving[did], rid, pid, self.opts.blocks)
            if status != 202:
                self.ledger.withdraw(rid)

    # --- the scenario ----------------------------------------------------------------------

    def _deploy_state(self, name: str) -> tuple[bool, int]:
        assert self.kube is not None
        d = self.kube.apps.read_namespaced_deployment(name, self.namespace)
        st, want = d.status, d.spec.replicas
        done = (
            (st.observed_generation or 0) >= d.metadata.generation
            and (st.updated_replicas or 0) == want
            and (st.available_replicas or 0) == want
            and (st.replicas or 0) == want
        )
        return done, want

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
            obj = kube.custom.get_namespaced_custom_object(
                "kvtopo.dev", "v1alpha1", self.namespace, "kvtopologies", "drill"
            )
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
            pairs = self.ledger.samples_pairs[-1] if self.ledger.samples_pairs else frozenset()
            lines.append(f"connected pairs in the last sample: {len(pairs)}")
            obj = kube.custom.get_namespaced_custom_object(
                "kvtopo.dev", "v1alpha1", self.namespace, "kvtopologies", "drill"
            )
            status = obj.get("status") or {}
            lines.append(f"KVTopology summary {status.get('summary')}")
            for c in status.get("conditions") or []:
                lines.append(f"  {c['type']}={c['status']} {c['reason']}: {c.get('message', '')}")
            lines.append(f"operator log: {self.opts.workdir / 'operator.log'}")
            return "\n".join(lines)

        await self._until("the topology to converge", check, timeout, describe)

    async def _restart(self, name: str) -> None:
        assert self.kube is not None
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        patch = {
            "spec": {
                "template": {
                    "metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": stamp}}
                }
            }
        }
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
            self._start_operator(kubeconfig, self.opts.workdir / "worker-token")
            self.ledger.mark(time.monotonic(), "chaos", "operator restarted")
        elif self.opts.chaos == "apiserver-restart" and self.cluster is not None:
            self.ledger.mark(t, "chaos", "kube-apiserver restart")
            took = await asyncio.to_thread(self.cluster.restart_apiserver)
            self.ledger.mark(time.monotonic(), "chaos", f"kube-apiserver back ({took:.1f}s)")

    async def _rollout(self, name: str, label: str, chaos: bool) -> None:
        self.rollout_label = label
        self.phase = f"rolling {name}"
        start = time.monotonic()
        self.ledger.mark(start, "rollout", label)
        await self._restart(name)
        if chaos:
            await self._chaos()
            fault_over = time.monotonic()
        await self.converged()
        if chaos:
            self.ledger.chaos_recovery_s.append(time.monotonic() - fault_over)
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
        for i in range(opts.rollouts):
            chaos = opts.chaos is not None and i == min(1, opts.rollouts - 1)
            await self._rollout("decode", f"decode rollout {i + 1}/{opts.rollouts}", chaos)
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
            await asyncio.wait_for(self.scenario(), timeout=self.opts.timeout_s)
        finally:
            self.stop_traffic.set()
            self.phase = "stopping"
            for t in tasks:
                t.cancel()
            if self.fleet is not None:
                await self.fleet.stop_all()
            if self.operator is not None and self.operator.poll() is None:
                self.operator.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.operator.wait(10)
                if self.operator.poll() is None:
                    self.operator.kill()
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.down)
        return self.ledger.report()

    async def _track_serving(self) -> None:
        assert self.fleet is not None
        while True:
            for e in self.fleet.engines.values():
                if e.serving_at and e.engine_id and e.engine_id not in self._serving_log:
                    self._serving_log[e.engine_id] = e.serving_at
            await asyncio.sleep(0.1)


# --- presentation --------------------------------------------------------------------------


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="kvtopo drill", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    conv = report["convergence_s"]
    rows = [
        ("rollouts", str(report["rollouts"]), ">= 3"),
        ("requests", str(report["requests_total"]), ">= 1000"),
        ("completed (verified)", str(report["completed"]), ""),
        ("failed", json.dumps(report["failed_by_reason"]) or "{}", "explained"),
        ("lost", str(report["lost"]), "0"),
        ("false failures", str(report["false_failures"]), "0"),
        ("duplicate failure reports", str(report["duplicate_failure_reports"]), "0"),
        ("verified bytes", f"{report['verified_bytes']:,}", ""),
        ("convergence per rollout (s)", ", ".join(f"{c:.2f}" for c in conv) or "-", "p99 <= 5"),
        ("convergence p99, all new engines (s)", str(report["convergence_p99_s"]), "<= 5"),
        (
            "eviction max (s)",
            str(report["eviction_max_s"]),
            f"<= grace + 2 ({report.get('grace', '?')} + 2)",
        ),
        (
            "recovery after the fault (s)",
            ", ".join(f"{c:.2f}" for c in report["chaos_recovery_s"]) or "-",
            "<= 15",
        ),
        ("stale peers at the end", str(report["stale_peers_at_end"]), "0"),
    ]
    for r in rows:
        table.add_row(*r)
    return table


def render_plot(ledger: Ledger, report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = ledger.t0
    ends = [r.ended_at - t0 for r in ledger.requests.values() if r.ended_at is not None]
    horizon = max([*ends, *(t - t0 for t in ledger.samples_t), 1.0])
    bins = int(horizon) + 1
    done = [0] * bins
    failed: dict[str, list[int]] = {}
    for r in ledger.requests.values():
        if r.ended_at is None or not r.decode_outcomes:
            continue
        b = int(r.ended_at - t0)
        o = r.decode_outcomes[0]
        if o["status"] == "done":
            done[b] += 1
        else:
            failed.setdefault(str(o.get("reason")), [0] * bins)[b] += 1
    fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    axes[0].plot(range(bins), done, color="tab:green", label="completed (verified)")
    axes[0].set_ylabel("requests / s")
    axes[0].legend(loc="upper left")
    for reason, series in sorted(failed.items()):
        axes[1].bar(range(bins), series, label=reason)
    axes[1].set_ylabel("failures / s")
    if failed:
        axes[1].legend(loc="upper left")
    else:
        axes[1].text(0.5, 0.5, "no failures", transform=axes[1].transAxes, ha="center")
    axes[2].step(
        [t - t0 for t in ledger.samples_t],
        [len(p) for p in ledger.samples_pairs],
        where="post",
        color="tab:blue",
    )
    axes[2].set_ylabel("connected pairs")
    axes[2].set_xlabel("seconds since the drill started")
    colors = {"rollout": "tab:orange", "scale": "tab:purple", "chaos": "tab:red", "phase": "grey"}
    for m in ledger.marks:
        for ax in axes:
            ax.axvline(m.t - t0, color=colors.get(m.kind, "grey"), linestyle="--", linewidth=1)
        axes[0].annotate(
            m.label,
            (m.t - t0, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
        )
    fig.suptitle(
        f"kvtopo drill: {report['requests_total']} requests, lost {report['lost']}, "
        f"false failures {report['false_failures']}, "
        f"duplicates {report['duplicate_failure_reports']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_drill_parser(verbs: Any) -> None:
    p = verbs.add_parser(
        "drill",
        help="roll and scale a P/D deployment while KV flows; prove nothing is lost",
        description="Starts a local control plane (tier b with kwok) unless --kubeconfig is "
        "given, installs the CRD, runs the operator, creates prefill and decode Deployments, "
        "runs one real kvtopo-worker per Ready pod, streams verified KV transfers through "
        "connected pairs, and rolls and scales the decode Deployment. Exits non-zero when a "
        "request is lost, fails falsely or is reported twice.",
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill replicas")
    p.add_argument("--decode", type=int, default=4, help="decode replicas")
    p.add_argument("--rollouts", type=int, default=3, help="decode rollout restarts")
    p.add_argument("--prefill-rollouts", type=int, default=0)
    p.add_argument("--scale-to", type=int, default=2, help="scale decode down to this, then back")
    p.add_argument("--rate", type=float, default=40.0, help="requests per second")
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--blocks", type=int, default=4, help="KV blocks per request")
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    p.add_argument("--grace", type=int, default=3, help="eviction.graceSeconds of the topology")
    p.add_argument(
        "--settle", type=float, default=4.0, help="seconds of steady traffic between steps"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chaos", choices=["operator-kill", "apiserver-restart"])
    p.add_argument(
        "--fault",
        choices=["crash-decode"],
        help="self-test: decode engines crash instead of draining (the drill must fail)",
    )
    p.add_argument("--kubeconfig", type=Path, help="use this cluster instead of a local one")
    p.add_argument("--workdir", type=Path, default=Path("out") / "drill", help="logs and cluster")
    p.add_argument("--json", type=Path, dest="json_path", help="write the JSON report here")
    p.add_argument("--plot", type=Path, dest="plot_path", help="write the PNG timeline here")
    p.add_argument(
        "--no-live", action="store_true", help="plain progress lines instead of a live view"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.set_defaults(func=run_drill)


def run_drill(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    opts = DrillOptions(
        prefill=args.prefill,
        decode=args.decode,
        rollouts=args.rollouts,
        prefill_rollouts=args.prefill_rollouts,
        scale_to=args.scale_to,
        rate=args.rate,
        max_in_flight=args.max_in_flight,
        blocks=args.blocks,
        block_bytes=args.block_bytes,
        grace=args.grace,
        settle_s=args.settle,
        seed=args.seed,
        chaos=args.chaos,
        fault=args.fault,
        kubeconfig=args.kubeconfig,
        workdir=args.workdir,
        json_path=args.json_path,
        plot_path=args.plot_path,
        live=not args.no_live,
        timeout_s=args.timeout,
    )
    drill = Drill(opts, say=lambda line: console.print(f"[dim]{line}[/dim]"))

    async def main() -> dict[str, Any]:
        if not opts.live:
            return await drill.run()
        from rich.live import Live

        with Live(console=console, refresh_per_second=4, transient=True) as live:

            async def show() -> None:
                while True:
                    live.update(_progress(drill))
                    await asyncio.sleep(0.25)

            shower = asyncio.create_task(show())
            try:
                return await drill.run()
            finally:
                shower.cancel()

    try:
        report = asyncio.run(main())
    except (TimeoutError, RuntimeError) as exc:
        console.print(f"[red]drill failed: {exc}[/red]; logs are in {opts.workdir}")
        return 2
    report["grace"] = opts.grace
    report["chaos"] = opts.chaos
    console.print(render_table(report))
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"JSON report: {opts.json_path}")
    if opts.plot_path is not None:
        render_plot(drill.ledger, report, opts.plot_path)
        console.print(f"timeline plot: {opts.plot_path}")
    if not invariants_hold(report):
        console.print("[red]an invariant broke[/red]; offending requests:")
        console.print(json.dumps(report["offending_requests"], indent=1))
        return 1
    return 0


def _progress(drill: Drill) -> Any:
    from rich.table import Table

    rep_done = sum(
        1
        for r in drill.ledger.requests.values()
        if r.decode_outcomes and r.decode_outcomes[0]["status"] == "done"
    )
    rep_failed = sum(
        1
        for r in drill.ledger.requests.values()
        if r.decode_outcomes and r.decode_outcomes[0]["status"] == "failed"
    )
    pairs = len(drill.ledger.samples_pairs[-1]) if drill.ledger.samples_pairs else 0
    engines = len(drill.fleet.serving()) if drill.fleet else 0
    t = Table.grid(padding=(0, 2))
    t.add_row("phase", drill.phase)
    t.add_row("current", drill.rollout_label)
    t.add_row(
        "requests done / failed / in flight",
        f"{rep_done} / {rep_failed} / {drill.ledger.in_flight()}",
    )
    t.add_row("serving engines / connected pairs", f"{engines} / {pairs}")
    t.add_row("elapsed", f"{time.monotonic() - drill.ledger.t0:.0f} s")
    return t
