"""`kvtopo bench operator --topologies TxN`: many small topologies in one namespace.

Owns the idle-cost benchmark of issue 54: T topologies of N engines each (a fifth of them
prefills) in one namespace, beside the same number of engines as one topology, measured in
one run on one control plane (kwok, the fake workers of `kvtopo_bench.operator`). Each
configuration: the operator starts, every engine is connected to its partners, the fleet
settles, then the operator's CPU is measured over an idle window (`IDLE_S`: no pod changes,
only the periodic state re-reads). On 7314fe4, 1,000 engines as 100 topologies idled at
29.8% of a core against 1.2% as one (every round of every loop walked every pod of the
namespace, and every pod event poked every loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtopo.drill import manifests
from kvtopo_bench.operator import APP, GRACE, SizeRun, _proc_cpu_rss
from kvtopo_operator.api import GROUP, PLURAL
from kvtopo_operator.crd import crd_manifest
from kvtopo_operator.kube import ClusterApi

IDLE_S = 30.0  # the idle window the operator's CPU is measured over
SETTLE_S = 10.0  # after every engine is connected, before the window


class ManyRun(SizeRun):
    """`topologies` topologies of `prefill` + `decode` engines each, in one namespace."""

    def __init__(
        self, cluster: Any, topologies: int, prefill: int, decode: int, log: Callable[[str], None]
    ) -> None:
        super().__init__(
            cluster, prefill * topologies, decode * topologies, log, run_name=f"t{topologies}"
        )
        self.topologies = topologies
        self.per = (prefill, decode)

    def _names(self) -> list[str]:
        return [APP] if self.topologies == 1 else [f"t{i}" for i in range(self.topologies)]

    def all_connected(self) -> bool:
        live = self.live()
        if len(live) != self.prefill + self.decode:
            return False
        p, d = self.per
        return all(len(w.peers) >= (d if w.role == "prefill" else p) for w in live)

    def _status_written(self) -> bool:
        return all(
            bool(((self.api.read_topology(self.ns, n) or {}).get("status") or {}).get("conditions"))
            for n in self._names()[:3]
        )

    async def idle(self, token_file: Path, log_dir: Path) -> dict[str, Any]:
        """Starts the operator on the namespace's topologies, waits for every engine to be
        connected and the fleet to settle, and measures the operator's CPU while idle."""
        import functools

        from kvtopo import launch
        from kvtopo.localkeys import Credentials
        from kvtopo_worker.signing import PublicKeys

        self.fleet.operator_keys = PublicKeys(path=Credentials.beside(token_file).operator_public)
        await self.fleet.start()
        await asyncio.to_thread(self.api.create_namespace, self.ns)
        await self.until(
            "ServiceAccount",
            lambda: bool(self.core.list_namespaced_service_account(self.ns).items),
            60,
        )
        p, d = self.per
        for name in self._names():
            body = manifests.topology(
                name, app=name, eviction={"graceSeconds": GRACE}, handshake={"maxConcurrent": 256}
            )
            await asyncio.to_thread(self.api.create_topology, self.ns, body)
            for role, n in (("prefill", p), ("decode", d)):
                deployment = manifests.engine_deployment(
                    f"{name}-{role}" if self.topologies > 1 else role,
                    app=name,
                    role=role,  # type: ignore[arg-type]
                    replicas=n,
                    version=None,
                    termination_grace_seconds=0,
                    endpoint=None,
                )
                await asyncio.to_thread(self.apps.create_namespaced_deployment, self.ns, deployment)
        self.operator = await asyncio.to_thread(
            functools.partial(
                launch.start_operator,
                self._operator_args(token_file),
                log_dir / f"operator-{self.ns}.log",
            )
        )
        pid = self.operator.pid
        agent = asyncio.create_task(self.agent())
        try:
            await self.until("operator start", self._status_written, 120)
            took = await self.until(
                "every engine connected", self.all_connected, 300 + (self.prefill + self.decode)
            )
            await asyncio.sleep(SETTLE_S)
            cpu0, _ = _proc_cpu_rss(pid)
            reads0 = self.fleet.state_reads
            t0 = time.monotonic()
            await asyncio.sleep(IDLE_S)
            window = time.monotonic() - t0
            cpu1, rss = _proc_cpu_rss(pid)
            return {
                "topologies": self.topologies,
                "engines_each": p + d,
                "engines": self.prefill + self.decode,
                "connected_in_s": round(took, 1),
                "idle_window_s": round(window, 1),
                "idle_cpu_share": round((cpu1 - cpu0) / window, 4),
                "idle_state_reads_per_s": round((self.fleet.state_reads - reads0) / window, 1),
                "operator_rss_mb": round(rss, 1),
            }
        finally:
            agent.cancel()
            if self.operator is not None:
                launch.stop_process(self.operator, 10)
            await self.fleet.runner.cleanup()

    async def remove(self) -> None:
        names = [
            f"{n}-{r}" if self.topologies > 1 else r
            for n in self._names()
            for r in ("prefill", "decode")
        ]
        for name in names:
            with contextlib.suppress(Exception):  # a Deployment never made
                await asyncio.to_thread(
                    self.apps.patch_namespaced_deployment, name, self.ns, {"spec": {"replicas": 0}}
                )
        await self.until(
            "pods gone", lambda: not self.core.list_namespaced_pod(self.ns, limit=1).items, 300
        )
        await asyncio.to_thread(self.core.delete_namespace, self.ns)


def run(
    json_path: Path | None, topologies: tuple[int, int], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """`topologies` = (T, N): T topologies of N engines in one namespace, then T x N engines
    as one topology, on one control plane; writes and returns the report."""
    from kvtopo.cluster.local_cluster import LocalCluster

    t, n = topologies
    prefill = max(1, n // 5)
    decode = n - prefill
    nodes = max(3, (t * n * 2) // 100 + 1)
    workdir = Path("out") / "bench-operator"
    workdir.mkdir(parents=True, exist_ok=True)
    token = workdir / "token"
    token.write_text("bench\n")
    runs: list[dict[str, Any]] = []
    with LocalCluster(workdir / "cluster", "b", fake_nodes=nodes, progress=log) as cluster:
        api = ClusterApi(cluster.kubeconfig)
        api.apply_crd(crd_manifest())
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s"
        )
        for count, p, d in ((t, prefill, decode), (1, prefill * t, decode * t)):
            log(f"kvtopo bench operator --topologies: {count} topologies of {p + d} engines")
            many = ManyRun(cluster, count, p, d, log)

            async def one(many: ManyRun = many) -> dict[str, Any]:
                try:
                    return await many.idle(token, workdir)
                finally:
                    await many.remove()

            res = asyncio.run(one())
            log("  " + json.dumps(res))
            runs.append(res)
    ratio = (
        runs[0]["idle_cpu_share"] / runs[1]["idle_cpu_share"] if runs[1]["idle_cpu_share"] else None
    )
    report: dict[str, Any] = {
        "benchmark": "operator",
        "topologies": {
            "shape": f"{t}x{n}",
            "runs": runs,
            "idle_cpu_ratio": round(ratio, 2) if ratio is not None else None,
            "target_ratio": 2.0,
        },
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
