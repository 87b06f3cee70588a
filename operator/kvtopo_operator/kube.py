"""kvtopo's one wrapper of the official `kubernetes` client.

Owns connecting to an API server (`ClusterApi`: in-cluster, a kubeconfig, or the default
kubeconfig) and the calls made through the client: for the operator (`KubeClient`: reading a
KVTopology fresh, writing its status through the `/status` subresource, recording Events,
setting a pod condition; from a worker thread, so the asyncio
loop never blocks) and for kvtopo's tools (the drill, the benchmarks and the tests: applying
the CRD, KVTopology objects, pods as raw JSON). `LeaseClient` reads, creates and replaces the
one `coordination.k8s.io/v1` Lease that `leader` elects on (each call resourceVersion-conditional
where it writes, with a request timeout). Every call made through `ClusterApi` and
`KubeClient` carries a request timeout (`REQUEST_TIMEOUT_S` unless the constructor is given
another): a half-open connection fails the call instead of wedging its caller. The
operator's calls go through `ClusterApi.request` (the client's connection, authentication
and REST layer, with plain JSON): the client's generated API groups build a validator per
method when constructed, which cost the operator about 100 MB, so they are built only for
the tools that use them. No other operator module imports `kubernetes`.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvtopo_operator.api import GROUP, KIND, KV_CONNECTED_GATE, PLURAL, VERSION

log = logging.getLogger(__name__)

COMPONENT = "kvtopo-operator"
LEASE_GROUP, LEASE_VERSION, LEASE_PLURAL = "coordination.k8s.io", "v1", "leases"
REQUEST_TIMEOUT_S = 10.0
"""The connect and the read timeout of each API request (seconds). The client retries an
idempotent request (GET) after a failed read at most 3 times, so a read that never answers
fails within 4 of these; a write fails within one."""
# Only the objects' metadata in a list (the API server's PartialObjectMetadataList).
_METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def _pods(namespace: str | None) -> str:
    return "/api/v1/pods" if namespace is None else f"/api/v1/namespaces/{namespace}/pods"


def _topologies(namespace: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


class ServerClock:
    """The API server's clock, as this process measures it: the `Date` of its answers (one
    second's resolution) against the local wall clock, halfway through each call.

    The operator writes times that other replicas read as timers (an engine's `since` in
    the status, a condition's lastTransitionTime): written in the API server's time, a
    replica whose own clock is off by more than `SLACK_S` writes what the others would.
    `doubt` says why this replica cannot trust its clock now: the wall clock moved against
    the monotonic one since the last measurement (it was stepped) by more than `SLACK_S`;
    the next answer from the API server measures it again."""

    SLACK_S = 2.0

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wall = wall
        self._mono = mono
        self.offset = 0.0  # the API server's clock minus ours, when beyond SLACK_S (else 0)
        self.measured = False
        self._base = wall() - mono()  # wall minus monotonic at the last measurement

    def observe(self, date: str | None, sent: float, got: float) -> None:
        """One answer's `Date` header, for a call sent and answered at these wall times."""
        if not date:
            return
        try:
            server = email.utils.parsedate_to_datetime(date).timestamp() + 0.5
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        offset = server - (sent + got) / 2
        if got - sent > 2 * self.SLACK_S:
            return  # a slow answer tells too little
        self.offset = offset if abs(offset) > self.SLACK_S else 0.0
        self.measured = True
        self._base = self._wall() - self._mono()

    def time(self) -> float:
        return self._wall() + self.offset

    def now(self) -> datetime:
        """Now on the API server's clock (as last measured)."""
        return datetime.fromtimestamp(self.time(), UTC)

    def doubt(self) -> str:
        """Why this clock cannot be trusted now ("" when it can)."""
        moved = (self._wall() - self._mono()) - self._base
        if abs(moved) > self.SLACK_S:
            return (
                f"the wall clock moved {moved:+.0f} s against the monotonic clock since it was "
                "last compared with the API server's (stepped); waiting for the next answer"
            )
        return ""


SERVER_CLOCK = ServerClock()
"""This process's measure of the API server's clock (every `ClusterApi` call feeds it)."""


class ClusterApi:
    """The client's API groups on one connection, plus the calls kvtopo's tools share.

    `kubeconfig` names a kubeconfig file; without one, the in-cluster service account is used
    where there is one, else the default kubeconfig. Each call below waits at most
    `timeout_s` to connect and `timeout_s` for each read (`request_timeout`, the client's
    `_request_timeout`). The client's generated models are loosely typed, so the API groups
    are typed `Any`.
    """

    def __init__(
        self, kubeconfig: str | Path | None = None, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.request_timeout = (timeout_s, timeout_s)
        if kubeconfig:
            api_client = config.new_client_from_config(config_file=str(kubeconfig))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api_client = api_client

    # The client's generated API groups build a validator for each of their hundreds of
    # methods when constructed (CoreV1Api alone costs about 85 MB): built on first use only.
    # The operator's own calls go through `request`, which needs none of them.

    @functools.cached_property
    def core(self) -> Any:
        return client.CoreV1Api(self.api_client)

    @functools.cached_property
    def apps(self) -> Any:
        return client.AppsV1Api(self.api_client)

    @functools.cached_property
    def custom(self) -> Any:
        return client.CustomObjectsApi(self.api_client)

    @functools.cached_property
    def ext(self) -> Any:
        return client.ApiextensionsV1Api(self.api_client)

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, Any]] = (),
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
        timeout: tuple[float, float] | None = None,
    ) -> Any:
        """One request through the client's connection and authentication (its REST layer,
        not its generated API groups); the response, not read yet. Raises `ApiException`
        on a status other than 2xx."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, post = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        sent = time.time()
        resp = self.api_client.call_api(
            method, url, headers, body, post, _request_timeout=timeout or self.request_timeout
        )
        SERVER_CLOCK.observe(resp.getheader("date"), sent, time.time())
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException(http_resp=resp)
        return resp

    def request(self, method: str, path: str, **kwargs: Any) -> bytes:
        """A request's whole answer (its JSON, as bytes); `ApiException` unless 2xx. The
        keywords are `_send`'s."""
        return cast(bytes, self._send(method, path, **kwargs).read())

    def request_json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return cast(dict[str, Any], json.loads(self.request(method, path, **kwargs)))

    def apply_crd(self, body: dict[str, Any]) -> None:
        """Creates the CustomResourceDefinition, or replaces the one already there."""
        try:
            self.ext.create_custom_resource_definition(body, _request_timeout=self.request_timeout)
        except ApiException as exc:
            if exc.status != 409:
                raise
            name = body["metadata"]["name"]
            current = self.ext.read_custom_resource_definition(
                name, _request_timeout=self.request_timeout
            )
            version = current.metadata.resource_version
            replacement = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
            self.ext.replace_custom_resource_definition(
                name, replacement, _request_timeout=self.request_timeout
            )

    def crd_established(self, name: str) -> bool:
        """Whether the API server serves the CRD `name` (its Established condition)."""
        crd = self.ext.read_custom_resource_definition(name, _request_timeout=self.request_timeout)
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )

    def create_namespace(self, name: str) -> bool:
        """Creates namespace `name`; False when it exists already."""
        try:
            self.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        return True

    def create_topology(self, namespace: str, body: dict[str, Any]) -> None:
        """Creates a KVTopology object."""
        self.request("POST", _topologies(namespace), body=body)

    def list_topology_uids(self, namespace: str | None) -> dict[tuple[str, str], str]:
        """The KVTopologies of `namespace` (None: of every namespace): (namespace, name) ->
        uid. Their metadata only (a status can be hundreds of KiB)."""
        path = _topologies(namespace) if namespace else f"/apis/{GROUP}/{VERSION}/{PLURAL}"
        obj = self.request_json(
            "GET",
            path,
            accept="application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,"
            "application/json",
        )
        listed: dict[tuple[str, str], str] = {}
        for item in obj.get("items") or []:
            meta = item.get("metadata") or {}
            listed[(str(meta.get("namespace") or ""), str(meta.get("name") or ""))] = str(
                meta.get("uid") or ""
            )
        return listed

    def read_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The KVTopology `name` as the server has it, or None when there is none. Read by
        a list of that one name (a field selector), not a get: the operator's grants on
        KVTopologies are list and watch only."""
        obj = self.request_json(
            "GET", _topologies(namespace), query=[("fieldSelector", f"metadata.name={name}")]
        )
        items = [i for i in obj.get("items") or [] if i.get("metadata", {}).get("name") == name]
        return items[0] if items else None

    def list_pods(
        self, namespace: str | None, label_selector: str, *, metadata_only: bool = False
    ) -> list[dict[str, Any]]:
        """Pods as plain JSON mappings (the client's models cost seconds of CPU per thousand
        pods to build); of every namespace when `namespace` is None; with `metadata_only`,
        each item holds only the pod's `metadata`."""
        data = self.request(
            "GET",
            _pods(namespace),
            query=[("labelSelector", label_selector)],
            accept=_METADATA_ONLY if metadata_only else "application/json",
        )
        items: list[dict[str, Any]] = json.loads(data)["items"]
        return items

    def list_pods_raw(
        self, namespace: str | None, label_selector: str, *, limit: int, cont: str
    ) -> bytes:
        """One page of a pod list, as the API server's JSON (`podwatch` decodes it)."""
        query: list[tuple[str, Any]] = [("labelSelector", label_selector), ("limit", limit)]
        if cont:
            query.append(("continue", cont))
        return self.request("GET", _pods(namespace), query=query)

    def watch_pods_raw(
        self, namespace: str | None, label_selector: str, *, resource_version: str, timeout_s: int
    ) -> Iterator[bytes]:
        """A watch of pods from `resource_version`: its lines (one JSON event each) as they
        arrive, until the server ends it after `timeout_s` (bookmarks on). A read waits at most
        `timeout_s` plus the request timeout."""
        return self.watch_raw(
            _pods(namespace),
            label_selector,
            resource_version=resource_version,
            timeout_s=timeout_s,
        )

    def watch_raw(
        self, path: str, label_selector: str, *, resource_version: str, timeout_s: int
    ) -> Iterator[bytes]:
        """A watch of the collection at `path` (as `watch_pods_raw`)."""
        resp = self._send(
            "GET",
            path,
            query=[
                ("labelSelector", label_selector),
                ("watch", "true"),
                ("resourceVersion", resource_version),
                ("timeoutSeconds", timeout_s),
                ("allowWatchBookmarks", "true"),
            ],
            timeout=(self.request_timeout[0], timeout_s + self.request_timeout[1]),
        ).response  # the urllib3 response, read as it streams
        try:
            rest = b""
            for chunk in resp.stream(65536, decode_content=True):
                rest += chunk
                *lines, rest = rest.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield line
            if rest.strip():
                yield rest
        finally:
            resp.release_conn()

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Sets annotations on a pod (a merge patch)."""
        self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={"metadata": {"annotations": annotations}},
            content_type="application/merge-patch+json",
        )


class StatusNotFound(Exception):
    """A status write answered 404: the object is gone, or its kind has no status
    subresource (a CRD applied without it: an old or hand-edited one; Helm never upgrades
    CRDs). The caller reads the object to tell which."""

    status = 404


MISSING_STATUS_SUBRESOURCE = (
    "the KVTopology CRD has no status subresource (spec.versions[].subresources.status): "
    "the status cannot be written; apply the CRD of this operator's version "
    "(kubectl apply -f crds/kvtopology.yaml: helm upgrade does not upgrade CRDs)"
)


class KubeClient:
    """Thin async wrapper over the API calls the reconciler makes, each with the request
    timeout `request_timeout` (see `ClusterApi`)."""

    def __init__(self, kubeconfig: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        api = ClusterApi(kubeconfig, timeout_s)
        self.request_timeout = api.request_timeout
        self._api = api

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._api.read_topology, namespace, name)

    async def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        resource_version: str,
        uid: str = "",
    ) -> str | None:
        """Replaces `.status` (a merge patch of the whole status through the subresource),
        conditional on `resource_version` ("" for unconditional) and on the object's `uid`
        (never written onto another object of the same name). The object's new
        resourceVersion; None when the write was refused because the object changed since
        that version or is another one (409). Raises `StatusNotFound` on 404."""

        def call() -> str | None:
            body: dict[str, Any] = {"status": status}
            meta: dict[str, str] = {}
            if resource_version:
                meta["resourceVersion"] = resource_version
            if uid:
                meta["uid"] = uid
            if meta:
                body["metadata"] = meta
            try:
                obj = self._api.request_json(
                    "PATCH",
                    f"{_topologies(namespace)}/{name}/status",
                    body=body,
                    content_type="application/merge-patch+json",
                )
            except ApiException as exc:
                if exc.status == 409:
                    return None
                if exc.status == 404:
                    raise StatusNotFound(f"{namespace}/{name}: HTTP 404 on /status") from exc
                raise
            return str(obj.get("metadata", {}).get("resourceVersion") or "")

        return await asyncio.to_thread(call)

    async def record_event(
        self, topology: Mapping[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        meta = topology["metadata"]
        now = datetime.now(UTC)

        def call() -> None:
            stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
            event = {
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                },
                "reason": reason,
                "message": message[:1024],
                "type": event_type,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "source": {"component": COMPONENT},
                "reportingComponent": COMPONENT,
                "reportingInstance": COMPONENT,
            }
            try:
                self._api.request(
                    "POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=event
                )
            except ApiException as exc:
                log.warning("could not record event %s on %s: %s", reason, meta["name"], exc.reason)

        await asyncio.to_thread(call)

    async def read_pod_gate(self, namespace: str, name: str) -> tuple[str, str, bool] | None:
        """A pod's (uid, kv-connected condition status or "", whether it is being deleted);
        None when there is no such pod."""

        def call() -> tuple[str, str, bool] | None:
            try:
                obj = self._api.request_json("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            meta = obj.get("metadata") or {}
            gate = next(
                (
                    str(c.get("status") or "")
                    for c in (obj.get("status") or {}).get("conditions") or ()
                    if c.get("type") == KV_CONNECTED_GATE
                ),
                "",
            )
            return str(meta.get("uid") or ""), gate, bool(meta.get("deletionTimestamp"))

        return await asyncio.to_thread(call)

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> bool:
        """Sets one condition of a pod (a strategic merge patch of `pods/status`, merged by
        condition type, so the kubelet's conditions stay as they are). The pod's uid in the
        patch makes it fail rather than touch a new pod of the same name. False when the
        pod is gone or is another one now."""

        def call() -> bool:
            body = {"metadata": {"uid": uid}, "status": {"conditions": [condition]}}
            try:
                self._api.request(
                    "PATCH",
                    f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                    body=body,
                    content_type="application/strategic-merge-patch+json",
                )
            except ApiException as exc:
                if exc.status in (404, 409, 422):
                    return False
                raise
            return True

        return await asyncio.to_thread(call)


class LeaseConflict(Exception):
    """A Lease write was refused with HTTP 409: the Lease exists already (create) or changed
    since it was read (replace), i.e. another candidate wrote it first."""


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease's spec says about its holder, and the resourceVersion it was read at
    ("" for a record not written yet). Times are timezone-aware UTC."""

    holder_identity: str
    lease_duration_seconds: int
    acquire_time: datetime | None
    renew_time: datetime | None
    lease_transitions: int
    resource_version: str = ""


def _micro_time(t: datetime | None) -> str | None:
    """A MicroTime as the API server parses it (RFC 3339, always six fraction digits)."""
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> datetime | None:
    return None if not text else datetime.fromisoformat(text.replace("Z", "+00:00"))


class LeaseClient:
    """The one Lease `name` in `namespace`: get, create and replace, each from a worker thread
    with a request timeout of `timeout_s`.

    Goes through `ClusterApi.request` with plain JSON bodies: the typed Lease
    models re-serialize MicroTime values with `isoformat()`, which drops the fraction of a
    whole-second time, and the API server's RFC 3339 micro-time parser refuses that.
    """

    def __init__(self, api: ClusterApi, namespace: str, name: str, timeout_s: float = 5.0) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self.timeout_s = timeout_s
        self._path = f"/apis/{LEASE_GROUP}/{LEASE_VERSION}/namespaces/{namespace}/{LEASE_PLURAL}"

    def _record(self, obj: dict[str, Any]) -> LeaseRecord:
        spec = obj.get("spec") or {}
        return LeaseRecord(
            holder_identity=spec.get("holderIdentity") or "",
            lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=_parse_time(spec.get("acquireTime")),
            renew_time=_parse_time(spec.get("renewTime")),
            lease_transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(obj["metadata"]["resourceVersion"]),
        )

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            # The write applies only to the version read: a 409 when anyone wrote since.
            meta["resourceVersion"] = record.resource_version
        return {
            "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": record.holder_identity,
                "leaseDurationSeconds": record.lease_duration_seconds,
                "acquireTime": _micro_time(record.acquire_time),
                "renewTime": _micro_time(record.renew_time),
                "leaseTransitions": record.lease_transitions,
            },
        }

    async def get(self) -> LeaseRecord | None:
        """The Lease as the server has it, or None when there is none."""

        def call() -> LeaseRecord | None:
            try:
                obj = self._api.request_json(
                    "GET", f"{self._path}/{self.name}", timeout=(self.timeout_s, self.timeout_s)
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return self._record(obj)

        return await asyncio.to_thread(call)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        """Creates the Lease; `LeaseConflict` when it exists already."""

        def call() -> LeaseRecord:
            body = self._body(replace(record, resource_version=""))
            try:
                obj = self._api.request_json(
                    "POST", self._path, body=body, timeout=(self.timeout_s, self.timeout_s)
                )
            except ApiException as exc:
                if exc.status == 409:
                    raise LeaseConflict(f"lease {self.namespace}/{self.name} exists") from None
                raise
            return self._record(obj)

        return await asyncio.to_thread(call)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        """Replaces the Lease if it is still at `record.resource_version`; `LeaseConflict`
        when it changed (or is gone: there is nothing to renew then either)."""
        if not record.resource_version:
            raise ValueError("a Lease update needs the resourceVersion it was read at")

        def call() -> LeaseRecord:
            try:
                obj = self._api.request_json(
                    "PUT",
                    f"{self._path}/{self.name}",
                    body=self._body(record),
                    timeout=(self.timeout_s, self.timeout_s),
                )
            except ApiException as exc:
                if exc.status in (404, 409):
                    raise LeaseConflict(
                        f"lease {self.namespace}/{self.name} changed since version "
                        f"{record.resource_version} (HTTP {exc.status})"
                    ) from None
                raise
            return self._record(obj)

        return await asyncio.to_thread(call)
