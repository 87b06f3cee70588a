"""The operator's Kubernetes API calls (besides kopf's own watches).

Owns reading a KVTopology fresh, writing its status through the `/status` subresource with
an optimistic-concurrency precondition, and recording Events on it. Uses the official
`kubernetes` client from a worker thread, so the asyncio loop never blocks. Called by
`reconcile`.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvtopo_operator.api import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

COMPONENT = "kvtopo-operator"


class KubeClient:
    """Thin async wrapper over the API calls the reconciler makes."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        if kubeconfig:
            api_client = config.new_client_from_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        def call() -> dict[str, Any] | None:
            try:
                obj = self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name
                )
                return cast(dict[str, Any], obj)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        return await asyncio.to_thread(call)

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
