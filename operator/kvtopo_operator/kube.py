"""kvtopo's one wrapper of the official `kubernetes` client.

Owns connecting to an API server (`ClusterApi`: in-cluster, a kubeconfig, or the default
kubeconfig) and the calls made through the client: for the operator (`KubeClient`: reading a
KVTopology fresh, writing its status through the `/status` subresource with an
optimistic-concurrency precondition, recording Events; from a worker thread, so the asyncio
loop never blocks) and for kvtopo's tools (the drill, the benchmarks and the tests: applying
the CRD, KVTopology objects, pods as raw JSON). No other operator module imports `kubernetes`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvtopo_operator.api import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

COMPONENT = "kvtopo-operator"


class ClusterApi:
    """The client's API groups on one connection, plus the calls kvtopo's tools share.

    `kubeconfig` names a kubeconfig file; without one, the in-cluster service account is used
    where there is one, else the default kubeconfig. The client's generated models are
    loosely typed, so the API groups are typed `Any`.
    """

    def __init__(self, kubeconfig: str | Path | None = None) -> None:
        if kubeconfig:
            api_client = config.new_client_from_config(config_file=str(kubeconfig))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.core: Any = client.CoreV1Api(api_client)
        self.apps: Any = client.AppsV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)
        self.ext: Any = client.ApiextensionsV1Api(api_client)

    def apply_crd(self, body: dict[str, Any]) -> None:
        """Creates the CustomResourceDefinition, or replaces the one already there."""
        try:
            self.ext.create_custom_resource_definition(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            name = body["metadata"]["name"]
            current = self.ext.read_custom_resource_definition(name)
            version = current.metadata.resource_version
            replacement = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
            self.ext.replace_custom_resource_definition(name, replacement)

    def crd_established(self, name: str) -> bool:
        """Whether the API server serves the CRD `name` (its Established condition)."""
        crd = self.ext.read_custom_resource_definition(name)
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )

    def create_namespace(self, name: str) -> bool:
        """Creates namespace `name`; False when it exists already."""
        try:
            self.core.create_namespace({"metadata": {"name": name}})
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        return True

    def create_topology(self, namespace: str, body: dict[str, Any]) -> None:
        """Creates a KVTopology object."""
        self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def read_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The KVTopology `name` as the server has it, or None when there is none."""
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return cast(dict[str, Any], obj)

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Pods as plain JSON mappings (the client's models cost seconds of CPU per thousand
        pods to build)."""
        resp = self.core.list_namespaced_pod(
            namespace, label_selector=label_selector, _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return items

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Sets annotations on a pod (a merge patch)."""
        self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})


class KubeClient:
    """Thin async wrapper over the API calls the reconciler makes."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        api = ClusterApi(kubeconfig)
        self._api = api
        self._custom = api.custom
        self._core = api.core

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._api.read_topology, namespace, name)

    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str
    ) -> bool:
        """Replaces `.status` (merge patch of the whole object); False on a conflict."""

        def call() -> bool:
            body = {"metadata": {"resourceVersion": resource_version}, "status": status}
            try:
                # A dict body is sent as a JSON merge patch; the resourceVersion in it makes
                # the write conditional on the version we read.
                self._custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, name, body
                )
            except ApiException as exc:
                if exc.status in (404, 409):
                    return False
                raise
            return True

        return await asyncio.to_thread(call)

    async def record_event(
        self, topology: dict[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        meta = topology["metadata"]
        now = datetime.now(UTC)

        def call() -> None:
            event = client.CoreV1Event(
                metadata=client.V1ObjectMeta(
                    generate_name=f"{meta['name']}.", namespace=meta["namespace"]
                ),
                involved_object=client.V1ObjectReference(
                    api_version=f"{GROUP}/{VERSION}",
                    kind=KIND,
                    name=meta["name"],
                    namespace=meta["namespace"],
                    uid=meta.get("uid"),
                    resource_version=meta.get("resourceVersion"),
                ),
                reason=reason,
                message=message[:1024],
                type=event_type,
                first_timestamp=now,
                last_timestamp=now,
                count=1,
                source=client.V1EventSource(component=COMPONENT),
                reporting_component=COMPONENT,
                reporting_instance=COMPONENT,
            )
            try:
                self._core.create_namespaced_event(meta["namespace"], event)
            except ApiException as exc:
                log.warning("could not record event %s on %s: %s", reason, meta["name"], exc.reason)

        await asyncio.to_thread(call)
