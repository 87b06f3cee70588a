"""Every change of the readiness gate `kvtopo.dev/kv-connected`, as a watch of the pods sees it.

Owns `GateWatch`: a thread that lists and then watches the pods of one namespace (every pod,
whatever its labels: a pod relabelled out of the operator's filtered watch is still seen) and
records each change of a pod's kv-connected condition (status, reason, message) with the
local time it arrived. The drill's invariant `gate_drops_while_connected` and the fail-static
tests read the drops from it (`GateWatch.drops`): a condition that went from True to False.
A watch that ends (the API server's timeout, a stall, "410 Gone") is started again from a
fresh list; a change that came and went while no watch ran is lost, and so counted
(`GateWatch.gaps`). No decisions are made here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtopo_operator.api import KV_CONNECTED_GATE
from kvtopo_operator.kube import ClusterApi


@dataclass(frozen=True)
class GateChange:
    """Pod `pod` (uid `uid`) had its gate condition become `status` at `at` (monotonic)."""

    at: float
    pod: str
    uid: str
    status: str  # "True", "False" or "" (the condition is gone, or the pod is deleted)
    reason: str
    message: str
    deleting: bool


def gate_of(pod: dict[str, Any], condition: str = KV_CONNECTED_GATE) -> tuple[str, str, str]:
    """The pod's kv-connected condition (or `condition`): (status, reason, message); ("",
    "", "") for none."""
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == condition:
            return (
                str(cond.get("status") or ""),
                str(cond.get("reason") or ""),
                str(cond.get("message") or ""),
            )
    return ("", "", "")


class GateWatch:
    """Records the gate changes of namespace `namespace`'s pods (see the module)."""

    def __init__(
        self,
        api: ClusterApi,
        namespace: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_timeout_s: int = 30,
        condition: str = KV_CONNECTED_GATE,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.condition = condition  # the pod condition followed (the gate, or e.g. Ready)
        self.clock = clock
        self.watch_timeout_s = watch_timeout_s
        self.changes: list[GateChange] = []
        self.gaps = 0  # watches that ended and were started again from a list
        self._last: dict[str, GateChange] = {}  # uid -> its last change
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-watch", daemon=True)

    def start(self, wait_s: float = 30.0) -> GateWatch:
        """Starts the watch and waits for its first list (so nothing before it is missed)."""
        self._thread.start()
        if not self._listed.wait(wait_s):
            raise TimeoutError(f"the gate watch of {self.namespace} listed nothing in {wait_s}s")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.watch_timeout_s + 15)

    def __enter__(self) -> GateWatch:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # --- what it saw -----------------------------------------------------------------------

    def gates(self) -> dict[str, str]:
        """Each pod's gate status as last seen (pods with the condition only)."""
        with self._lock:
            return {c.pod: c.status for c in self._last.values() if c.status}

    def history(self, pod: str) -> list[GateChange]:
        with self._lock:
            return [c for c in self.changes if c.pod == pod]

    def drops(
        self, since: float = 0.0, until: float = float("inf"), *, pods: set[str] | None = None
    ) -> list[tuple[GateChange, GateChange]]:
        """(True change, the False change that followed it) for each drop of a gate from
        True to False that arrived within [since, until] (a pod being deleted is no drop:
        its gate goes with it)."""
        out: list[tuple[GateChange, GateChange]] = []
        with self._lock:
            before: dict[str, GateChange] = {}
            for c in self.changes:
                prev = before.get(c.uid)
                before[c.uid] = c
                if prev is None or prev.status != "True" or c.status != "False":
                    continue
                if c.deleting or not since <= c.at <= until:
                    continue
                if pods is not None and c.pod not in pods:
                    continue
                out.append((prev, c))
        return out

    # --- the thread --------------------------------------------------------------------------

    def _saw(self, pod: dict[str, Any], *, deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        status, reason, message = ("", "", "") if deleted else gate_of(pod, self.condition)
        with self._lock:
            last = self._last.get(uid)
            if last is not None and (last.status, last.reason, last.message) == (
                status,
                reason,
                message,
            ):
                return
            if last is None and not status:
                return  # a pod that never had the condition
            change = GateChange(
                self.clock(),
                str(meta.get("name") or ""),
                uid,
                status,
                reason,
                message,
                deleted or bool(meta.get("deletionTimestamp")),
            )
            self._last[uid] = change
            self.changes.append(change)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listed = self.api.request_json("GET", f"/api/v1/namespaces/{self.namespace}/pods")
            except Exception:
                self._stop.wait(0.2)
                continue
            for pod in listed.get("items") or ():
                self._saw(pod)
            self._listed.set()
            version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
            try:
                for line in self.api.watch_pods_raw(
                    self.namespace,
                    "",
                    resource_version=version,
                    timeout_s=self.watch_timeout_s,
                ):
                    if self._stop.is_set():
                        return
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind in ("ADDED", "MODIFIED"):
                        self._saw(obj)
                    elif kind == "DELETED":
                        self._saw(obj, deleted=True)
                    elif kind == "ERROR":
                        break
            except Exception:
                self._stop.wait(0.2)
            self.gaps += 1
