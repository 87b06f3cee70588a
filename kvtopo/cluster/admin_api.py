"""The bootstrap's own HTTPS view of the API server, authenticated as the cluster admin.

Owns the few requests that bring a local cluster up and decide it is ready (``/readyz``,
the components' ``/healthz``, creating fake Nodes, reading Nodes and ServiceAccounts):
plain ``http.client`` with the cluster CA and the admin client certificate, so start-up
pays neither for kubectl's discovery nor for the kubernetes client's import. The operator
and the tests talk to the cluster through its kubeconfig instead. Called by
:mod:`kvtopo.cluster.local_cluster`.
"""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from typing import Any

from kvtopo.cluster.pki import ClusterPki

REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ApiResponse:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class AdminApi:
    """Requests to ``https://127.0.0.1:<port>`` as the admin (``O=system:masters``)."""

    def __init__(self, pki: ClusterPki, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._tls = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._tls.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        port: int | None = None,
    ) -> ApiResponse:
        """One request; ``port`` targets another loopback component using the same CA."""
        connection = http.client.HTTPSConnection(
            self.host, port or self.port, context=self._tls, timeout=REQUEST_TIMEOUT_S
        )
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json"}
            if payload is not None:
                headers["Content-Type"] = "application/json"
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return ApiResponse(response.status, response.read())
        finally:
            connection.close()

    def is_healthy(self, path: str, *, port: int | None = None) -> bool:
        """True when ``path`` (``/readyz``, ``/healthz``) answers 200; False while it can't."""
        try:
            return self.request("GET", path, port=port).status == 200
        except (OSError, http.client.HTTPException):
            return False

    def get_json(self, path: str) -> Any:
        response = self.request("GET", path)
        if response.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status}: {response.body[:300]!r}")
        return response.json()

    def create(self, path: str, manifest: dict[str, Any]) -> None:
        """POST ``manifest`` to ``path``; an object that already exists is fine."""
        response = self.request("POST", path, manifest)
        if response.status not in (200, 201, 202, 409):
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {response.body[:300]!r}")
