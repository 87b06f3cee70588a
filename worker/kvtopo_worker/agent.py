"""The worker's control API: how the operator (and peers) talk to an engine's KV registry.

Owns the aiohttp server that runs inside the engine process on its own thread and loop:

    GET    /v1/metadata[?rank=R]   rank R's EngineMetadata (versioned msgpack envelope; R: 0)
    PUT    /v1/peers/{engine_id}   {endpoint, role[, rank]}: fetch the peer's metadata and add
                                   its agent of each TP rank (or only of `rank`) to our rank
                                   of the same number (TP sizes must be equal); a peer held
                                   unhealthy (dropped, failing) is fetched again and its
                                   agents replaced (`renewed`)
    DELETE /v1/peers/{engine_id}[?rank=R]
                                   evict the peer (or its rank R; deferred while transfers
                                   are in flight)
    PATCH  /v1/peers               {add: [{engine_id, endpoint, role}], evict: [engine_id]
                                   [, handshake_timeout_s]}: many of the above in one call,
                                   an outcome per item (the adds bounded by the batch's
                                   handshake deadline, when given, not the worker's default)
    PUT    /v1/settings            {idle_ttl_s}: set the idle-TTL backstop (0: off); answers
                                   the effective WorkerSettings
    GET    /v1/state               WorkerState JSON: peers, failure counters, request counts,
                                   settings; with an ETag, and 304 (no body) to an
                                   If-None-Match naming it while nothing but the request
                                   counters moved (`protocol.state_tag`)
    POST   /v1/introductions       Introduction (msgpack): a peer handshaking lazily (no
                                   operator) introduces itself with its metadata; its agents
                                   are added and our metadata answered (peer token,
                                   signed; an engine id held by another live process, or
                                   evicted by the operator, is refused; 403 unless the
                                   engine takes lazy handshakes: `introductions`)
    GET    /metrics                Prometheus text (no token)
    GET    /healthz                liveness (no token)

Every other route needs the right credential (`kvtopo_worker.signing.route_kind`): the
admin routes (state, peers, settings) a call signed with the operator's key for this engine
(`KVTopo-Sig`; an unsigned or stale call is answered 401 with our challenge, which the
operator derives the call key from; this engine holds only the operator's public key);
`GET /v1/metadata` a request signed with the ticket the operator gave the fetching engine
(`KVTopo-Ticket`), or, only where lazy handshakes are on, with the shared peer token
(`KVTopo-Peer`, as `POST /v1/introductions`); the traffic routes a bearer client token. Each
key or token file may hold the previous key or token during a rotation, and is re-read when
it changes; while a file holds nothing usable its routes answer 503. Peer endpoints are
checked (`kvtopo_worker.endpoints`: ip:port only) before anything is dialled, no redirect is
followed, and a peer add may name the pod uid and incarnation the peer must have. Bad bodies
get a 4xx with an `ErrorBody`; peers' bytes are decoded in two phases and never reach NIXL
unchecked. NIXL handshakes run on one single-thread executor, at most one per engine (the
registry's handshake futures). Used by `emulated` and by real engines embedding kvtopo.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import generate_latest

from kvtopo_worker.credentials import (
    PEER_PROOF_HEADER,
    PEER_SCHEME,
    PeerRequestGuard,
    TokenError,
    TokenSource,
    bearer_token,
    peer_answer_proof,
    sign_peer_request,
    verify_peer_answer,
)
from kvtopo_worker.endpoints import Endpoint, EndpointError, parse_endpoint
from kvtopo_worker.http import read_bounded
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    MAX_HANDSHAKE_TIMEOUT_S,
    MAX_ID_LEN,
    MAX_IDLE_TTL_S,
    MAX_PEER_CHANGES,
    PEER_BATCH_CONCURRENCY,
    UNHEALTHY,
    EngineMetadata,
    ErrorBody,
    FailureType,
    IncompatibleEngine,
    Introduction,
    MalformedMessage,
    PeerAddItem,
    PeerAddRequest,
    PeerChanges,
    PeerChangesResult,
    PeerOutcome,
    PeerResult,
    ProtocolError,
    Role,
    WorkerSettings,
    WorkerState,
    decode_json_body,
    decode_metadata,
    encode_metadata,
    pairs_with,
    plays,
    state_tag,
    tag_matches,
)
from kvtopo_worker.registry import AgentConflict, EngineRegistry
from kvtopo_worker.serving import ConnectionCap, ServerLimits
from kvtopo_worker.signing import (
    SCHEME,
    SIGNATURE_WINDOW_S,
    TICKET_SCHEME,
    CallGuard,
    PublicKeys,
    SignatureError,
    header_text,
    header_value,
    route_kind,
    ticket_authorization,
    valid_ticket,
)
from kvtopo_worker.transport import TransportError

log = logging.getLogger(__name__)

MAX_ERROR_BODY_BYTES = 300
"""How much of a peer's non-200 answer is read (and quoted in the handshake failure)."""

MAX_METADATA_BYTES = 4 << 20
FROM_HEADER = "KVTopo-From"  # a ticketed peer request: the fetching engine's id
INCARNATION_HEADER = "KVTopo-Incarnation"  # and its incarnation (both base64url, UTF-8)
MAX_INTRODUCED_RANKS = 64
MAX_BODY_BYTES = 1 << 20  # the largest request body the control API takes (client_max_size)
MAX_INTRO_BYTES = MAX_BODY_BYTES  # as much as the server takes in
# Where a lazy handshake may dial by default: a request names the endpoint (its
# `kv_transfer_params`), so only the private, shared-address, loopback and unique-local
# networks pods live on; never a public address, nor link-local (cloud metadata services).
DEFAULT_INTRODUCTION_NETWORKS = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "fc00::/7",
    "::1/128",
)
MAX_INTRODUCED_AT = 4096  # endpoints remembered for lazily added peers (pruned to the held)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _TransfersInFlight(Exception):
    """The agents a renewal must replace carry transfers still; they leave when those end."""


class PeerTransport(Protocol):
    """What the control API needs from the transport to add a peer."""

    def add_remote_peer(self, meta: EngineMetadata) -> str: ...


@dataclass
class LocalEngine:
    """Everything the control API serves about the engine it lives in: `metadata` is rank
    0's; `ranks`, when the engine runs several TP ranks, every rank's in rank order."""

    engine_id: str
    role: Role
    metadata: EngineMetadata
    started_at: float
    ranks: list[EngineMetadata] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [self.metadata]
        if [m.tp_rank for m in self.ranks] != list(range(len(self.ranks))):
            raise ValueError("ranks must hold every TP rank's metadata in rank order")

    @property
    def compat_hash(self) -> str:
        return self.metadata.compat_hash


