"""`KVTopoConnector`: vLLM's KV connector over the kvtopo worker (push mode).

Loaded by vLLM (the package `kvtopo_worker.vllm` exports it) with

    --kv-transfer-config '{"kv_connector": "KVTopoConnector",
                           "kv_connector_module_path": "kvtopo_worker.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

Owns the mapping between vLLM's connector API (`KVConnectorBase_V1`) and the kvtopo worker:

- scheduler side (`_SchedulerSide`): the prefill's `request_finished` holds a finished
  request's blocks and answers the same `kv_transfer_params` as vLLM's `NixlPushConnector`
  (`remote_engine_id`, `remote_request_id`, `remote_host`/`remote_port`: here the kvtopo
  control endpoint, ...); the decode's `get_num_new_matched_tokens` /
  `update_state_after_alloc` turn those params into a registration of the decode's newly
  allocated blocks. Both are handed to the workers in `KVTopoConnectorMetadata`.
- worker side (`_RankWorker`, one per TP rank): its rank's NIXL agent (`NixlTransport`)
  over vLLM's per-layer KV tensors (`KVSegment`s: each layer's K and V part of a block) and
  a `PushConnector`; the prefill WRITEs a request's blocks when the decode's registration
  comes and holds them until the WRITE is done; outcomes go back to vLLM through
  `get_transfer_results` (failures in `failed_recving`, their blocks in
  `get_block_ids_with_load_errors`), each request once.
- the engine host (`_EngineHost`, one per engine and process): the registry of remote
  engines and the control API (`ControlServer`) the operator drives, served once every
  local TP rank has registered its KV cache. When the operator has connected the pair
  nothing handshakes on the request path; a prefill engine the decode does not hold (no
  operator) is handshaken lazily: the decode introduces itself at the control endpoint the
  request names (`POST /v1/introductions`, signed with the peer credential, which is never
  sent), and both add each other from the metadata exchanged. The prefill dials nothing.

`kv_connector_extra_config` keys: `role` ("prefill"/"decode"; default from `kv_role`),
`control_host` (default $KVTOPO_POD_IP, else 127.0.0.1), `control_port` (8975),
`operator_key_file` (the operator's public key, which the admin routes' calls must be signed
for; default $KVTOPO_OPERATOR_KEY_FILE), `peer_token_file` (the token engines that pair
lazily share; default $KVTOPO_PEER_TOKEN_FILE), `token_file` (the client token of the test
engine's traffic routes; default $KVTOPO_TOKEN_FILE), `registration_timeout_s`,
`kv_lease_s`, `transfer_timeout_s`, `handshake_timeout_s`, `idle_ttl_s`, `lazy_handshake`
(default: on when there is a peer token), `lazy_peer_networks` (the CIDRs a lazy handshake
may dial, a list or a comma-separated string; default the private, shared-address, loopback
and unique-local networks: a request names the endpoint, so its `kv_transfer_params` are
untrusted), `model_id` (part of the compatibility hash; default: the served model name). An
engine needs the operator key, the peer token, or both.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvtopo_worker.agent import DEFAULT_INTRODUCTION_NETWORKS, ControlServer, LocalEngine
from kvtopo_worker.credentials import TokenSource
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    UNHEALTHY,
    CompatInfo,
    EngineMetadata,
    FailureType,
    KVSegment,
    PodIdentity,
    Role,
    prompt_digest,
)
from kvtopo_worker.push import FailedRequest, PushConfig, PushConnector, new_connector
from kvtopo_worker.push.both import BothPush
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.signing import PublicKeys
from kvtopo_worker.traffic import EngineTraffic
from kvtopo_worker.transport import NixlTransport

# The prefill's process (its engine's incarnation) in the `kv_transfer_params` it answers,
# beside vLLM's keys: a decode that holds the engine id as another process handshakes anew.
INCARNATION_PARAM = "kvtopo_incarnation"

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

DEFAULT_CONTROL_PORT = 8975

# Engines of this process that take traffic over their control server (the vLLM-scheduler
# engine of the drill and the benchmarks), by engine id: their routes are added, and their
# request counts reported in /v1/state, when the control server starts.
_traffic: dict[str, EngineTraffic] = {}


def attach_traffic(engine_id: str, traffic: EngineTraffic) -> None:
    """Serves `traffic`'s routes on the control API of engine `engine_id` of this process
    (call before its workers register their KV caches)."""
    _traffic[engine_id] = traffic


@dataclass(frozen=True)
class RecvSpec:
    """Decode: receive a request's KV from a prefill engine into `block_ids`."""

    prefill_engine_id: str
    prefill_request_id: str
    prefill_endpoint: str  # its kvtopo control endpoint (for a lazy handshake)
    block_ids: list[int]
    first_block: int  # the prefill's block the first of `block_ids` takes
    prefill_incarnation: str = ""  # its process, where the prefill said (a restart is new)
    prompt_digest: str = ""  # of the request's prompt tokens (the prefill checks it)


