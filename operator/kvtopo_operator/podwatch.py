"""The engine-pod watch: a list and a watch of the pods labelled `kvtopo.dev/role`, kept as
small records, one store for the whole operator.

Owns `EnginePod` (what the operator needs of a pod, decoded straight from the API server's
JSON: unknown fields cost nothing and are never built), `PodStore` (namespace -> uid -> the
pod) and `PodWatch` (one thread per watched scope, a namespace or the whole cluster, that
lists, then watches from the list's resourceVersion, and lists afresh after "410 Gone", after
an error, and every `relist_s` seconds).

kopf keeps the KVTopology resource; engine pods come here instead of through kopf's
per-object machinery (a worker task, a body wrapper, causation and progress storage per
event), which cost most of the operator's CPU at a thousand pods. A list replaces its
scope's pods wholesale, so a pod deleted while the watch was away (a relist after "410 Gone"
replays only the pods still present) is dropped then; such drops are counted
(`stale_pods_dropped`). The store changes only on the event loop: the threads decode and
hand batches over (`loop.call_soon_threadsafe`), and a namespace's loops are poked only when
one of its pods changed in a field the operator reads (a kubelet's status heartbeat that
changes nothing here pokes nothing). A pod the watch cannot decode is counted and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import msgspec

from kvtopo_operator.api import ENDPOINT_ANNOTATION, KV_CONNECTED_GATE, ROLE_LABEL

log = logging.getLogger(__name__)

Scope = str | None  # a namespace; None: every namespace


# --- the pod as the API server sends it (only what is read; the rest is skipped) ----------


class _Condition(msgspec.Struct):
    type: str = ""
    status: str = ""
    lastTransitionTime: str | None = None  # noqa: N815 (the API's spelling)
    reason: str = ""


class _PodIP(msgspec.Struct):
    ip: str = ""


class _Gate(msgspec.Struct):
    conditionType: str = ""  # noqa: N815


class _Meta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""  # noqa: N815
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None  # noqa: N815


class _Spec(msgspec.Struct):
    readinessGates: list[_Gate] | None = None  # noqa: N815
    nodeName: str = ""  # noqa: N815


class _Status(msgspec.Struct):
    conditions: list[_Condition] | None = None
    podIPs: list[_PodIP] | None = None  # noqa: N815
    podIP: str | None = None  # noqa: N815


class _Pod(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    spec: _Spec = msgspec.field(default_factory=_Spec)
    status: _Status = msgspec.field(default_factory=_Status)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""  # noqa: N815
    # "continue" is a Python keyword: renamed on the wire.
    next: str = msgspec.field(default="", name="continue")


class _PodList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[msgspec.Raw] = msgspec.field(default_factory=list)


class _WatchEvent(msgspec.Struct):
    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"{}")


class _ApiStatus(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


_pod_decoder = msgspec.json.Decoder(_Pod)
_list_decoder = msgspec.json.Decoder(_PodList)
_event_decoder = msgspec.json.Decoder(_WatchEvent)
_status_decoder = msgspec.json.Decoder(_ApiStatus)


@dataclass(frozen=True, slots=True)
class EnginePod:
    """An engine pod, as much of it as the operator reads."""

    namespace: str
    name: str
    uid: str
    role: str
    labels: Mapping[str, str]
    # The engine is up: ContainersReady (the pod's Ready may wait for the kv-connected
    # readiness gate, which waits for the operator); Ready where a pod has no ContainersReady.
    ready: bool
    ready_since: float | None  # epoch seconds
    deleting: bool
    pod_ips: tuple[str, ...]  # primary first
    endpoint: str  # the control-endpoint annotation, as written (bounded)
    gated: bool  # lists the readiness gate kvtopo.dev/kv-connected
    gate: str  # that condition's status ("True", "False"; "" when not set)
    resource_version: str = field(default="", compare=False)
    gate_reason: str = ""  # that condition's reason (bounded)
    node: str = ""  # spec.nodeName ("" until scheduled)
    # The pod was marked not Ready from outside (see `lost_since`): since when (epoch s).
    lost_since: float | None = None


def _condition(conditions: Sequence[_Condition], kind: str) -> _Condition | None:
    for cond in conditions:
        if cond.type == kind:
            return cond
    return None


def _since(cond: _Condition) -> float | None:
    if not cond.lastTransitionTime:
        return None
    try:
        return datetime.fromisoformat(cond.lastTransitionTime.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


# The reasons the kubelet gives a pod's Ready condition when it sets it False: it always
# says why. The node lifecycle controller, marking the pods of a NotReady or unreachable node
# not Ready, only flips the status (the reason stays that of the Ready True it was).
KUBELET_NOT_READY_REASONS = frozenset(
    {
        "ContainersNotReady",
        "ReadinessGatesNotReady",
        "PodCompleted",
        "PodFailed",
        "UnknownContainerStatuses",
    }
)


def lost_since(pod: _Pod) -> float | None:
    """When the pod was marked not Ready from outside: its Ready turned False, with none of
    the kubelet's reasons, while its containers are ready. Only the node lifecycle controller
    does that: the pod's node is NotReady or unreachable (its kubelet silent; the containers'
    readiness is the kubelet's last word), and the pod has left its Services' endpoints. None
    when the pod is not in that state (a pod waiting for its readiness gate has Ready False
    for ReadinessGatesNotReady). The time is Ready's last transition (epoch seconds; now when
    the condition has none)."""
    conditions = pod.status.conditions or []
    ready = _condition(conditions, "Ready")
    containers = _condition(conditions, "ContainersReady")
    if ready is None or ready.status != "False" or ready.reason in KUBELET_NOT_READY_REASONS:
        return None
    if containers is None or containers.status != "True":
        return None
    return _since(ready) or time.time()


def engine_pod(pod: _Pod) -> EnginePod:
    """The record of a decoded pod."""
    meta, status = pod.metadata, pod.status
    conditions = status.conditions or []
    up = _condition(conditions, "ContainersReady") or _condition(conditions, "Ready")
    lost = lost_since(pod)
    # A pod its node's lifecycle marked not Ready is not up, whatever its containers say
    # (they were last reported by a kubelet that no longer reports).
    ready = up is not None and up.status == "True" and lost is None
    ips = tuple(x.ip for x in status.podIPs or [] if x.ip)
    if not ips and status.podIP:
        ips = (status.podIP,)
    labels = dict(meta.labels or {})
    gate = _condition(conditions, KV_CONNECTED_GATE)
    return EnginePod(
        namespace=meta.namespace,
        name=meta.name,
        uid=meta.uid,
        role=labels.get(ROLE_LABEL, ""),
        labels=labels,
        ready=ready,
        ready_since=_since(up) if ready and up is not None else None,
        deleting=meta.deletionTimestamp is not None,
        pod_ips=ips,
        endpoint=str((meta.annotations or {}).get(ENDPOINT_ANNOTATION, ""))[:256],
        gated=any(g.conditionType == KV_CONNECTED_GATE for g in pod.spec.readinessGates or []),
        gate=gate.status if gate is not None else "",
        resource_version=meta.resourceVersion,
        gate_reason=gate.reason[:128] if gate is not None else "",
        node=pod.spec.nodeName[:253],
        lost_since=lost,
    )


def decode_pod(raw: bytes | msgspec.Raw) -> EnginePod:
    """A pod's JSON -> its record (msgspec.DecodeError / ValidationError when malformed)."""
    return engine_pod(_pod_decoder.decode(raw))