StateExtras = Callable[[], tuple[int, int, int]]  # (done, failed, in flight)


def _error(status: int, error: str, message: str, **extra: object) -> web.Response:
    body = ErrorBody(error=error, message=message, **extra)  # type: ignore[arg-type]
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


def _outcome(
    engine_id: str, op: Literal["add", "evict"], status: int, answer: PeerResult | ErrorBody
) -> PeerOutcome:
    if isinstance(answer, PeerResult):
        return PeerOutcome(
            engine_id=engine_id, op=op, status=status, result=answer.result, agents=answer.agents
        )
    return PeerOutcome(
        engine_id=engine_id,
        op=op,
        status=status,
        error=answer.error,
        message=answer.message,
        failure_type=answer.failure_type,
    )


def _query_rank(request: web.Request) -> int | None:
    """The `rank` query parameter (None when absent); MalformedMessage when not a rank."""
    text = request.query.get("rank")
    if text is None:
        return None
    if not text.isdigit() or len(text) > 4:
        raise MalformedMessage("rank must be a TP rank number")
    return int(text)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(obj), content_type="application/json"
    )


# A request signed with the peer credential: the token that verified it, and its header.
_PROOF_KEY = web.RequestKey("kvtopo_peer_proof", tuple[str, str])


async def _prove_answer(request: web.Request, response: web.StreamResponse) -> None:
    """The answer to a request signed with the peer credential carries its proof
    (`credentials.peer_answer_proof`): the side that dialled checks it came from a holder of
    the credential, for its request."""
    signed = request.get(_PROOF_KEY)
    if signed is None or not isinstance(response, web.Response):
        return
    body = response.body
    if isinstance(body, bytes | bytearray):
        token, header = signed
        response.headers[PEER_PROOF_HEADER] = peer_answer_proof(token, header, bytes(body))