@dataclass(frozen=True)
class SendSpec:
    """Prefill: send a finished request's KV, held in `block_ids`, to its decode."""

    block_ids: list[int]
    alias: str = ""  # the id its client or router gave it, which its decode may know it by
    prompt_digest: str = ""


# vLLM's OpenAI server names a request `cmpl-<id>-<prompt index>` (completions) or
# `chatcmpl-<id>` (chat), <id> being the X-Request-Id the client or router sent (else a
# random one), and the engine adds `-<8 random hex>` to make it unique.
_VLLM_REQUEST_ID = re.compile(r"(?:cmpl-(?P<cmpl>.+)-\d+|chatcmpl-(?P<chat>.+))-[0-9a-f]{8}")


def client_request_id(request_id: str) -> str:
    """The id the client or router gave a request (its X-Request-Id), read from the id
    vLLM's OpenAI server made of it; "" for an id of another form. vLLM's P/D router
    (`vllm-router`) hands the decode this id as `remote_request_id`: the prefill finds the
    request by it (only while exactly one of its requests carries it, and only for a
    registration of the same prompt)."""
    m = _VLLM_REQUEST_ID.fullmatch(request_id)
    if m is None:
        return ""
    return m.group("cmpl") or m.group("chat") or ""


@dataclass
class KVTopoConnectorMetadata(KVConnectorMetadata):
    """What one scheduler step hands every TP rank's worker."""

    recv: dict[str, RecvSpec] = field(default_factory=dict)  # by the decode's request id
    send: dict[str, SendSpec] = field(default_factory=dict)  # by the prefill's request id
    abandon: list[str] = field(default_factory=list)  # receiving requests vLLM gave up
    # Requests vLLM gave up before their registration reached the workers: each rank ends
    # them at once (finished_recving), which lets vLLM free their blocks.
    release: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Settings:
    role: Role
    engine_id: str
    control_host: str
    control_port: int
    operator_key_file: str
    token_file: str
    peer_token_file: str
    push: PushConfig
    handshake_timeout_s: float
    idle_ttl_s: float
    lazy_handshake: bool
    lazy_peer_networks: tuple[str, ...]
    tp_size: int
    block_size: int
    model_id: str
    pod: tuple[str, str, str]  # namespace, name, uid (the downward API's)

    @property
    def endpoint(self) -> str:
        host = self.control_host
        return f"[{host}]:{self.control_port}" if ":" in host else f"{host}:{self.control_port}"


def _networks(said: object) -> tuple[str, ...]:
    """`lazy_peer_networks` as given (a list, or one comma-separated string), each a CIDR
    (ValueError naming the setting for one that is not); the default when not given."""
    if said is None or said == "":
        return DEFAULT_INTRODUCTION_NETWORKS
    items = said.split(",") if isinstance(said, str) else list(said)  # type: ignore[call-overload]
    nets: list[str] = []
    for item in items:
        try:
            nets.append(str(ipaddress.ip_network(str(item).strip(), strict=False)))
        except ValueError as exc:
            raise ValueError(f"KVTopoConnector: lazy_peer_networks: {exc}") from None
    return tuple(nets)


