"""The drill's engines on the real node (`kvtopo drill --node real`): containers the kubelet runs.

Owns what differs from :class:`~kvtopo.drill.fleet.Fleet`, which runs one host process per
kwok pod: here every engine is the worker image's `kvtopo-worker` in a real pod, started and
stopped by the kubelet. An engine appears once its pod's containers are ready and its worker
answers at the pod IP on the control port (its engine id and incarnation read from
`GET /v1/state`, signed as the drill's observer); when its pod is deleted the kubelet sends
SIGTERM, the worker drains itself, and the fleet collects its outcomes until it stops
answering (a draining worker exits only once they were handed out). No process is the
drill's, so the process faults (`--chaos`, `--fault`) do not apply here.

Also owns the real pods' side of the set-up: the drill's key pair and client token as the
Secret and ConfigMap the chart and the engine pods mount, and the engine container.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtopo.drill.fleet import Engine, Fleet

OPERATOR_KEY_OBJECT = "drill-operator-key"
"""The Secret (private key) and ConfigMap (public key) of the drill's operator key pair."""
CLIENT_TOKEN_SECRET = "drill-client-token"  # noqa: S105 - the Secret's name
KEY_DIR = "/var/run/kvtopo/operator"
TOKEN_DIR = "/var/run/kvtopo/client"  # noqa: S105 - where the token is mounted
TERMINATION_GRACE_S = 40
"""Long enough for a worker's drain (its deadline, twice that to fail what it held, and the
time to hand its outcomes out) before the kubelet would SIGKILL it."""


def engine_pod_spec(
    image: str, role: str, worker_args: list[str], control_port: int
) -> dict[str, Any]:
    """The pod spec fields of a real engine pod: the worker image's `kvtopo-worker` bound to
    the pod IP, told its pod's identity by the downward API, the operator's public key and
    the client token mounted (as examples/ spells it, plus the token)."""

    def downward(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "Never",  # built on this machine (make images), never pulled
        "command": ["kvtopo-worker"],
        "args": [
            "--role",
            role,
            "--host",
            "$(POD_IP)",
            "--port",
            str(control_port),
            "--operator-key-file",
            f"{KEY_DIR}/operator.pem",
            "--token-file",
            f"{TOKEN_DIR}/token",
            *worker_args,
        ],
        "env": [
            downward("POD_IP", "status.podIP"),
            downward("KVTOPO_POD_NAMESPACE", "metadata.namespace"),
            downward("KVTOPO_POD_NAME", "metadata.name"),
            downward("KVTOPO_POD_UID", "metadata.uid"),
        ],
        "ports": [{"name": "kvtopo-control", "containerPort": control_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "operator-key", "mountPath": KEY_DIR, "readOnly": True},
            {"name": "client-token", "mountPath": TOKEN_DIR, "readOnly": True},
        ],
    }
    return {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [container],
        "volumes": [
            {"name": "operator-key", "configMap": {"name": OPERATOR_KEY_OBJECT}},
            {"name": "client-token", "secret": {"secretName": CLIENT_TOKEN_SECRET}},
        ],
    }


@dataclass
class PodFleet(Fleet):
    """Engines of real pods (see the module docstring)."""

    unreachable_after: int = 5
    """Calls in a row a terminating engine may miss before it counts as exited."""

    async def _start(self, pod: str, uid: str, role: str, ip: str) -> None:
        eng = Engine(
            pod=pod,
            uid=uid,
            role=role,
            process=None,
            pod_ip=ip,
            started_at=time.monotonic(),
            endpoint=f"{ip}:{self.control_port}",
        )
        self.engines[uid] = eng
        self._spawn(self._await_serving(eng), f"serve-{pod}")

    async def _await_serving(self, eng: Engine) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and self.engines.get(eng.uid) is eng:
            try:
                status, state = await self.call("GET", f"http://{eng.endpoint}/v1/state")
            except (aiohttp.ClientError, TimeoutError, OSError):
                status, state = 0, None
            if status == 200 and isinstance(state, dict) and state.get("engine_id"):
                eng.engine_id = str(state["engine_id"])
                eng.incarnation = str(state.get("incarnation") or "")
                eng.serving_at = time.monotonic()
                self.trace("serving", pod=eng.pod, engine=eng.engine_id, role=eng.role)
                return
            await asyncio.sleep(0.2)  # polling the worker's real state
        if self.engines.get(eng.uid) is eng:
            self.waiting[eng.pod] = f"did not start: no answer at {eng.endpoint}"
            self.engines.pop(eng.uid, None)

    async def restart_engine(self, eng: Engine, while_down: Any = None) -> None:
        raise RuntimeError("a real pod's container restarts through the kubelet, not the drill")

    async def _drain_and_stop(self, eng: Engine) -> None:
        if not eng.serving_at:
            self.engines.pop(eng.uid, None)
            return
        drained = False
        misses = 0
        deadline = time.monotonic() + TERMINATION_GRACE_S + 10
        while misses < self.unreachable_after and time.monotonic() < deadline:
            state = await self.drain(eng)  # as the kubelet's SIGTERM does (idempotent)
            if state is None:
                misses += 1
            else:
                misses = 0
                if state.get("drained") and not drained:
                    drained = True
                    self.on_late_writes(eng.engine_id, int(state.get("late_writes") or 0))
            await self.collect(eng)
            await asyncio.sleep(0.1)  # polling the engine's real drain state
        self.trace("drained" if drained else "drain_deadline", pod=eng.pod, engine=eng.engine_id)
        eng.stopped = True
        self.trace("exited", pod=eng.pod, engine=eng.engine_id, code=None)
        self.engines.pop(eng.uid, None)

    async def stop_all(self) -> None:
        """The pods stay (the kubelet runs them until the cluster goes); only the session
        closes."""
        if self.session is not None:
            await self.session.close()