class ControlServer:
    """The control API of one engine (all its TP ranks), on a background thread with its
    own loop."""

    def __init__(
        self,
        *,
        engine: LocalEngine,
        registry: EngineRegistry,
        transport: PeerTransport | Sequence[PeerTransport],
        operator_keys: PublicKeys | None,
        metrics: WorkerMetrics,
        client_token: TokenSource | None = None,
        peer_token: TokenSource | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout_s: float = 5.0,
        request_counts: StateExtras | None = None,
        introductions: bool = False,
        introduction_networks: Sequence[str] = DEFAULT_INTRODUCTION_NETWORKS,
        limits: ServerLimits | None = None,
    ) -> None:
        """`operator_keys`: the operator's public key(s), which the admin routes' calls must
        be signed for (`kvtopo_worker.signing`; None: no operator drives this engine, its
        admin routes are closed and it pairs lazily only). `client_token`: the bearer token of the
        traffic routes (None: they are closed). `introductions`: take lazy handshakes (`POST
        /v1/introductions`), for engines that pair without an operator (the vLLM
        connector's `lazy_handshake`), signed with `peer_token`, the one credential engines
        share (required then, refused otherwise); off, only the operator adds peers, peers
        fetch metadata with the operator's tickets, and an introduction is refused (403).
        `introduction_networks`: the CIDRs a lazy handshake may dial (the endpoint is a
        request's choice); ValueError for one that does not parse. `limits`: the server's
        connection, deadline and keep-alive bounds (`kvtopo_worker.serving`)."""
        if introductions and peer_token is None:
            raise ValueError("lazy handshakes (introductions) need the peer token")
        if operator_keys is None and not introductions:
            raise ValueError("an engine needs the operator's public key or lazy handshakes")
        self.engine = engine
        self.introductions = introductions
        self.introduction_networks = [
            ipaddress.ip_network(n.strip(), strict=False) for n in introduction_networks
        ]
        # Lazily added peers: the endpoint each proved itself at (a request never moves a
        # held peer elsewhere; see `_introduce`).
        self._introduced_at: dict[str, str] = {}
        self.registry = registry
        # One transport per local TP rank; a peer's rank r is added to ours.
        self.transports: list[PeerTransport] = (
            list(transport) if isinstance(transport, Sequence) else [transport]
        )
        if len(self.transports) != len(engine.ranks):
            raise ValueError("one transport per TP rank of the engine is needed")
        meta = engine.metadata
        self.guard = CallGuard(
            {"operator": operator_keys} if operator_keys is not None else {},
            pod_uid=meta.pod.uid if meta.pod is not None else "",
            incarnation=meta.incarnation,
        )
        self.client_token = client_token  # the traffic routes' bearer token
        # The shared peer credential, only where lazy handshakes are on.
        self.peer_token = peer_token if introductions else None
        self._peer_guard = PeerRequestGuard(peer_token) if peer_token is not None else None
        self.metrics = metrics
        self.host = host
        self.port = port
        self.handshake_timeout_s = handshake_timeout_s
        self._request_counts = request_counts or (lambda: (0, 0, 0))
        # Engines the operator evicted (whole) and has not added since: an engine that
        # handshakes lazily (`add_peer`) must not bring them back behind its back.
        self.operator_evicted: set[str] = set()
        self._metadata_bytes = [encode_metadata(m) for m in engine.ranks]
        # NIXL is not promised thread-safe: handshakes and teardown go through one thread.
        self.nixl_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtopo-nixl"
        )
        self.limits = limits or ServerLimits()
        self.connections = ConnectionCap(
            self.limits, lambda why: metrics.connections_refused_total.labels(why).inc()
        )
        self._listener: asyncio.Server | None = None
        self.app = web.Application(
            middlewares=[self._auth_middleware], client_max_size=MAX_BODY_BYTES
        )
        self.app.on_response_prepare.append(_prove_answer)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/metadata", self._get_metadata)
        self.app.router.add_get("/v1/state", self._get_state)
        self.app.router.add_put("/v1/peers/{engine_id}", self._put_peer)
        self.app.router.add_delete("/v1/peers/{engine_id}", self._delete_peer)
        self.app.router.add_patch("/v1/peers", self._patch_peers)
        self.app.router.add_put("/v1/settings", self._put_settings)
        self.app.router.add_post("/v1/introductions", self._post_introduction)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        """Where the control API listens (``ip:port``, IPv6 bracketed)."""
        try:
            return str(Endpoint(ipaddress.ip_address(self.host), self.port))
        except ValueError:  # a host name given to bind
            return f"{self.host}:{self.port}"

    # --- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Binds and serves on a background thread; returns once the port is bound."""
        self._thread = threading.Thread(target=self._serve, name="kvtopo-control", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise RuntimeError(
                f"control server could not bind {self.host}:{self.port}: {self._start_error}"
            ) from self._start_error

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._start_site())
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._cleanup())
        loop.close()

    async def _start_site(self) -> None:
        self._runner = web.AppRunner(
            self.app, access_log=None, keepalive_timeout=self.limits.keepalive_s
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        # The listener itself (not a TCPSite): its protocols are capped (`ConnectionCap`).
        self._listener = await asyncio.get_running_loop().create_server(
            self.connections.wrap(server), self.host, self.port, reuse_address=True
        )
        if self.port == 0:
            self.port = int(self._listener.sockets[0].getsockname()[1])

    async def _cleanup(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()

    def stop(self) -> None:
        if self.loop is not None and self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.nixl_executor.shutdown(wait=True, cancel_futures=True)

    # --- middleware ----------------------------------------------------------------------

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.connections.seen(request.transport)
        length = request.content_length or 0
        if length > MAX_BODY_BYTES:  # refused before any byte of it is awaited
            self.metrics.reject("control")
            return _error(413, "too_large", f"a body is at most {MAX_BODY_BYTES} bytes")
        if request.can_read_body:  # the whole body within the deadline (cached for handlers)
            try:
                await asyncio.wait_for(request.read(), self.limits.body_s)
            except TimeoutError:
                self.metrics.reject("control")
                return _error(
                    408, "body_timeout", f"the body did not arrive within {self.limits.body_s:g} s"
                )
        kind = route_kind(request.path)
        refused: web.Response | None = None
        if kind == "peer":
            refused = await self._authorize_peer(request)
        elif kind == "admin":
            refused = self._authorize_operator(request, await request.read())
        elif kind == "client":
            refused = self._authorize_client(request)
        if refused is not None:
            return refused
        try:
            return await handler(request)
        except ProtocolError as exc:
            self.metrics.reject("control")
            return _error(400, "bad_request", exc.message)
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("control API %s %s", request.method, request.path)
            return _error(500, "internal", f"{type(exc).__name__}: {exc}")

    def _signature_targets(self) -> list[str]:
        """The endpoints a peer's signature may name: ours, or (bound to every address)
        any address at our port."""
        targets = [self.endpoint]
        try:
            if ipaddress.ip_address(self.host).is_unspecified:
                return []  # checked by port in _authorize_peer
        except ValueError:
            pass
        return targets

    def _targets(self, request: web.Request) -> list[str]:
        """The endpoints a signature may name: ours, or (bound to every address) the host
        the request came to, when it is at our port."""
        targets = self._signature_targets()
        if not targets:  # bound to every address: the signed host is the caller's choice
            targets = [f"{request.host}"] if request.host.endswith(f":{self.port}") else []
        return targets

    async def _authorize_peer(self, request: web.Request) -> web.Response | None:
        """None when a peer route's request carries a peer credential: for `GET
        /v1/metadata` a ticket the operator minted for the fetching engine (or, where lazy
        handshakes are on, the peer token's signature or the token itself, for tools); for
        `POST /v1/introductions` the peer token's signature, where lazy handshakes are on."""
        header = request.headers.get("Authorization", "")
        body = await request.read()
        if header.startswith(TICKET_SCHEME + " ") and request.path == "/v1/metadata":
            fetcher = header_text(request.headers.get(FROM_HEADER, ""))
            incarnation = header_text(request.headers.get(INCARNATION_HEADER, ""))
            try:
                which = (
                    self.guard.accepts_ticket(
                        header,
                        fetcher,
                        incarnation,
                        request.method,
                        request.path_qs,
                        self._targets(request),
                        body,
                    )
                    if 0 < len(fetcher) <= MAX_ID_LEN and len(incarnation) <= MAX_ID_LEN
                    else None
                )
            except TokenError as exc:
                self.metrics.reject("control_auth")
                return _error(503, "key_unavailable", str(exc))
            if which is None:
                self.metrics.reject("control_auth")
                return _error(
                    401,
                    "unauthorized",
                    "the ticket signature does not verify (a ticket the operator minted for "
                    "another engine, incarnation or endpoint, a stale time or a nonce used "
                    "before)",
                )
            self.metrics.authenticated_total.labels("ticket", which).inc()
            return None
        if self._peer_guard is None or self.peer_token is None:
            if request.path == "/v1/introductions":
                return None  # answered 403 (and counted) by the route: no introductions here
            self.metrics.reject("control_auth")
            return _error(
                401,
                "unauthorized",
                f"a peer fetches metadata with the ticket the operator gave it ({TICKET_SCHEME})",
            )
        if header.startswith(PEER_SCHEME + " "):
            try:
                which = self._peer_guard.accepts(
                    header, request.method, request.path_qs, self._targets(request), body
                )
            except TokenError as exc:
                self.metrics.reject("control_auth")
                return _error(503, "token_unavailable", str(exc))
            if which is None:
                self.metrics.reject("control_auth")
                return _error(
                    401,
                    "unauthorized",
                    "the peer signature does not verify (wrong credential, another endpoint, "
                    "a stale time or a nonce used before)",
                )
            self.metrics.authenticated_total.labels("peer", which).inc()
            token = (
                self._peer_guard.source.current()
                if which == "current"
                else self._peer_guard.source.previous()
            )
            if token is not None:
                request[_PROOF_KEY] = (token, header)
            return None
        if request.path == "/v1/metadata":
            try:
                which = self.peer_token.accepts(bearer_token(header))
            except TokenError as exc:
                self.metrics.reject("control_auth")
                return _error(503, "token_unavailable", str(exc))
            if which is not None:
                self.metrics.authenticated_total.labels("peer", which).inc()
                return None
        self.metrics.reject("control_auth")
        return _error(401, "unauthorized", f"a request signed {PEER_SCHEME} is required")

    def _authorize_operator(self, request: web.Request, body: bytes) -> web.Response | None:
        """None when an admin route's call is signed by the operator's key for this engine
        (`kvtopo_worker.signing`); else 401 with our challenge (what the operator derives
        the call key from), 503 while the operator's public key file is bad, 403 when this
        engine has no operator (lazy handshakes only)."""
        if not self.guard.callers:
            self.metrics.reject("control_auth")
            return _error(403, "forbidden", "no operator drives this engine (no operator key)")
        try:
            which = self.guard.accepts(
                "operator",
                request.headers.get("Authorization", ""),
                request.method,
                request.path_qs,
                self._targets(request),
                body,
            )
        except TokenError as exc:  # no key of our own: nothing is authorised
            self.metrics.reject("control_auth")
            log.error("control API refused %s %s: %s", request.method, request.path, exc)
            return _error(503, "key_unavailable", str(exc))
        if which is not None:
            self.metrics.authenticated_total.labels("operator", which).inc()
            return None
        header = request.headers.get("Authorization", "")
        if self.guard.unknown_key("operator", header):
            self.metrics.rejected_total.labels("unknown_key").inc()
        elif not self.guard.stale(header):
            self.metrics.reject("control_auth")  # a bad signature (a stale one is no fault)
        message = (
            f"this route takes calls signed by the operator's key ({SCHEME}, derived from the "
            "challenge in WWW-Authenticate); no bearer token opens it"
        )
        skew = self.guard.skew(header)
        if skew is not None:
            self.metrics.rejected_total.labels("clock_skew").inc()
            message = (
                f"the call's time is {skew:+.0f} s from this engine's clock (the window is "
                f"{SIGNATURE_WINDOW_S:g} s): the caller's or this node's clock is off; sign "
                "against the time in the challenge (WWW-Authenticate now=)"
            )
        resp = _error(401, "unauthorized", message)
        resp.headers["WWW-Authenticate"] = self.guard.challenge("operator")
        return resp

    def _authorize_client(self, request: web.Request) -> web.Response | None:
        """None when a traffic route's request carries the client token (current or
        previous); 401 without it, 403 when this engine has none (its traffic routes are
        closed), 503 while its file is bad."""
        if self.client_token is None:
            self.metrics.reject("control_auth")
            return _error(
                403, "forbidden", "this engine serves no traffic routes (no client token)"
            )
        try:
            which = self.client_token.accepts(
                bearer_token(request.headers.get("Authorization", ""))
            )
        except TokenError as exc:
            self.metrics.reject("control_auth")
            log.error("control API refused %s %s: %s", request.method, request.path, exc)
            return _error(503, "token_unavailable", str(exc))
        if which is None:
            self.metrics.reject("control_auth")
            return _error(
                401, "unauthorized", "a valid 'Authorization: Bearer <client token>' is required"
            )
        self.metrics.authenticated_total.labels("client", which).inc()
        return None

    # --- routes --------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.peers.set(len(self.registry.engine_ids()))
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _get_metadata(self, request: web.Request) -> web.Response:
        rank = _query_rank(request)
        if rank is None:
            rank = 0
        if not 0 <= rank < len(self._metadata_bytes):
            raise MalformedMessage(f"rank must be 0..{len(self._metadata_bytes) - 1}")
        return web.Response(body=self._metadata_bytes[rank], content_type="application/msgpack")

    def state(self) -> WorkerState:
        done, failed, in_flight = self._request_counts()
        return WorkerState(
            engine_id=self.engine.engine_id,
            role=self.engine.role,
            compat_hash=self.engine.compat_hash,
            protocol_version=self.engine.metadata.compat.protocol_version,
            peers=self.registry.peer_states(),
            failures=self.metrics.failure_counts(),
            requests_done=done,
            requests_failed=failed,
            requests_in_flight=in_flight,
            started_at=self.engine.started_at,
            last_failure=self.metrics.last_failure,
            tp_size=len(self.transports),
            incarnation=self.engine.metadata.incarnation,
            pod=self.engine.metadata.pod,
            handshake_timeout_s=self.handshake_timeout_s,
            idle_ttl_s=self.registry.idle_ttl_s,
            writes_unreleasable=int(self.metrics.writes_unreleasable._value.get()),
        )

    async def _get_state(self, request: web.Request) -> web.Response:
        """The state, with its `ETag` (`protocol.state_tag`); `304 Not Modified` with no
        body when `If-None-Match` names the tag of the state now."""
        state = self.state()
        tag = state_tag(state)
        if tag_matches(request.headers.get("If-None-Match"), tag):
            return web.Response(status=304, headers={"ETag": tag})
        resp = _json(state)
        resp.headers["ETag"] = tag
        return resp

    @staticmethod
    def _path_engine_id(request: web.Request) -> str:
        engine_id = request.match_info["engine_id"]
        if not 0 < len(engine_id) <= MAX_ID_LEN:
            raise MalformedMessage(f"engine_id must be 1..{MAX_ID_LEN} characters")
        return engine_id

    def settings(self) -> WorkerSettings:
        return WorkerSettings(idle_ttl_s=self.registry.idle_ttl_s)

    async def _put_settings(self, request: web.Request) -> web.Response:
        """`PUT /v1/settings`: sets what the body names (nothing else changes); answers the
        effective settings. The idle TTL is read by the connectors' progress loops on every
        check, so a new value takes effect within a second."""
        body = decode_json_body(await request.read(), WorkerSettings)
        ttl = body.idle_ttl_s
        if ttl is not None:
            if not 0 <= ttl <= MAX_IDLE_TTL_S:
                raise MalformedMessage(f"idle_ttl_s must be 0..{MAX_IDLE_TTL_S:g} s (0: off)")
            if ttl != self.registry.idle_ttl_s:
                log.info("idle TTL set to %gs (was %gs)", ttl, self.registry.idle_ttl_s)
            self.registry.idle_ttl_s = ttl
        return _json(self.settings())

    def add_peer(
        self,
        engine_id: str,
        endpoint: str,
        role: Role,
        timeout_s: float | None = None,
        incarnation: str = "",
    ) -> tuple[int, PeerResult | ErrorBody]:
        """Adds a peer from another thread (an engine that handshakes lazily, on its own,
        where no operator connected the pair), exactly as `PUT /v1/peers/{engine_id}` does
        (`incarnation`: the process it must be; an older one held is replaced): its HTTP
        status and answer. Blocks for at most the handshake timeout and a second."""
        if self.loop is None:
            raise RuntimeError("the control server is not running")
        timeout = self.handshake_timeout_s if timeout_s is None else timeout_s
        fut = asyncio.run_coroutine_threadsafe(
            self._add_peer(engine_id, endpoint, role, incarnation=incarnation, timeout_s=timeout),
            self.loop,
        )
        try:
            return fut.result(timeout + 1.0)
        except MalformedMessage as exc:
            return 400, ErrorBody(error="malformed_message", message=str(exc))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            return 504, ErrorBody(error="timeout", message=f"no handshake within {timeout:g} s")

    async def _put_peer(self, request: web.Request) -> web.Response:
        engine_id = self._path_engine_id(request)
        body = decode_json_body(await request.read(), PeerAddRequest)
        self.operator_evicted.discard(engine_id)
        status, answer = await self._add_peer(
            engine_id,
            body.endpoint,
            body.role,
            body.rank,
            body.pod_uid,
            body.incarnation,
            ticket=body.ticket,
        )
        return _json(answer, status)

    async def _add_peer(
        self,
        engine_id: str,
        endpoint: str,
        role: Role,
        rank: int | None = None,
        pod_uid: str = "",
        incarnation: str = "",
        timeout_s: float | None = None,
        given: list[EngineMetadata] | None = None,
        ticket: str = "",
    ) -> tuple[int, PeerResult | ErrorBody]:
        """Adds one peer: each of its TP ranks (or only `rank`) to our rank of the same
        number, fetching each rank's metadata from `endpoint`; the HTTP status and body of
        the answer. Raises MalformedMessage for a request that makes no sense (an endpoint
        that is not ip:port is never dialled). `timeout_s` bounds each metadata fetch and
        the NIXL add (default: the worker's `handshake_timeout_s`).

        `pod_uid` and `incarnation`, when given, are what the peer must be: metadata from
        another pod or process is refused (409), and a peer held under an older incarnation
        (its engine restarted under the same id) has its agents evicted and is added anew.

        A peer held unhealthy (NIXL dropped it, or its transfers keep failing) is renewed
        instead of answered `present`: its metadata is fetched again (a fetch that fails
        leaves the old agents as they were), then its agents are evicted and the fetched
        ones added (`renewed`); while transfers to the old agents are still ending the
        answer is 409 `replacing` (the eviction runs when they have: retry then).

        `given`: the peer's metadata of every rank, from its introduction (nothing is
        fetched; `endpoint` is then only quoted). `ticket`: what the operator minted for us
        to fetch the peer's metadata with (`kvtopo_worker.signing`); without one, the fetch
        is signed with the peer token (lazy handshakes only)."""
        if ticket and not valid_ticket(ticket):
            raise MalformedMessage("a ticket is '<kid>:<64 lowercase hex digits>'")
        if not 0 < len(engine_id) <= MAX_ID_LEN:
            raise MalformedMessage(f"engine_id must be 1..{MAX_ID_LEN} characters")
        peer_endpoint: Endpoint | None = None
        if given is None:
            try:
                peer_endpoint = parse_endpoint(endpoint)
            except EndpointError as exc:
                raise MalformedMessage(f"endpoint refused: {exc}") from None
        if len(pod_uid) > MAX_ID_LEN or len(incarnation) > MAX_ID_LEN:
            raise MalformedMessage(f"pod_uid and incarnation must be 0..{MAX_ID_LEN} characters")
        if engine_id == self.engine.engine_id:
            raise MalformedMessage("an engine cannot be its own peer")
        timeout = self.handshake_timeout_s if timeout_s is None else timeout_s
        if not pairs_with(role, self.engine.role):
            raise MalformedMessage(f"a {role} engine pairs with the other role, not itself")
        local_tp = len(self.transports)
        if rank is not None and not 0 <= rank < local_tp:
            raise MalformedMessage(f"rank must be 0..{local_tp - 1} (this engine's TP ranks)")
        wanted = set(range(local_tp)) if rank is None else {rank}
        held = self.registry.incarnation(engine_id)
        if held is not None and incarnation and held != incarnation:
            replaced = await self._replace_incarnation(engine_id, held, incarnation)
            if replaced is not None:
                return replaced
        health = self.registry.health(engine_id)
        renew = health is not None and health[0] in UNHEALTHY
        if renew:  # every rank held or wanted is fetched again
            present = self.registry.snapshot(engine_id)
            ranks = wanted | set(present)
        else:
            present = self.registry.claim_present(engine_id)
            if wanted <= set(present):
                self.metrics.handshakes_total.labels("present").inc()
                return 200, PeerResult(engine_id=engine_id, result="present", agents=dict(present))
            ranks = wanted - set(present)
        metas: list[EngineMetadata] = []
        for r in sorted(ranks):
            if given is not None:
                metas.append(given[r])
                continue
            assert peer_endpoint is not None
            fetched = await self._fetch_rank(
                engine_id, peer_endpoint, role, r, local_tp, pod_uid, incarnation, timeout, ticket
            )
            if isinstance(fetched, tuple):
                return fetched
            metas.append(fetched)

        def add() -> dict[int, str]:
            # On the NIXL thread, so checks and adds of all engines run one at a time.
            now = self.registry.health(engine_id)
            if renew and now is not None and now[0] in UNHEALTHY:
                # Evicted first: NIXL refuses to load an agent it holds, and never reconnects
                # one it reported disconnected. (Skipped when a renewal that ran meanwhile
                # made the peer healthy again.)
                result = self.registry.evict(engine_id, "unhealthy")
                self.metrics.evictions_total.labels(result).inc()
                if result == "deferred":
                    raise _TransfersInFlight(
                        f"engine {engine_id} is {now[0]} ({now[1]}); its agents leave once its "
                        "transfers in flight end: retry then"
                    )
            added: dict[int, str] = {}
            for meta in metas:
                owner = self.registry.agent_owner(meta.agent_name)
                if owner is not None and owner != engine_id:
                    raise AgentConflict(f"agent {meta.agent_name} belongs to engine {owner}")
                if not self.registry.wait_released(meta.agent_name, timeout):
                    raise TimeoutError(f"agent {meta.agent_name} is still being torn down")
                # Our rank r pairs with the peer's rank r (homogeneous TP).
                added[meta.tp_rank] = self.transports[meta.tp_rank].add_remote_peer(meta)
            self.registry.add_engine(engine_id, added, metas[0].incarnation)
            return added

        fut = self.registry.handshake(engine_id, lambda: self.nixl_executor.submit(add))
        try:
            agents = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except _TransfersInFlight as exc:
            return 409, ErrorBody(error="replacing", message=str(exc))
        except (AgentConflict, TransportError) as exc:
            if isinstance(exc, TransportError) and exc.kind != "identity":
                msg = f"adding the NIXL agent of {engine_id}: {exc}"
                return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 502)
            msg = f"{endpoint} claims another engine's identity: {exc}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        except Exception as exc:
            msg = f"adding the NIXL agent of {engine_id}: {type(exc).__name__}: {exc}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 502)
        result: Literal["added", "renewed"] = "renewed" if renew else "added"
        self.metrics.handshakes_total.labels(result).inc()
        if renew and health is not None:
            log.warning(
                "peer %s (%s) renewed (it was %s: %s): %s", engine_id, role, *health, agents
            )
        else:
            log.info("peer %s (%s) added: %s", engine_id, role, agents)
        return 200, PeerResult(
            engine_id=engine_id, result=result, agents=dict(self.registry.snapshot(engine_id))
        )

    async def _replace_incarnation(
        self, engine_id: str, held: str, incarnation: str
    ) -> tuple[int, ErrorBody] | None:
        """The peer restarted under the same engine id: evicts the agents of its old
        incarnation (their process is gone). None once they are gone; the answer to give
        while transfers to them are still ending (the eviction then runs when they have)."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self.nixl_executor, lambda: self.registry.evict(engine_id, "restarted")
        )
        self.metrics.evictions_total.labels(result).inc()
        log.info(
            "peer %s restarted (incarnation %s -> %s): old agents %s",
            engine_id,
            held,
            incarnation,
            result,
        )
        if result == "deferred":
            msg = (
                f"engine {engine_id} restarted (incarnation {held} -> {incarnation}); the old "
                "incarnation's agents leave once its transfers in flight end: retry then"
            )
            return 409, ErrorBody(error="replacing", message=msg)
        return None

    async def _fetch_rank(
        self,
        engine_id: str,
        endpoint: Endpoint,
        role: Role,
        rank: int,
        local_tp: int,
        pod_uid: str = "",
        incarnation: str = "",
        timeout_s: float | None = None,
        ticket: str = "",
    ) -> EngineMetadata | tuple[int, ErrorBody]:
        """The peer's metadata for one rank, checked against what the caller says the peer
        is (engine id, role, TP size, and when given its pod uid and incarnation); or the
        answer to give when it is not. The fetch takes at most `timeout_s` (default: the
        worker's `handshake_timeout_s`)."""
        try:
            raw = await self._fetch_metadata(endpoint, rank, timeout_s, ticket)
            meta = decode_metadata(raw, self.engine.compat_hash)
        except IncompatibleEngine as exc:
            self.metrics.handshakes_total.labels("incompatible").inc()
            self.metrics.record_failure(
                FailureType.INCOMPATIBLE, {"engine_id": engine_id, "msg": exc.message}
            )
            return 409, ErrorBody(
                error="incompatible",
                message=exc.message,
                failure_type=FailureType.INCOMPATIBLE,
                local_hash=exc.local_hash,
                remote_hash=exc.remote_hash,
            )
        except ProtocolError as exc:
            return self._handshake_failed(engine_id, exc.failure_type, exc.message, 502)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # SignatureError too
            msg = f"fetching metadata from {endpoint}: {type(exc).__name__}: {exc}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 502)
        if meta.engine_id != engine_id:
            msg = f"{endpoint} serves engine {meta.engine_id}, not {engine_id}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        if not plays(meta.role, role):
            msg = f"{endpoint} is a {meta.role} engine, not {role}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        if meta.tp_size != local_tp:
            msg = f"{engine_id} runs {meta.tp_size} TP ranks, this engine {local_tp}"
            self.metrics.handshakes_total.labels("incompatible").inc()
            self.metrics.record_failure(
                FailureType.INCOMPATIBLE, {"engine_id": engine_id, "msg": msg}
            )
            return 409, ErrorBody(
                error="incompatible", message=msg, failure_type=FailureType.INCOMPATIBLE
            )
        if meta.tp_rank != rank:
            msg = f"{endpoint} answered rank {meta.tp_rank} for rank {rank}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 502)
        served_uid = meta.pod.uid if meta.pod is not None else ""
        if pod_uid and served_uid != pod_uid:
            msg = f"{endpoint} serves an engine of pod uid {served_uid!r}, not {pod_uid!r}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        if incarnation and meta.incarnation != incarnation:
            msg = (
                f"{endpoint} serves incarnation {meta.incarnation!r} of {engine_id}, "
                f"not {incarnation!r}"
            )
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        return meta

    async def _patch_peers(self, request: web.Request) -> web.Response:
        """`PATCH /v1/peers`: a batch of adds and evictions, each handled as its own route
        would handle it; a bad item fails alone (status 400), the others still happen."""
        body = decode_json_body(await request.read(), PeerChanges)
        if len(body.add) + len(body.evict) > MAX_PEER_CHANGES:
            raise MalformedMessage(f"at most {MAX_PEER_CHANGES} adds and evictions per call")
        timeout = body.handshake_timeout_s
        if timeout is not None and not 0 < timeout <= MAX_HANDSHAKE_TIMEOUT_S:
            raise MalformedMessage(
                f"handshake_timeout_s must be more than 0 and at most {MAX_HANDSHAKE_TIMEOUT_S:g} s"
            )
        sem = asyncio.Semaphore(PEER_BATCH_CONCURRENCY)

        async def add(item: PeerAddItem) -> PeerOutcome:
            self.operator_evicted.discard(item.engine_id)
            async with sem:
                try:
                    status, answer = await self._add_peer(
                        item.engine_id,
                        item.endpoint,
                        item.role,
                        item.rank,
                        item.pod_uid,
                        item.incarnation,
                        timeout,
                        ticket=item.ticket,
                    )
                except ProtocolError as exc:
                    self.metrics.reject("control")
                    status, answer = 400, ErrorBody(error="bad_request", message=exc.message)
            return _outcome(item.engine_id, "add", status, answer)

        async def evict(engine_id: str) -> PeerOutcome:
            if not 0 < len(engine_id) <= MAX_ID_LEN:
                self.metrics.reject("control")
                msg = f"engine_id must be 1..{MAX_ID_LEN} characters"
                return _outcome(
                    engine_id, "evict", 400, ErrorBody(error="bad_request", message=msg)
                )
            return _outcome(engine_id, "evict", 200, await self._evict_peer(engine_id))

        results = await asyncio.gather(*map(add, body.add), *map(evict, body.evict))
        return _json(PeerChangesResult(results=list(results)))

    def _handshake_failed(
        self, engine_id: str, failure: FailureType, message: str, status: int
    ) -> tuple[int, ErrorBody]:
        self.metrics.handshakes_total.labels("failed").inc()
        self.metrics.record_failure(failure, {"engine_id": engine_id, "msg": message})
        return status, ErrorBody(error="handshake_failed", message=message, failure_type=failure)

    async def _fetch_metadata(
        self, endpoint: Endpoint, rank: int = 0, timeout_s: float | None = None, ticket: str = ""
    ) -> bytes:
        """GET the peer's metadata within `timeout_s` (default: the worker's
        `handshake_timeout_s`), signed with `ticket` (or, without one, the peer token): no
        redirect is followed (a 3xx is a failure), and every read is bounded."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        total = self.handshake_timeout_s if timeout_s is None else timeout_s
        path = f"/v1/metadata?rank={rank}"
        if ticket:
            resp = await self._session.get(
                endpoint.url(path),
                headers={
                    "Authorization": ticket_authorization(ticket, "GET", path, str(endpoint)),
                    FROM_HEADER: header_value(self.engine.engine_id),
                    INCARNATION_HEADER: header_value(self.engine.metadata.incarnation),
                },
                timeout=aiohttp.ClientTimeout(total=total),
                allow_redirects=False,
            )
        elif self.peer_token is not None:
            resp, token, header = await self._signed(endpoint, "GET", path, b"", total)
            async with resp:
                if resp.status == 200:
                    data = await read_bounded(resp.content, MAX_METADATA_BYTES)
                    if len(data) > MAX_METADATA_BYTES:
                        raise ValueError(f"peer metadata exceeds {MAX_METADATA_BYTES} bytes")
                    return self._proven(endpoint, resp, token, header, data)
                text = (await read_bounded(resp.content, MAX_ERROR_BODY_BYTES)).decode(
                    "utf-8", "replace"
                )[:MAX_ERROR_BODY_BYTES]
                raise ValueError(f"peer answered HTTP {resp.status}: {text}")
        else:
            raise SignatureError(
                "no ticket to fetch the peer's metadata with: the operator gives one with "
                "each peer add (lazy handshakes sign with the peer token instead)"
            )
        async with resp:
            if resp.status != 200:
                # A bounded prefix: an error answer can be endless or huge.
                text = (await read_bounded(resp.content, MAX_ERROR_BODY_BYTES)).decode(
                    "utf-8", "replace"
                )[:MAX_ERROR_BODY_BYTES]
                raise ValueError(f"peer answered HTTP {resp.status}: {text}")
            data = await read_bounded(resp.content, MAX_METADATA_BYTES)
            if len(data) > MAX_METADATA_BYTES:
                raise ValueError(f"peer metadata exceeds {MAX_METADATA_BYTES} bytes")
            return data

    async def _signed(
        self, endpoint: Endpoint, method: str, path: str, body: bytes, timeout_s: float
    ) -> tuple[aiohttp.ClientResponse, str, str]:
        """A request to a peer signed with the peer credential (never sent itself); a peer
        not yet given the rotated token is asked again, signed with the previous one. No
        redirect is followed. The answer, and the token and header that signed the request
        (`_proven` checks the answer with them). The caller releases the answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        if self.peer_token is None:
            raise SignatureError("lazy handshakes are off: this engine holds no peer token")
        tokens = self.peer_token.candidates()
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for i, token in enumerate(tokens):
            header = sign_peer_request(token, method, path, str(endpoint), body)
            resp = await self._session.request(
                method,
                endpoint.url(path),
                data=body or None,
                headers={"Authorization": header},
                timeout=timeout,
                allow_redirects=False,
            )
            if resp.status == 401 and i + 1 < len(tokens):
                resp.release()
                continue
            return resp, token, header
        raise ValueError("no credential to try")

    @staticmethod
    def _proven(
        endpoint: Endpoint, resp: aiohttp.ClientResponse, token: str, header: str, data: bytes
    ) -> bytes:
        """`data`, the answer to a signed peer request, once its proof verifies; otherwise
        SignatureError: the endpoint does not hold the peer credential (a stranger a request
        named), and nothing it said is used."""
        proof = resp.headers.get(PEER_PROOF_HEADER, "")
        if not verify_peer_answer(token, header, data, proof):
            raise SignatureError(
                f"{endpoint}'s answer carries no valid proof of the peer credential "
                f"({PEER_PROOF_HEADER}): not an engine that shares it"
            )
        return data

    # --- introductions (lazy handshakes, no operator) ----------------------------------------

    def introduce(
        self, engine_id: str, endpoint: str, role: Role, incarnation: str = ""
    ) -> tuple[int, PeerResult | ErrorBody]:
        """From another thread: introduces this engine to the peer at `endpoint` (a lazy
        handshake, where no operator connects the pair: the endpoint comes from a request,
        so nothing reusable is sent there), then adds the peer from its answer, which must
        be `engine_id` (and, when given, that `incarnation`). Its HTTP status and answer."""
        if self.loop is None:
            raise RuntimeError("the control server is not running")
        timeout = self.handshake_timeout_s
        fut = asyncio.run_coroutine_threadsafe(
            self._introduce(engine_id, endpoint, role, incarnation, timeout), self.loop
        )
        try:
            return fut.result(2 * timeout + 1.0)
        except MalformedMessage as exc:
            return 400, ErrorBody(error="malformed_message", message=str(exc))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            return 504, ErrorBody(error="timeout", message=f"no handshake within {timeout:g} s")

    def _introduction(self, *, hello: bool = False) -> bytes:
        """Our introduction; a `hello` names the engine only (no metadata: what an
        introduction opens with, before the peer proved itself)."""
        return msgspec.msgpack.encode(
            Introduction(
                engine_id=self.engine.engine_id,
                role=self.engine.role,
                ranks=[] if hello else list(self._metadata_bytes),
            )
        )

    def _decode_introduction(
        self, data: bytes, *, hello: bool = False
    ) -> tuple[Introduction, list[EngineMetadata]]:
        """The peer's introduction and its ranks' metadata, checked (MalformedMessage,
        IncompatibleEngine); with `hello`, one without metadata is taken too (no ranks)."""
        try:
            intro = msgspec.msgpack.decode(data, type=Introduction)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(f"bad introduction: {exc}") from None
        if hello and not intro.ranks:
            if not 0 < len(intro.engine_id) <= MAX_ID_LEN:
                raise MalformedMessage(f"engine_id must be 1..{MAX_ID_LEN} characters")
            return intro, []
        if not 0 < len(intro.ranks) <= MAX_INTRODUCED_RANKS:
            raise MalformedMessage(f"an introduction names 1..{MAX_INTRODUCED_RANKS} ranks")
        metas = [decode_metadata(raw, self.engine.compat_hash) for raw in intro.ranks]
        if len(metas) != len(self.transports):
            raise IncompatibleEngine(
                f"{intro.engine_id} runs {len(metas)} TP ranks, this engine {len(self.transports)}",
                local_hash=self.engine.compat_hash,
                remote_hash=metas[0].compat_hash,
            )
        for r, meta in enumerate(metas):
            if (
                meta.engine_id != intro.engine_id
                or meta.role != intro.role
                or meta.tp_rank != r
                or meta.incarnation != metas[0].incarnation
            ):
                raise MalformedMessage("an introduction's ranks disagree with it")
        return intro, metas

    async def _introduce(
        self, engine_id: str, endpoint: str, role: Role, incarnation: str, timeout_s: float
    ) -> tuple[int, PeerResult | ErrorBody]:
        """A lazy handshake a request asked for. The request's word (`endpoint`,
        `incarnation`) is untrusted: the endpoint must be in `introduction_networks`, and a
        peer held healthy is never replaced on it. Such a peer is re-checked where it proved
        itself (its metadata fetched there, nothing of ours sent): the request fails while
        the process held still answers there; where it is gone (no answer, or another
        process of the engine there), the request's endpoint is tried. A peer the operator
        added is the operator's to change."""
        try:
            peer = parse_endpoint(endpoint)
        except EndpointError as exc:
            raise MalformedMessage(f"endpoint refused: {exc}") from None
        if not any(peer.ip in net for net in self.introduction_networks):
            nets = ", ".join(map(str, self.introduction_networks))
            msg = (
                f"a request names {endpoint} for engine {engine_id}: outside the networks lazy "
                f"handshakes may dial (lazy_peer_networks: {nets})"
            )
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 403)
        refused = await self._held_elsewhere(engine_id, endpoint, incarnation, timeout_s)
        if refused is not None:
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, refused, 409)
        # First a hello (our name, no metadata): the answer must prove the peer credential
        # (a stranger a request named learns nothing of use), then our metadata.
        try:
            data = await self._exchange(peer, self._introduction(hello=True), timeout_s)
            intro, metas = self._decode_introduction(data)
            if intro.engine_id != engine_id or not plays(intro.role, role):
                msg = f"{endpoint} is {intro.role} engine {intro.engine_id}, not {role} {engine_id}"
                return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
            if incarnation and metas[0].incarnation != incarnation:
                msg = f"{endpoint} is incarnation {metas[0].incarnation!r}, not {incarnation!r}"
                return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
            data = await self._exchange(peer, self._introduction(), timeout_s)
            intro, metas_now = self._decode_introduction(data)
        except ProtocolError as exc:
            return self._handshake_failed(engine_id, exc.failure_type, exc.message, 502)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            msg = f"introducing ourselves to {endpoint}: {type(exc).__name__}: {exc}"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 502)
        if intro.engine_id != engine_id or metas_now[0].incarnation != metas[0].incarnation:
            msg = f"{endpoint} changed its identity between the hello and the introduction"
            return self._handshake_failed(engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
        metas = metas_now
        status, answer = await self._add_peer(
            engine_id, endpoint, role, incarnation=metas[0].incarnation, given=metas
        )
        if status == 200:
            self._introduced_at[engine_id] = endpoint
            if len(self._introduced_at) > MAX_INTRODUCED_AT:
                held = set(self.registry.engine_ids())
                self._introduced_at = {e: at for e, at in self._introduced_at.items() if e in held}
        return status, answer

    async def _exchange(self, peer: Endpoint, body: bytes, timeout_s: float) -> bytes:
        """POSTs an introduction to `peer`, signed with the peer credential; its answer once
        the answer's proof verifies (SignatureError otherwise; ValueError for an answer
        other than 200, quoting a bounded prefix of it)."""
        resp, token, header = await self._signed(peer, "POST", "/v1/introductions", body, timeout_s)
        async with resp:
            if resp.status != 200:
                text = (await read_bounded(resp.content, MAX_ERROR_BODY_BYTES)).decode(
                    "utf-8", "replace"
                )
                raise ValueError(f"{peer} answered the introduction HTTP {resp.status}: {text}")
            data = await read_bounded(resp.content, MAX_INTRO_BYTES)
            return self._proven(peer, resp, token, header, data)

    async def _held_elsewhere(
        self, engine_id: str, endpoint: str, incarnation: str, timeout_s: float
    ) -> str | None:
        """Why a request may not introduce us to `engine_id` at `endpoint` (as
        `incarnation`), or None when it may: the engine is held, healthy, and either the
        operator added it or the process held still serves it where it proved itself."""
        held = self.registry.incarnation(engine_id)
        health = self.registry.health(engine_id)
        if held is None or (health is not None and health[0] in UNHEALTHY):
            return None
        at = self._introduced_at.get(engine_id)
        if at is None:
            return (
                f"engine {engine_id} is held (incarnation {held}) as the operator paired it; "
                f"a request naming {endpoint} does not change it"
            )
        if at == endpoint:
            return None  # the same place: its answer tells (and must prove the incarnation)
        try:
            raw = await self._fetch_metadata(parse_endpoint(at), 0, timeout_s)
            there = decode_metadata(raw, self.engine.compat_hash)
        except (ProtocolError, aiohttp.ClientError, TimeoutError, ValueError, EndpointError):
            return None  # the process held is gone from where it was: the request may try
        if there.engine_id != engine_id or there.incarnation != held:
            return None
        wanted = f" as incarnation {incarnation}" if incarnation else ""
        return (
            f"engine {engine_id} is held live at {at} (incarnation {held}); a request naming "
            f"{endpoint}{wanted} does not move it"
        )

    async def _post_introduction(self, request: web.Request) -> web.Response:
        if not self.introductions:
            self.metrics.reject("introduction")
            return _error(
                403,
                "introductions_off",
                "this engine pairs through the operator only (lazy handshakes are off)",
            )
        intro, metas = self._decode_introduction(await request.read(), hello=True)
        if intro.engine_id == self.engine.engine_id or not pairs_with(intro.role, self.engine.role):
            raise MalformedMessage("an engine introduces itself to an engine of the other role")
        if intro.engine_id in self.operator_evicted:
            return _error(403, "evicted", f"engine {intro.engine_id} was evicted by the operator")
        if not metas:  # a hello: our introduction (proven, see `_prove_answer`), nothing added
            return web.Response(body=self._introduction(), content_type="application/msgpack")
        held = self.registry.incarnation(intro.engine_id)
        health = self.registry.health(intro.engine_id)
        unhealthy = health is not None and health[0] in UNHEALTHY
        if held is not None and held != metas[0].incarnation and not unhealthy:
            msg = (
                f"engine id {intro.engine_id} is held by another live process "
                f"(incarnation {held}); an introduction does not take it over"
            )
            self._handshake_failed(intro.engine_id, FailureType.HANDSHAKE_FAILED, msg, 409)
            return _error(409, "conflict", msg)
        status, answer = await self._add_peer(
            intro.engine_id,
            f"{request.remote}:0",
            intro.role,
            incarnation=metas[0].incarnation,
            given=metas,
        )
        if status != 200:
            return _json(answer, status)
        return web.Response(body=self._introduction(), content_type="application/msgpack")

    async def _delete_peer(self, request: web.Request) -> web.Response:
        engine_id = self._path_engine_id(request)
        return _json(await self._evict_peer(engine_id, _query_rank(request)))

    async def _evict_peer(self, engine_id: str, rank: int | None = None) -> PeerResult:
        if rank is None:
            self.operator_evicted.add(engine_id)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self.nixl_executor, lambda: self.registry.evict(engine_id, "operator", rank)
        )
        self.metrics.evictions_total.labels(result).inc()
        return PeerResult(engine_id=engine_id, result=result)