# --- the store ---------------------------------------------------------------------------


class NotListedYet(RuntimeError):
    """The engine pods of a namespace are asked for before its first list ended."""


class PodStore:
    """namespace -> uid -> `EnginePod`, and which scopes have been listed. Changed only on
    the event loop (by `PodWatch`).

    Also the pods that left the watch while their kv-connected gate was True, not being
    deleted (`departed`): the watch is filtered on the `kvtopo.dev/role` label, so a pod
    whose label is removed is reported DELETED although it runs on, and nothing else would
    ever write its gate again (on 7314fe4 it said `True/KVConnected` for good). The
    reconciler checks each one and turns its gate False (`settle` then forgets it); one that
    comes back into the watch is forgotten too. At most DEPARTED_KEPT per namespace (the
    oldest go first)."""

    DEPARTED_KEPT = 4096

    def __init__(self) -> None:
        self._pods: dict[str, dict[str, EnginePod]] = {}
        self._listed: set[Scope] = set()
        self._departed: dict[str, dict[str, EnginePod]] = {}
        self._versions: dict[str, int] = {}  # namespace -> changes of its pods so far

    def version(self, namespace: str) -> int:
        """A number that changes whenever the namespace's pods change (what is computed
        from them, e.g. the namespace's claim, is kept until it does)."""
        return self._versions.get(namespace, 0)

    def _changed(self, namespace: str) -> None:
        self._versions[namespace] = self._versions.get(namespace, 0) + 1

    def depart(self, pod: EnginePod) -> bool:
        """`pod` left the watch: remembered when its gate is True and it is not being
        deleted (whether it was)."""
        if pod.deleting or not pod.gated or pod.gate != "True":
            return False
        kept = self._departed.setdefault(pod.namespace, {})
        kept[pod.uid] = pod
        while len(kept) > self.DEPARTED_KEPT:
            del kept[next(iter(kept))]
        return True

    def departed(self, namespace: str) -> list[EnginePod]:
        """The namespace's pods that left the watch with their gate True, oldest first."""
        return list(self._departed.get(namespace, {}).values())

    def settle(self, namespace: str, uid: str) -> None:
        """The departed pod `uid` needs nothing more (its gate is False, or it is gone)."""
        kept = self._departed.get(namespace)
        if kept is not None:
            kept.pop(uid, None)
            if not kept:
                del self._departed[namespace]

    def listed(self, namespace: str) -> bool:
        return namespace in self._listed or None in self._listed

    def pods(self, namespace: str) -> list[EnginePod]:
        """The namespace's engine pods, oldest entry first. Raises `NotListedYet` before
        the first list covering the namespace ended (an empty answer would say every engine
        is gone)."""
        if not self.listed(namespace):
            raise NotListedYet(f"the engine pods of namespace {namespace!r} are not listed yet")
        return list(self._pods.get(namespace, {}).values())

    def namespaces(self) -> list[str]:
        return sorted(self._pods)

    def upsert(self, pod: EnginePod) -> bool:
        """Adds or replaces a pod; whether anything the operator reads changed."""
        return self.put(pod)[0]

    def put(self, pod: EnginePod) -> tuple[bool, EnginePod | None]:
        """Adds or replaces a pod: (whether anything the operator reads changed, the pod as
        it was)."""
        self.settle(pod.namespace, pod.uid)  # back in the watch, if it had left it
        pods = self._pods.setdefault(pod.namespace, {})
        old = pods.get(pod.uid)
        pods[pod.uid] = pod
        if old != pod:
            self._changed(pod.namespace)
            return True, old
        return False, old

    def remove(self, namespace: str, uid: str) -> bool:
        pods = self._pods.get(namespace)
        if pods is None or pods.pop(uid, None) is None:
            return False
        if not pods:
            del self._pods[namespace]
        self._changed(namespace)
        return True

    def replace(self, scope: Scope, pods: Iterable[EnginePod]) -> tuple[set[str], list[EnginePod]]:
        """A fresh list of `scope` found `pods`: they replace the scope's pods. Returns the
        namespaces whose pods changed and the pods dropped (in the store, not in the list:
        their deletion was missed)."""
        fresh: dict[str, dict[str, EnginePod]] = {}
        for pod in pods:
            if scope is None or pod.namespace == scope:
                fresh.setdefault(pod.namespace, {})[pod.uid] = pod
                self.settle(pod.namespace, pod.uid)
        old_scope = dict(self._pods) if scope is None else {scope: self._pods.get(scope, {})}
        changed: set[str] = set()
        dropped: list[EnginePod] = []
        for namespace in set(old_scope) | set(fresh):
            old, new = old_scope.get(namespace, {}), fresh.get(namespace, {})
            gone = [p for uid, p in old.items() if uid not in new]
            dropped.extend(gone)
            if gone or any(old.get(uid) != p for uid, p in new.items()):
                changed.add(namespace)
                self._changed(namespace)
            if new:
                self._pods[namespace] = new
            else:
                self._pods.pop(namespace, None)
        self._listed.add(scope)
        return changed, dropped


