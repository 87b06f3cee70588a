"""A small router for the engines of real pods: what a user's router does, from outside.

It learns the engines from the KVTopology's status (engine id, endpoint = pod IP and control
port, state) and their pods (Ready, not terminating, the version label the topology pairs
on), sends each request to a prefill and a decode engine of one pair with the client token
(prefill first; a request the decode side refuses is aborted on the prefill and not counted),
and collects every engine's outcomes with acknowledgements until each request has ended on
both sides, including from pods that are terminating (a draining worker exits only once its
outcomes were collected).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VERSION_LABEL = "app.kubernetes.io/version"
HTTP_TIMEOUT_S = 3.0
GONE_AFTER_MISSES = 5


def call(endpoint: str, method: str, path: str, token: str, body: object = None) -> tuple[int, Any]:
    """One call to an engine's traffic route; (status, JSON or None); (0, None) unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://{endpoint}{path}", data=data, method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass
class Ledger:
    """Every request booked, and its outcome on each side."""

    booked: dict[str, tuple[str, str]] = field(default_factory=dict)  # rid -> (prefill, decode)
    outcomes: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # rid -> side
    duplicates: int = 0
    withdrawn: set[str] = field(default_factory=set)
    refused: int = 0

    def record(self, side: str, outcome: dict[str, Any]) -> None:
        sides = self.outcomes.setdefault(str(outcome["request_id"]), {})
        if side in sides:
            self.duplicates += 1
        sides[side] = outcome

    def ended(self, rid: str) -> bool:
        return len(self.outcomes.get(rid, {})) == 2

    def open(self) -> list[str]:
        return [rid for rid in self.booked if not self.ended(rid)]

    def failed(self) -> list[dict[str, Any]]:
        return [
            o
            for rid in self.booked
            for o in self.outcomes.get(rid, {}).values()
            if o.get("status") != "done"
        ]

    def verified_bytes(self) -> int:
        return sum(
            int(o.get("verified_bytes", 0))
            for rid in self.booked
            for side, o in self.outcomes.get(rid, {}).items()
            if side == "decode"
        )


@dataclass
class PodRouter:
    """Routes requests to the engines of one KVTopology (see the module docstring)."""

    get_json: Callable[..., Any]  # kubectl get ... -o json
    namespace: str
    topology: str
    token: str
    blocks: int = 4
    ledger: Ledger = field(default_factory=Ledger)
    endpoints: dict[str, tuple[str, str]] = field(default_factory=dict)  # engine id -> (role, ep)
    acked: dict[str, int] = field(default_factory=dict)  # endpoint -> highest seq recorded
    misses: dict[str, int] = field(default_factory=dict)  # endpoint -> failed calls in a row
    connected: set[str] = field(default_factory=set)  # endpoints of Connected engines
    seq: int = 0

    def routable_pairs(self) -> list[tuple[str, str]]:
        status = self.get_json("kvt", self.topology, "-n", self.namespace).get("status") or {}
        pods = {
            p["metadata"]["name"]: p for p in self.get_json("pods", "-n", self.namespace)["items"]
        }
        serving: dict[str, list[tuple[str, str]]] = {"prefill": [], "decode": []}
        engines = status.get("engines") or []
        self.connected = {e["endpoint"] for e in engines if e.get("state") == "Connected"}
        for engine in engines:
            self.endpoints[engine["engineId"]] = (engine["role"], engine["endpoint"])
            pod = pods.get(engine.get("pod", ""))
            if pod is None or engine.get("state") != "Connected":
                continue
            if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
                continue
            version = pod["metadata"].get("labels", {}).get(VERSION_LABEL, "")
            serving[engine["role"]].append((engine["engineId"], version))
        return [(p, d) for p, pv in serving["prefill"] for d, dv in serving["decode"] if pv == dv]

    def submit(self, prefill: str, decode: str) -> bool:
        self.seq += 1
        rid = f"node-{self.seq}"
        body = {"request_id": rid, "peer_engine_id": decode, "num_blocks": self.blocks}
        status, _ = call(self.endpoints[prefill][1], "POST", "/v1/requests", self.token, body)
        if status != 202:
            self.ledger.refused += 1
            return False
        self.ledger.booked[rid] = (prefill, decode)
        body = {"request_id": rid, "peer_engine_id": prefill, "num_blocks": self.blocks}
        status, _ = call(self.endpoints[decode][1], "POST", "/v1/requests", self.token, body)
        if status != 202:  # e.g. 503 draining: never started on the decode side
            del self.ledger.booked[rid]
            self.ledger.withdrawn.add(rid)
            call(self.endpoints[prefill][1], "DELETE", f"/v1/requests/{rid}", self.token)
            self.ledger.refused += 1
            return False
        return True

    def collect(self, everyone: bool = False) -> None:
        """Records new outcomes of every engine known. One that missed several calls in a row
        and is not Connected (not up yet, or its pod gone) is skipped, unless `everyone`."""
        for role, endpoint in list(self.endpoints.values()):
            quiet = self.misses.get(endpoint, 0) >= GONE_AFTER_MISSES
            if quiet and not everyone and endpoint not in self.connected:
                continue
            acked = self.acked.get(endpoint, 0)
            status, outcomes = call(endpoint, "GET", f"/v1/finished?ack={acked}", self.token)
            if status == 0:
                # Not listening yet, or gone: a draining worker answers until its outcomes
                # were collected, then exits.
                self.misses[endpoint] = self.misses.get(endpoint, 0) + 1
                continue
            self.misses[endpoint] = 0
            if status != 200 or not isinstance(outcomes, list):
                continue
            fresh = [o for o in outcomes if int(o.get("seq", 0)) > acked]
            if fresh:
                self.acked[endpoint] = max(int(o["seq"]) for o in fresh)
            for outcome in fresh:
                if outcome.get("request_id") not in self.ledger.withdrawn:
                    self.ledger.record(role, outcome)

    def settle(self, timeout_s: float = 60.0) -> list[str]:
        """Collect until every booked request ended on both sides; returns those still open."""
        deadline = time.monotonic() + timeout_s
        while self.ledger.open() and time.monotonic() < deadline:
            self.routable_pairs()  # the engines' states, now
            self.collect(everyone=True)
            time.sleep(0.2)
        return self.ledger.open()


def pod_ready(pod: dict[str, Any]) -> bool:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


class RequestStream:
    """Requests at a steady rate on a thread, through a :class:`PodRouter`, until stopped."""

    def __init__(self, router: PodRouter, rate_per_s: float = 5.0) -> None:
        self.router = router
        self.interval = 1.0 / rate_per_s
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="request-stream", daemon=True)
        self.pairs_seen: set[tuple[str, str]] = set()

    def _run(self) -> None:
        try:
            tick = 0
            pairs: list[tuple[str, str]] = []
            while not self.stop_event.wait(self.interval):
                if tick % 3 == 0:
                    pairs = self.router.routable_pairs()
                tick += 1
                self.router.collect()
                if pairs:
                    pair = pairs[tick % len(pairs)]
                    if self.router.submit(*pair):
                        self.pairs_seen.add(pair)
        except BaseException as error:  # reported by stop()
            self.errors.append(error)

    def __enter__(self) -> RequestStream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)