def _settings(vllm_config: VllmConfig) -> _Settings:
    kvc = vllm_config.kv_transfer_config
    if kvc is None:
        raise ValueError("KVTopoConnector needs a kv_transfer_config")
    extra: dict[str, Any] = dict(kvc.kv_connector_extra_config or {})
    said = extra.get("role")
    if said is None:
        said = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}.get(
            str(kvc.kv_role)
        )
    role: Role
    if said == "prefill":
        role = "prefill"
    elif said == "decode":
        role = "decode"
    elif said == "both":
        role = "both"
    else:
        raise ValueError(
            f"KVTopoConnector: kv_role {kvc.kv_role!r} / role {said!r}: use kv_role "
            'kv_producer, kv_consumer or kv_both, or kv_connector_extra_config {"role": '
            '"prefill" | "decode" | "both"}'
        )
    peer_token_file = str(
        extra.get("peer_token_file") or os.environ.get("KVTOPO_PEER_TOKEN_FILE", "")
    )
    defaults = PushConfig()
    push = PushConfig(
        registration_timeout_s=float(
            extra.get("registration_timeout_s", defaults.registration_timeout_s)
        ),
        kv_lease_s=float(extra.get("kv_lease_s", defaults.kv_lease_s)),
        transfer_timeout_s=float(extra.get("transfer_timeout_s", defaults.transfer_timeout_s)),
    )
    return _Settings(
        role=role,
        engine_id=str(kvc.engine_id or uuid.uuid4()),
        control_host=str(
            extra.get("control_host") or os.environ.get("KVTOPO_POD_IP") or "127.0.0.1"
        ),
        control_port=int(extra.get("control_port", DEFAULT_CONTROL_PORT)),
        operator_key_file=str(
            extra.get("operator_key_file") or os.environ.get("KVTOPO_OPERATOR_KEY_FILE", "")
        ),
        token_file=str(extra.get("token_file") or os.environ.get("KVTOPO_TOKEN_FILE", "")),
        peer_token_file=peer_token_file,
        push=push,
        handshake_timeout_s=float(extra.get("handshake_timeout_s", 5.0)),
        idle_ttl_s=float(extra.get("idle_ttl_s", 0.0)),
        lazy_handshake=(
            bool(peer_token_file)
            if extra.get("lazy_handshake") is None
            else bool(extra["lazy_handshake"])
        ),
        lazy_peer_networks=_networks(extra.get("lazy_peer_networks")),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        block_size=int(vllm_config.cache_config.block_size),
        model_id=str(extra.get("model_id") or _served_name(vllm_config)),
        pod=(
            str(extra.get("pod_namespace") or os.environ.get("KVTOPO_POD_NAMESPACE", "")),
            str(extra.get("pod_name") or os.environ.get("KVTOPO_POD_NAME", "")),
            str(extra.get("pod_uid") or os.environ.get("KVTOPO_POD_UID", "")),
        ),
    )


def _served_name(vllm_config: VllmConfig) -> str:
    """The model's name as vLLM serves it (`--served-model-name`, else the model), part of
    the compatibility hash: engines of other models never pair."""
    served = vllm_config.model_config.served_model_name
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    return str(served or vllm_config.model_config.model)


def _first_group(block_ids: Any) -> list[int]:
    """The block ids of the one KV cache group kvtopo moves (vLLM gives a tuple of lists,
    one per group; several groups are refused at registration)."""
    if isinstance(block_ids, tuple | list) and block_ids and isinstance(block_ids[0], list):
        if len(block_ids) > 1 and any(block_ids[1:]):
            raise ValueError("KVTopoConnector moves one KV cache group; this model has several")
        return list(block_ids[0])
    return list(block_ids)


# --- scheduler side -------------------------------------------------------------------------


