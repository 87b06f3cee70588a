"""Local credentials: the stand-ins of the chart's Secrets for processes this machine starts,
and a synchronous client of the worker control API that holds them.

Owns `Credentials` (the operator's key pair and the client token of the traffic routes, as
files: the private key is what the operator mounts, the public key what engines mount, the
token what a client of the traffic routes presents) and `ControlClient`, which calls an
engine's control API the way each route wants (`kvtopo_worker.signing`): admin routes signed
with the operator's key for the challenge the engine answered (fetched once per endpoint),
traffic routes with the client token as a bearer, and peer adds (`PUT /v1/peers/{id}`) given
the ticket the operator would mint for them. Tools and tests that act as the operator use it
(the tests' worker processes, the benchmarks' pairs); the operator itself signs in
`kvtopo_operator.workers`.

`Credentials.beside(token_file)` keeps the key pair in the token file's folder, created once,
so every process a test or a benchmark starts with one token file shares one operator key.
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtopo_worker.endpoints import EndpointError, parse_endpoint
from kvtopo_worker.signing import (
    CallerKey,
    Challenge,
    PrivateKeys,
    SignatureError,
    new_private_key,
    parse_challenge,
    private_pem,
    public_pem,
    route_kind,
)

OPERATOR_KEY = "operator.key"
OPERATOR_PUBLIC = "operator.pub"
MAX_ANSWER_BYTES = 64 << 20
UNUSABLE_TICKET = "0" * 16 + ":" + "0" * 64
"""A well-formed ticket that opens no engine: what a peer add to an endpoint that answered no
challenge carries (a crafted server in a test verifies nothing; a real engine refuses it)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, never followed (as every kvtopo client of the control API)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Credentials:
    """The files of one local deployment's credentials."""

    operator_key: Path  # the operator's private key (PEM): only the operator and tools
    operator_public: Path  # its public key (PEM): every engine
    client_token: Path  # the traffic routes' bearer token

    @classmethod
    def beside(cls, token_file: Path) -> Credentials:
        """The credentials whose client token is `token_file` (created, random, when it
        does not exist), the operator's key pair in the same folder (created once)."""
        folder = token_file.parent
        folder.mkdir(parents=True, exist_ok=True)
        if not token_file.exists():
            _write(token_file, secrets.token_urlsafe(32) + "\n", 0o600)
        key, public = folder / OPERATOR_KEY, folder / OPERATOR_PUBLIC
        if not key.exists() or not public.exists():
            private = new_private_key()
            _write(key, private_pem(private), 0o600)
            _write(public, public_pem(private), 0o644)
        return cls(key, public, token_file)

    def caller(self) -> CallerKey:
        """The operator's signing side, from the private key file (re-read when it changes)."""
        return CallerKey("operator", PrivateKeys(path=self.operator_key))

    def token(self) -> str:
        return self.client_token.read_text().strip().splitlines()[0]