# --- the watch ---------------------------------------------------------------------------


class PodApi(Protocol):
    """The API calls the watch makes (`kube.ClusterApi` has them)."""

    def list_pods_raw(
        self, namespace: str | None, label_selector: str, *, limit: int, cont: str
    ) -> bytes: ...

    def watch_pods_raw(
        self,
        namespace: str | None,
        label_selector: str,
        *,
        resource_version: str,
        timeout_s: int,
    ) -> Iterator[bytes]:
        """The watch's lines (one JSON event each) until the server ends the stream."""
        ...


class Gone(Exception):
    """The watch's resourceVersion is too old ("410 Gone"): list afresh."""


_Change = tuple[str, Any]  # ("replace", (scope, pods)) / ("upsert", pod) / ("delete", pod)


class PodWatch:
    """Lists and watches the engine pods of each scope into `store`, on threads; calls
    `on_change(namespace)` on the event loop after a batch changed a namespace's pods.

    `relist_s` (0: never) bounds how long a watch runs before its scope is listed afresh;
    `dropped(pods)` is called for the pods a list dropped (deletions the watch missed).
    """

    PAGE = 500
    WATCH_S = 55  # the server ends each watch request after this long; the next resumes

    def __init__(
        self,
        api: PodApi,
        scopes: Sequence[Scope],
        store: PodStore,
        *,
        on_change: Callable[[str], None],
        on_pods: Callable[[str, list[EnginePod]], None] | None = None,
        dropped: Callable[[list[EnginePod]], None] = lambda pods: None,
        failed: Callable[[Scope, Exception], None] = lambda scope, exc: None,
        malformed: Callable[[], None] = lambda: None,
        relist_s: float = 0.0,
        backoff_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.scopes = list(scopes)
        self.store = store
        self.on_change = on_change
        # With `on_pods`, a batch's changed pods (as they were and as they are) go to it
        # instead, by namespace: a change pokes only the loops whose selectors match.
        self.on_pods = on_pods
        self.dropped = dropped
        self.failed = failed
        self.malformed = malformed
        self.relist_s = relist_s
        self.backoff_s = backoff_s
        self.clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[_Change] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._listed: dict[Scope, asyncio.Event] = {}

    # --- lifecycle (event loop) ------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for scope in self.scopes:
            self._listed[scope] = asyncio.Event()
            thread = threading.Thread(
                target=self._run, args=(scope,), name=f"kvtopo-pods-{scope or 'all'}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    async def wait_listed(self, timeout_s: float) -> bool:
        """Whether every scope's first list ended within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                for event in self._listed.values():
                    await event.wait()
        except TimeoutError:
            return False
        return True

    def stop(self) -> None:
        """Asks the threads to end (each ends at its watch's next line or timeout; they are
        daemons, so a process exits without waiting for them)."""
        self._stop.set()

    # --- the threads ------------------------------------------------------------------------

    def _run(self, scope: Scope) -> None:
        while not self._stop.is_set():
            try:
                version = self._list(scope)
                self._watch(scope, version)
            except Gone:
                log.info("pods of %s: watch expired (410 Gone); listing afresh", scope or "all")
            except Exception as exc:
                if self._stop.is_set():
                    return
                if getattr(exc, "status", None) == 410:  # the watch request itself: Gone
                    log.info("pods of %s: 410 Gone; listing afresh", scope or "all")
                    continue
                log.warning("watching the engine pods of %s: %s", scope or "all namespaces", exc)
                self.failed(scope, exc)
                self._stop.wait(self.backoff_s)

    def _list(self, scope: Scope) -> str:
        pods: list[EnginePod] = []
        cont, version = "", ""
        while True:
            page = _list_decoder.decode(
                self.api.list_pods_raw(scope, ROLE_LABEL, limit=self.PAGE, cont=cont)
            )
            for raw in page.items:
                try:
                    pods.append(decode_pod(raw))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self._post_malformed()
            version = page.metadata.resourceVersion or version
            cont = page.metadata.next
            if not cont:
                break
        self._post(("replace", (scope, pods)))
        return version

    def _watch(self, scope: Scope, version: str) -> None:
        started = self.clock()
        while not self._stop.is_set():
            left = self.relist_s - (self.clock() - started) if self.relist_s > 0 else self.WATCH_S
            if left <= 0:
                return  # time for a fresh list
            timeout = max(1, min(self.WATCH_S, int(left + 0.999)))
            for line in self.api.watch_pods_raw(
                scope, ROLE_LABEL, resource_version=version, timeout_s=timeout
            ):
                if self._stop.is_set():
                    return
                version = self._event(line) or version

    def _event(self, line: bytes) -> str:
        """Applies one watch line; the resourceVersion to resume from ("" if none)."""
        try:
            event = _event_decoder.decode(line)
            if event.type == "ERROR":
                status = _status_decoder.decode(event.object)
                if status.code == 410 or status.reason in ("Expired", "Gone"):
                    raise Gone(status.message)
                raise RuntimeError(f"watch error {status.code} {status.reason}: {status.message}")
            pod = decode_pod(event.object)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._post_malformed()
            return ""
        if event.type == "BOOKMARK":
            return pod.resource_version
        if event.type in ("ADDED", "MODIFIED"):
            self._post(("upsert", pod))
        elif event.type == "DELETED":
            self._post(("delete", pod))
        return pod.resource_version

    def _post_malformed(self) -> None:
        self._post(("malformed", None))

    # --- the hand-over to the event loop ------------------------------------------------------

    def _post(self, change: _Change) -> None:
        loop = self._loop
        if loop is None or self._stop.is_set():
            return  # a stopped watch changes nothing more
        with self._lock:
            self._pending.append(change)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            changes, self._pending = self._pending, []
            self._scheduled = False
        changed: set[str] = set()
        touched: dict[str, list[EnginePod]] = {}  # namespace -> pods changed, old and new
        every: set[str] = set()  # namespaces a list replaced: every loop of them is poked
        for kind, what in changes:
            if kind == "upsert":
                moved, old = self.store.put(what)
                if moved:
                    changed.add(what.namespace)
                    touched.setdefault(what.namespace, []).extend(
                        (what,) if old is None else (old, what)
                    )
            elif kind == "delete":
                if self.store.remove(what.namespace, what.uid):
                    changed.add(what.namespace)
                    touched.setdefault(what.namespace, []).append(what)
                if self.store.depart(what):
                    changed.add(what.namespace)
                    every.add(what.namespace)  # its gate: the oldest topology's loop
            elif kind == "replace":
                scope, pods = what
                namespaces, dropped = self.store.replace(scope, pods)
                changed |= namespaces
                every |= namespaces
                if scope in self._listed:
                    self._listed[scope].set()
                if dropped:
                    self.dropped(dropped)
                    for pod in dropped:
                        self.store.depart(pod)
            elif kind == "malformed":
                self.malformed()
        for namespace in sorted(changed):
            if self.on_pods is None or namespace in every:
                self.on_change(namespace)
            else:
                self.on_pods(namespace, touched.get(namespace, []))