class _SchedulerSide:
    """The connector's scheduler-role state: which requests the workers must send, receive
    or give up next step, and which requests still wait for a worker's report.

    A request's part is its `kv_transfer_params`' (`do_remote_prefill`: receive,
    `do_remote_decode`: send), taken where the engine's role allows it (a kv_both engine
    takes either). A receiving request vLLM gives up (abort, a failed load) keeps its
    blocks in vLLM's hands until the workers report it finished_recving: vLLM 0.33 holds a
    request that waits for remote KV until then, so no WRITE lands in freed blocks."""

    def __init__(self, settings: _Settings) -> None:
        self.s = settings
        self._receives = settings.role in ("decode", "both")
        self._sends = settings.role in ("prefill", "both")
        self._recv_new: dict[str, RecvSpec] = {}
        self._send_new: dict[str, SendSpec] = {}
        self._abandon_new: dict[str, None] = {}
        self._release_new: dict[str, None] = {}
        self._sending: set[str] = set()  # blocks held until finished_sending
        self._receiving: set[str] = set()  # registered, not finished yet
        self._letting_go: set[str] = set()  # given up, until their finished_recving

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self._receives and params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not self._receives or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # a second call (after the load) stages nothing
        if num_external_tokens <= 0:
            return
        prompt = len(request.prompt_token_ids or ())
        bs = self.s.block_size
        first = (prompt - num_external_tokens) // bs
        ids = _first_group(blocks.get_block_ids())[first : math.ceil(prompt / bs)]
        host = str(params.get("remote_host", ""))
        port = params.get("remote_port", "")
        endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._recv_new[request.request_id] = RecvSpec(
            prefill_engine_id=str(params.get("remote_engine_id", "")),
            prefill_request_id=str(params.get("remote_request_id") or request.request_id),
            prefill_endpoint=endpoint,
            block_ids=ids,
            first_block=first,
            prefill_incarnation=str(params.get(INCARNATION_PARAM, "")),
            prompt_digest=prompt_digest(request.prompt_token_ids or ()),
        )
        self._receiving.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTopoConnectorMetadata:
        meta = KVTopoConnectorMetadata(
            recv=self._recv_new,
            send=self._send_new,
            abandon=list(self._abandon_new),
            release=list(self._release_new),
        )
        self._recv_new, self._send_new, self._abandon_new, self._release_new = {}, {}, {}, {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._sending.discard(rid)
        for rid in connector_output.finished_recving or ():
            # Ended by the workers (done, or failed: vLLM frees a failed load's blocks this
            # step); a give-up queued for it meanwhile has nothing left to cancel.
            self._receiving.discard(rid)
            self._letting_go.discard(rid)
            self._abandon_new.pop(rid, None)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        if rid in self._receiving:
            # vLLM gave up a request whose KV may still land (an abort, a failed load). It
            # keeps the blocks until the workers report the request finished_recving: they
            # cancel its registration and report it once no WRITE of it can land (one never
            # sent, at once).
            self._receiving.discard(rid)
            self._letting_go.add(rid)
            if self._recv_new.pop(rid, None) is None:
                self._abandon_new[rid] = None
            else:
                self._release_new[rid] = None
            return False, None
        if not self._sends or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        computed = int(request.num_computed_tokens)
        ids = _first_group(block_ids)[: math.ceil(computed / self.s.block_size)]
        if ids:
            self._send_new[rid] = SendSpec(
                ids, client_request_id(rid), prompt_digest(request.prompt_token_ids or ())
            )
            self._sending.add(rid)
        answer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.s.engine_id,
            "remote_request_id": rid,
            "remote_host": self.s.control_host,
            "remote_port": self._control_port(),
            "tp_size": self.s.tp_size,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "transfer_mode": "push",
        }
        host = _EngineHost.running(self.s.engine_id)
        if host is not None:  # the worker side runs in this process (TP within one)
            answer[INCARNATION_PARAM] = host.incarnation
        return bool(ids), answer

    def has_pending_push_work(self) -> bool:
        return bool(
            self._sending
            or self._send_new
            or self._recv_new
            or self._abandon_new
            or self._release_new
            or self._letting_go
        )

    def _control_port(self) -> int:
        """The control port; for port 0, the one this engine's control server bound, where
        it runs in this process (the in-process engine of the drill and the tests)."""
        if self.s.control_port:
            return self.s.control_port
        host = _EngineHost.running(self.s.engine_id)
        server = host.server if host is not None else None
        return server.port if server is not None else 0


# --- the engine host: registry and control API, per engine and process -----------------------