@dataclass
class ControlClient:
    """Calls engines' control APIs as the operator (admin routes) and as a client (traffic
    routes). `fetcher` (engine id, incarnation) names the engine whose peer adds it sends,
    which their tickets are minted for."""

    caller: CallerKey
    token: str
    challenges: dict[str, Challenge] = field(default_factory=dict)

    @classmethod
    def of(cls, creds: Credentials) -> ControlClient:
        return cls(creds.caller(), creds.token())

    def _send(
        self, method: str, url: str, data: bytes | None, headers: dict[str, str], timeout: float
    ) -> tuple[int, bytes, dict[str, str]]:
        if not url.startswith("http://"):
            raise ValueError(f"the control API is plain HTTP, not {url[:40]!r}")
        req = urllib.request.Request(url, data=data, method=method, headers=headers)  # noqa: S310
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, resp.read(MAX_ANSWER_BYTES), dict(resp.headers)
        except urllib.error.HTTPError as err:
            return err.code, err.read(MAX_ANSWER_BYTES), dict(err.headers)

    def challenge(self, endpoint: str, timeout: float = 10) -> Challenge | None:
        """The challenge of the engine at `endpoint` (asked once: an unsigned read of its
        state is answered 401 with it); None when it answers none."""
        held = self.challenges.get(endpoint)
        if held is None:
            status, _, headers = self._send("GET", f"http://{endpoint}/v1/state", None, {}, timeout)
            held = parse_challenge(headers.get("WWW-Authenticate", "")) if status == 401 else None
            if held is not None:
                self.challenges[endpoint] = held
        return held

    def ticket(self, endpoint: str, fetcher: tuple[str, str]) -> str:
        """The ticket for `fetcher` to fetch the metadata of the engine at `endpoint`
        (`UNUSABLE_TICKET` when that endpoint is not ip:port, which is never dialled, or
        answers no challenge). The endpoint's challenge is asked afresh: the process there
        may have restarted since it was last asked."""
        try:
            parse_endpoint(endpoint)
            self.challenges.pop(endpoint, None)
            held = self.challenge(endpoint)
        except (EndpointError, OSError):
            held = None
        if held is None:
            return UNUSABLE_TICKET
        return self.caller.ticket(held, *fetcher)

    def call_raw(
        self,
        method: str,
        endpoint: str,
        path: str,
        body: bytes | None = None,
        timeout: float = 10,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """One call with the credential its route takes; a 401 with a new challenge (the
        engine restarted at this endpoint) is answered once more."""
        url = f"http://{endpoint}{path}"
        kind = route_kind(path.split("?", 1)[0])
        for attempt in range(2):
            sent = dict(headers or {})
            if body is not None:
                sent.setdefault("Content-Type", "application/json")
            if kind == "client":
                sent["Authorization"] = f"Bearer {self.token}"
            elif kind == "admin":
                held = self.challenge(endpoint, timeout)
                if held is not None:
                    sent["Authorization"] = self.caller.authorization(
                        held, method, path, endpoint, body or b""
                    )
            status, data, answer_headers = self._send(method, url, body, sent, timeout)
            if status == 401 and kind == "admin" and attempt == 0:
                fresh = parse_challenge(answer_headers.get("WWW-Authenticate", ""))
                if fresh is not None and fresh != self.challenges.get(endpoint):
                    self.challenges[endpoint] = fresh
                    continue
            return status, data
        raise AssertionError("unreachable")  # pragma: no cover

    def call(
        self,
        method: str,
        endpoint: str,
        path: str,
        body: object = None,
        timeout: float = 10,
        fetcher: tuple[str, str] | None = None,
    ) -> tuple[int, Any]:
        """`call_raw` with a JSON body and answer. A peer add (`PUT /v1/peers/{id}` naming
        an endpoint) without a ticket is given one minted for `fetcher`."""
        if (
            method == "PUT"
            and path.startswith("/v1/peers/")
            and isinstance(body, dict)
            and "endpoint" in body
            and "ticket" not in body
            and fetcher is not None
        ):
            body = {**body, "ticket": self.ticket(str(body["endpoint"]), fetcher)}
        data = json.dumps(body).encode() if body is not None else None
        status, raw = self.call_raw(method, endpoint, path, data, timeout)
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode(errors="replace")

    def metadata(
        self, endpoint: str, rank: int = 0, fetcher: tuple[str, str] = ("tool", "")
    ) -> bytes:
        """The engine's `GET /v1/metadata` envelope, fetched with a ticket for `fetcher` as a
        peer the operator paired it with would fetch it."""
        from kvtopo_worker.signing import header_value, ticket_authorization

        path = f"/v1/metadata?rank={rank}"
        ticket = self.ticket(endpoint, fetcher)
        try:
            auth = ticket_authorization(ticket, "GET", path, endpoint)
        except SignatureError as exc:  # pragma: no cover - minted here
            raise ValueError(str(exc)) from None
        status, data, _ = self._send(
            "GET",
            f"http://{endpoint}{path}",
            None,
            {
                "Authorization": auth,
                "KVTopo-From": header_value(fetcher[0]),
                "KVTopo-Incarnation": header_value(fetcher[1]),
            },
            10,
        )
        if status != 200:
            raise ValueError(f"metadata of {endpoint}: HTTP {status}: {data[:200]!r}")
        return data
