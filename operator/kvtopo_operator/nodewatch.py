"""The Node watch: which nodes are not Ready, and since when (node loss from the Node itself).

Owns `NodeState`, `NodeStore` (node name -> its state) and `NodeWatch` (one thread that lists
the cluster's Nodes, then watches them from the list's resourceVersion, and lists afresh
after "410 Gone" or an error). Only a Node's name and its Ready condition are read.

Why (issue 54): the operator used to learn of a lost node only through a pod's own Ready,
which the node lifecycle controller flips to False when the node stops reporting. A gated
pod whose gate was False (half-connected, still handshaking) is not Ready already, so that
flip changes nothing, and its engine, unreachable, read as "cannot tell": its peers held it
for good. With the watch, an engine on a node whose Ready is not True is lost from the
node's own transition, gated or not (`handlers._pod_source` sets the pod's `lost_since`).

Optional (`--watch-nodes`; the chart's `nodes.watch`, a ClusterRole to list and watch
nodes): without it, the pod's Ready alone tells, as before. The store changes only on the
event loop; a change pokes the loops of the namespaces with pods on that node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import msgspec

log = logging.getLogger(__name__)


class _Condition(msgspec.Struct):
    type: str = ""
    status: str = ""
    lastTransitionTime: str | None = None  # noqa: N815 (the API's spelling)


class _Status(msgspec.Struct):
    conditions: list[_Condition] | None = None


class _Meta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""  # noqa: N815


class _Node(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    status: _Status = msgspec.field(default_factory=_Status)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""  # noqa: N815


class _NodeList(msgspec.Struct):
    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[_Node] = msgspec.field(default_factory=list)


class _Event(msgspec.Struct):
    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"{}")


_list = msgspec.json.Decoder(_NodeList)
_event = msgspec.json.Decoder(_Event)
_node = msgspec.json.Decoder(_Node)


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    ready: bool
    since: float | None  # Ready's last transition (epoch seconds), when known


def node_state(node: _Node) -> NodeState:
    ready = next((c for c in node.status.conditions or () if c.type == "Ready"), None)
    since: float | None = None
    if ready is not None and ready.lastTransitionTime:
        with contextlib.suppress(ValueError):
            since = datetime.fromisoformat(
                ready.lastTransitionTime.replace("Z", "+00:00")
            ).timestamp()
    # A node with no Ready condition yet (just registered) is not counted lost.
    return NodeState(node.metadata.name, ready is None or ready.status == "True", since)


class NodeStore:
    """node name -> `NodeState`; `lost_since(name)` for the pods on a node."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.listed = False
        self.version = 0  # changes whenever a node's readiness does

    def lost_since(self, name: str) -> float | None:
        """When node `name` stopped being Ready (epoch seconds); None while it is Ready,
        unknown, or not watched."""
        state = self.nodes.get(name)
        if state is None or state.ready:
            return None
        return state.since if state.since is not None else 0.0

    def put(self, state: NodeState) -> bool:
        old = self.nodes.get(state.name)
        self.nodes[state.name] = state
        changed = old is None or old.ready != state.ready or old.since != state.since
        self.version += changed
        return changed

    def remove(self, name: str) -> bool:
        gone = self.nodes.pop(name, None) is not None
        self.version += gone
        return gone


class NodeApi(Protocol):
    def request(self, method: str, path: str, **kwargs: object) -> bytes: ...

    def watch_raw(
        self, path: str, label_selector: str, *, resource_version: str, timeout_s: int
    ) -> Iterator[bytes]: ...


class NodeWatch:
    """Lists and watches the cluster's Nodes into `store` on a thread; calls
    `on_change(node name)` on the event loop when a node's readiness changed."""

    WATCH_S = 55

    def __init__(
        self,
        api: NodeApi,
        store: NodeStore,
        *,
        on_change: Callable[[str], None],
        backoff_s: float = 1.0,
    ) -> None:
        self.api = api
        self.store = store
        self.on_change = on_change
        self.backoff_s = backoff_s
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvtopo-nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listed = _list.decode(self.api.request("GET", "/api/v1/nodes"))
                self._post(None, [node_state(n) for n in listed.items])
                version = listed.metadata.resourceVersion
                while not self._stop.is_set():
                    for line in self.api.watch_raw(
                        "/api/v1/nodes", "", resource_version=version, timeout_s=self.WATCH_S
                    ):
                        event = _event.decode(line)
                        if event.type == "ERROR":
                            raise RuntimeError("the node watch ended (410 Gone or an error)")
                        node = _node.decode(event.object)
                        version = node.metadata.resourceVersion or version
                        if event.type in ("ADDED", "MODIFIED"):
                            self._post(node_state(node), None)
                        elif event.type == "DELETED":
                            self._post(NodeState(node.metadata.name, True, None), None)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.info("watching the nodes: %s; listing afresh", exc)
                self._stop.wait(self.backoff_s)

    def _post(self, one: NodeState | None, listed: list[NodeState] | None) -> None:
        loop = self._loop
        if loop is None or self._stop.is_set():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
            loop.call_soon_threadsafe(self._apply, one, listed)

    def _apply(self, one: NodeState | None, listed: list[NodeState] | None) -> None:
        changed: list[str] = []
        if listed is not None:
            names = {n.name for n in listed}
            changed += [
                n for n in list(self.store.nodes) if n not in names and self.store.remove(n)
            ]
            changed += [n.name for n in listed if self.store.put(n)]
            self.store.listed = True
        if one is not None and self.store.put(one):
            changed.append(one.name)
        for name in changed:
            self.on_change(name)