class _EngineHost:
    """What the TP ranks of one engine in this process share: the registry of remote
    engines, the metrics and the control API, served once every rank has its KV cache."""

    _hosts: dict[str, _EngineHost] = {}
    _hosts_lock = threading.Lock()

    @classmethod
    def running(cls, engine_id: str) -> _EngineHost | None:
        """This process's host of `engine_id`, if it has one."""
        with cls._hosts_lock:
            return cls._hosts.get(engine_id)

    @classmethod
    def of(cls, settings: _Settings, local_ranks: int) -> _EngineHost:
        with cls._hosts_lock:
            host = cls._hosts.get(settings.engine_id)
            if host is None:
                host = cls._hosts[settings.engine_id] = cls(settings, local_ranks)
            return host

    def __init__(self, settings: _Settings, local_ranks: int) -> None:
        self.s = settings
        self.incarnation = uuid.uuid4().hex
        self.metrics = WorkerMetrics()
        self.transports: dict[int, NixlTransport] = {}
        self.registry = EngineRegistry(
            remove_agent=self._remove_agent, idle_ttl_s=settings.idle_ttl_s
        )
        self.local_ranks = local_ranks
        self._metas: dict[int, EngineMetadata] = {}
        self._lock = threading.Lock()
        self.server: ControlServer | None = None
        self._users = 0

    def _remove_agent(self, agent_name: str) -> None:
        for transport in list(self.transports.values()):
            transport.remove_remote(agent_name)

    def pod(self) -> PodIdentity | None:
        ns, name, uid = self.s.pod
        return PodIdentity(namespace=ns, name=name, uid=uid) if ns and name and uid else None

    def add_rank(self, rank: int, transport: NixlTransport, meta: EngineMetadata) -> None:
        """A rank's KV cache is registered; the last one starts the control API."""
        with self._lock:
            self.transports[rank] = transport
            self._metas[rank] = meta
            self._users += 1
            if len(self._metas) < self.local_ranks or self.server is not None:
                return
            metas = [self._metas[r] for r in sorted(self._metas)]
            if not self.s.operator_key_file and not self.s.lazy_handshake:
                raise ValueError(
                    "KVTopoConnector needs the operator's public key: set "
                    'kv_connector_extra_config {"operator_key_file": ...} or '
                    "$KVTOPO_OPERATOR_KEY_FILE (the mounted kvtopo operator public key); or, "
                    'without an operator, lazy handshakes with a peer token ("peer_token_file")'
                )
            if self.s.lazy_handshake and not self.s.peer_token_file:
                raise ValueError(
                    "KVTopoConnector: lazy_handshake needs the peer token engines share: set "
                    'kv_connector_extra_config {"peer_token_file": ...} or '
                    "$KVTOPO_PEER_TOKEN_FILE, or turn lazy_handshake off"
                )
            keys = PublicKeys(path=self.s.operator_key_file) if self.s.operator_key_file else None
            client = TokenSource(path=self.s.token_file) if self.s.token_file else None
            peer = TokenSource(path=self.s.peer_token_file) if self.s.peer_token_file else None
            traffic = _traffic.get(self.s.engine_id)
            server = ControlServer(
                engine=LocalEngine(self.s.engine_id, self.s.role, metas[0], time.time(), metas),
                registry=self.registry,
                transport=[self.transports[r] for r in sorted(self.transports)],
                operator_keys=keys,
                client_token=client,
                peer_token=peer,
                metrics=self.metrics,
                host=self.s.control_host,
                port=self.s.control_port,
                handshake_timeout_s=self.s.handshake_timeout_s,
                request_counts=traffic.request_counts if traffic is not None else None,
                introductions=self.s.lazy_handshake,
                introduction_networks=self.s.lazy_peer_networks,
            )
            if traffic is not None:
                traffic.add_routes(server.app)
            server.start()
            self.server = server
            log.info(
                "kvtopo control API of %s engine %s on %s",
                self.s.role,
                self.s.engine_id,
                server.endpoint,
            )

    def ensure_peer(
        self,
        engine_id: str,
        endpoint: str,
        role: Role,
        then: Callable[[], None],
        failed: Callable[[str], None],
        incarnation: str = "",
    ) -> None:
        """Calls `then()` once `engine_id` is held, healthy and (where `incarnation` is
        given) as that process: at once when it is, else after a lazy handshake with
        `endpoint` on a thread of its own, which replaces an older incarnation and renews
        an unhealthy one; `failed(message)` when that handshake fails or lazy handshakes
        are off."""
        held = self.registry.incarnation(engine_id)
        health = self.registry.health(engine_id)
        stale = held is not None and bool(incarnation) and held != incarnation
        unhealthy = health is not None and health[0] in UNHEALTHY
        if held is not None and not stale and not unhealthy and self.registry.snapshot(engine_id):
            then()
            return
        if not self.s.lazy_handshake:
            why = "not connected"
            if stale:
                why = f"held as an older process ({held}), not {incarnation}"
            elif unhealthy and health is not None:
                why = f"{health[0]} ({health[1]})"
            failed(f"engine {engine_id} is {why} (lazy handshakes are off)")
            return
        server = self.server
        if server is None:
            failed("the control API is not serving yet")
            return
        if engine_id in server.operator_evicted:
            failed(f"engine {engine_id} was evicted by the operator")
            return

        def run() -> None:
            # An introduction: the endpoint comes from a request's kv_transfer_params (an
            # API client chose it), so nothing reusable is sent there.
            status, answer = server.introduce(engine_id, endpoint, role, incarnation=incarnation)
            if status == 200:
                then()
            else:
                failed(f"lazy handshake with {engine_id} at {endpoint}: HTTP {status}: {answer}")

        threading.Thread(target=run, name=f"kvtopo-lazy-{engine_id[:8]}", daemon=True).start()

    def release(self) -> None:
        """A rank shut down; the last one stops the control API."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            server, self.server = self.server, None
        if server is not None:
            server.stop()
        with self._hosts_lock:
            if self._hosts.get(self.s.engine_id) is self:
                del self._hosts[self.s.engine_id]


# --- worker side ----------------------------------------------------------------------------


def kv_segments(
    kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> tuple[list[torch.Tensor], list[KVSegment]]:
    """The layers' tensors (in name order) and the segments a block spans in them: a layer
    laid out (2, num_blocks, ...) has its K and V part, one laid out (num_blocks, ...) (vLLM
    0.33's, K and V side by side) one part. Each block's part of a layer must be contiguous;
    the layers may be views of one buffer."""
    tensors: list[torch.Tensor] = []
    segments: list[KVSegment] = []
    for name in sorted(kv_caches):
        t = kv_caches[name]
        size = t.element_size()
        if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            halves = [t[0], t[1]]
        elif t.shape[0] == num_blocks:
            halves = [t]
        else:
            raise ValueError(
                f"KV cache of layer {name} has shape {tuple(t.shape)}: KVTopoConnector "
                f"needs (2, {num_blocks}, ...) or ({num_blocks}, ...)"
            )
        for h in halves:
            per_block = h[0].numel() * size
            if h.stride(0) * size < per_block or not h[0].is_contiguous():
                raise ValueError(f"a block of layer {name} is not contiguous in memory")
            segments.append(KVSegment(h.data_ptr(), h.stride(0) * size, per_block))
        tensors.append(t)
    return tensors, segments


class _RankWorker:
    """One TP rank's worker side: its NIXL agent, KV cache and push connector."""

    def __init__(self, settings: _Settings, rank: int, local_ranks: int) -> None:
        if local_ranks != settings.tp_size:
            raise ValueError(
                f"KVTopoConnector serves a TP {settings.tp_size} engine only with all its ranks "
                f"in one process (this one holds {local_ranks}); vLLM's multiprocess executor "
                "runs a process per rank, which the kvtopo control API does not serve yet: "
                "run tensor_parallel_size 1 per engine, or see docs/vllm.md"
            )
        self.s = settings
        self.rank = rank
        self.host = _EngineHost.of(settings, local_ranks)
        self.push: PushConnector | None = None
        self.sender: PushConnector | None = None  # the half that sends (prefill, both)
        self.receiver: PushConnector | None = None  # the half that receives (decode, both)
        self.transport: NixlTransport | None = None
        self._lock = threading.Lock()
        self._by_prefill_rid: dict[str, str] = {}  # receiving: prefill request id -> ours
        self._recv_blocks: dict[str, list[int]] = {}  # receiving: our request id -> blocks
        self._abandoned: set[str] = set()  # receiving, given up by vLLM (no load error)
        self._released: list[str] = []  # given up before registering: end at once
        self._local_failed: list[FailedRequest] = []  # by our request id
        self._load_errors: set[int] = set()
        # Told of every request this rank ends, as it ends it (None: done), for an engine
        # that reports outcomes of its own (kvtopo_worker.vllm.engine).
        self.on_end: Callable[[str, FailedRequest | None], None] | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        tensors, segments = kv_segments(kv_caches, num_blocks)
        transport = NixlTransport(
            f"kvtopo-{self.s.engine_id}-{self.host.incarnation[:12]}-r{self.rank}",
            on_unauthenticated=self.host.metrics.unauthenticated,
        )
        transport.register_kv_segments(tensors, segments, num_blocks)
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        compat = CompatInfo(
            kv_layout=f"vllm:{len(tensors)}x{len(segments) // len(tensors)}",
            dtype=dtype,
            block_size=self.s.block_size,
            block_len=transport.block_len,
            model_id=self.s.model_id,
        )
        meta = transport.describe(
            engine_id=self.s.engine_id,
            role=self.s.role,
            compat=compat,
            tp_rank=self.rank,
            tp_size=self.s.tp_size,
            incarnation=self.host.incarnation,
            pod=self.host.pod(),
        )
        self.push = new_connector(
            engine_id=self.s.engine_id,
            role=self.s.role,
            transport=transport,
            registry=self.host.registry,
            metrics=self.host.metrics,
            config=self.s.push,
            tp_rank=self.rank,
            block_len=transport.block_len,
        )
        self.transport = transport
        if isinstance(self.push, BothPush):
            self.sender, self.receiver = self.push.sending, self.push.receiving
        elif self.s.role == "prefill":
            self.sender = self.push
        else:
            self.receiver = self.push
        self.push.start()
        self.host.add_rank(self.rank, transport, meta)

    def start(self, meta: KVTopoConnectorMetadata) -> None:
        if self.push is None:
            raise RuntimeError("register_kv_caches was not called")
        if meta.send:
            if self.sender is None:
                raise RuntimeError(f"a {self.s.role} engine sends no KV")
            for rid, out in meta.send.items():
                self.sender.request_send(
                    rid, out.block_ids, alias=out.alias, prompt_digest=out.prompt_digest
                )
        if meta.recv or meta.abandon or meta.release:
            if self.receiver is None:
                raise RuntimeError(f"a {self.s.role} engine receives no KV")
            for rid, spec in meta.recv.items():
                self._receive(self.receiver, rid, spec)
            self._give_up(self.receiver, meta.abandon, meta.release)

    def _give_up(self, receiver: PushConnector, abandon: list[str], release: list[str]) -> None:
        """Receiving requests vLLM gave up: a registration in flight is cancelled (its end,
        once no WRITE can land, reaches vLLM as finished_recving); one that never reached
        this worker ends at once; one that ended already is left alone."""
        cancels: list[str] = []
        with self._lock:
            self._released.extend(release)
            for rid in abandon:
                if rid not in self._recv_blocks:
                    continue  # ended already (its report is on its way to vLLM)
                self._abandoned.add(rid)
                prefill_rid = next((p for p, d in self._by_prefill_rid.items() if d == rid), None)
                if prefill_rid is not None:
                    cancels.append(prefill_rid)
        for prefill_rid in cancels:
            receiver.abandon(prefill_rid, FailureType.ABORTED, "vLLM gave the request up")

    def _receive(self, push: PushConnector, rid: str, spec: RecvSpec) -> None:
        with self._lock:
            if spec.prefill_request_id in self._by_prefill_rid:
                why = f"prefill request {spec.prefill_request_id} is already being received"
                self._local_failed.append(
                    FailedRequest(rid, FailureType.TRANSFER_SETUP_FAILED, why)
                )
                self._recv_blocks[rid] = spec.block_ids
                return
            self._by_prefill_rid[spec.prefill_request_id] = rid
            self._recv_blocks[rid] = spec.block_ids

        def go() -> None:
            try:
                push.request_receive(
                    spec.prefill_request_id,
                    spec.prefill_engine_id,
                    spec.block_ids,
                    spec.first_block,
                    spec.prompt_digest,
                )
            except (ValueError, RuntimeError) as exc:
                # The params name a prefill request this rank received already (a client
                # or router reusing an id), or the connector stopped: this request fails.
                failed(str(exc), FailureType.TRANSFER_SETUP_FAILED)

        def failed(why: str, reason: FailureType = FailureType.HANDSHAKE_FAILED) -> None:
            with self._lock:
                self._by_prefill_rid.pop(spec.prefill_request_id, None)
                self._local_failed.append(FailedRequest(rid, reason, why))

        self.host.ensure_peer(
            spec.prefill_engine_id,
            spec.prefill_endpoint,
            "prefill",
            go,
            failed,
            incarnation=spec.prefill_incarnation,
        )

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.push is None:
            return out
        ended: list[tuple[str, FailedRequest | None]] = []
        if self.sender is not None:
            sent = self.sender.get_finished()
            out.finished_sending.update(sent.done_sending)
            ended += [(rid, None) for rid in sent.done_sending]
            for failed in sent.failed:  # its blocks are free again all the same
                out.finished_sending.add(failed.request_id)
                ended.append((failed.request_id, failed))
        got = self.receiver.get_finished() if self.receiver is not None else None
        with self._lock:
            failures, self._local_failed = self._local_failed, []
            released, self._released = self._released, []
            for rid in released:
                out.finished_recving.add(rid)
                ended.append((rid, FailedRequest(rid, FailureType.ABORTED, "vLLM gave it up")))
            for prid in got.done_receiving if got is not None else ():
                rid = self._by_prefill_rid.pop(prid, prid)
                self._recv_blocks.pop(rid, None)
                self._abandoned.discard(rid)
                ended.append((rid, None))
                out.finished_recving.add(rid)
            for failed in got.failed if got is not None else ():
                rid = self._by_prefill_rid.pop(failed.request_id, failed.request_id)
                failures.append(FailedRequest(rid, failed.reason, failed.message))
            for failed in failures:
                rid = failed.request_id
                blocks = self._recv_blocks.pop(rid, [])
                ended.append((rid, failed))
                out.finished_recving.add(rid)
                if rid in self._abandoned:  # vLLM finished it already: no load error
                    self._abandoned.discard(rid)
                    continue
                log.warning("KV of request %s not received: %s", rid, failed.message)
                out.failed_recving.add(rid)
                self._load_errors.update(blocks)
        if self.on_end is not None:
            for rid, failure in ended:
                self.on_end(rid, failure)
        return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.push is not None:
            self.push.stop()
        self.host.release()
        if self.transport is not None:
            self.transport.close()


def _tp_rank() -> int:
    """This process's TP rank, where vLLM's distributed state is up (else 0)."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            model_parallel_is_initialized,
        )

        if model_parallel_is_initialized():
            return int(get_tensor_model_parallel_rank())
    except Exception as exc:
        log.debug("no TP rank from vLLM: %s", exc)
    return 0


class KVTopoConnector(KVConnectorBase_V1):
    """vLLM's KV connector over the kvtopo worker (push mode); see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        tp_rank: int | None = None,
        local_ranks: int = 1,
    ) -> None:
        """`tp_rank` and `local_ranks` are for hosts that run several TP ranks of one engine
        in one process (tests); vLLM's own workers give neither."""
        super().__init__(vllm_config, role, kv_cache_config)
        self._s = _settings(vllm_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _RankWorker | None = None
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self._s)
        else:
            rank = _tp_rank() if tp_rank is None else tp_rank
            self._worker = _RankWorker(self._s, rank, local_ranks)

    @property
    def engine_id(self) -> str:
        return self._s.engine_id

    # --- scheduler side ------------------------------------------------------------------

    def _sched(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-side connector")
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched().has_pending_push_work()

    # --- worker side ---------------------------------------------------------------------

    def _work(self) -> _RankWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler-side connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._num_blocks
        if not num_blocks:
            first = next(iter(kv_caches.values()))
            num_blocks = int(first.shape[1] if first.shape[0] == 2 else first.shape[0])
        self._work().register(kv_caches, num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTopoConnectorMetadata):
            raise TypeError(f"expected KVTopoConnectorMetadata, got {type(meta).__name__}")
        self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # KV arrives between steps (push); nothing to wait for inside a forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the prefill WRITEs a request's blocks once it finished (request_finished)

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work().results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # --- for the operator and tests --------------------------------------------------------

    @property
    def control_endpoint(self) -> str | None:
        """Where this engine's kvtopo control API answers, once it serves."""
        if self._worker is None or self._worker.host.server is None:
            return None
        return self._worker.host.server.endpoint

    @property
    def push_connector(self) -> PushConnector | None:
        return self._worker.push if self._worker is not None else None

    @property
    def sending(self) -> PushConnector | None:
        """The push half that sends this rank's KV (a prefill's or a kv_both engine's)."""
        return self._worker.sender if self._worker is not None else None

    @property
    def incarnation(self) -> str:
        """This engine process's boot id (its agents' names carry it)."""
        return self._work().host.incarnation

    @property
    def on_end(self) -> Callable[[str, FailedRequest | None], None] | None:
        """Told of every request this rank ends (None: done), as the worker sees it."""
        return self._work().on_end

    @on_end.setter
    def on_end(self, listener: Callable[[str, FailedRequest | None], None] | None) -> None:
        self._work().on_end = listener

    def peers(self) -> Iterable[str]:
        return self._work().host.registry.engine_ids()
