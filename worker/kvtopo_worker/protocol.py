"""The worker's wire contract: every byte two engines or the operator exchange.

Owns the message structs (engine metadata, push registrations, notifications, control-API
bodies), the protocol version, the compatibility hash, the bounds both sides keep to (id
lengths, batch sizes, a batch's handshake concurrency), and the two-phase decode that turns
garbage or a mismatch into a typed error instead of a crash. Imported by every other worker
module and by the operator; it imports neither torch, nixl, kopf nor kubernetes.
"""

from __future__ import annotations

import array
import enum
import hashlib
import sys
from collections.abc import Sequence
from typing import Literal, TypeVar

import msgspec

# Protocol version history (bump on any change to a struct below that an old peer would
# misread; peers with different versions refuse to connect instead of corrupting KV):
#   1: first release: EngineMetadata envelope, PUSH_REG / PUSH_DONE / PUSH_FAIL notifications.
#   2: PUSH_DONE may complete several requests (`more_request_ids`: one WRITE carried them).
#   3: EngineMetadata describes its KV region in plain fields (`kv_addr`, `kv_device`,
#      `kv_mem`) instead of NIXL's serialized descriptor list (a pickle: nothing a peer
#      sends is unpickled); the receiver rebuilds the block descriptors itself. A
#      registration carries its validity (`expires_at`, `write_timeout_s`); a decode that
#      gives a request up sends PUSH_CANCEL and the prefill answers it (PUSH_DONE or
#      PUSH_FAIL), so both sides agree on every request's outcome.
#   4: identity. EngineMetadata and WorkerState carry the engine's pod (namespace, name,
#      uid) and its incarnation (a boot id, new on every start even under a pinned engine
#      id); a peer add may say which pod uid and incarnation to expect, and the worker
#      refuses a peer that does not match, and replaces the agents of an older incarnation.
#      Later, within 4 (optional control-API fields with defaults, so a worker of 4 without
#      them reads an operator's bodies that leave them out, and an operator reads its state;
#      a worker of 4 that predates them refuses a body carrying them as unknown fields, so
#      the operator sends them only to a worker whose state reports them):
#      `PATCH /v1/peers` may carry `handshake_timeout_s`, the deadline of that batch's
#      handshakes; `PUT /v1/settings` sets `idle_ttl_s`; WorkerState reports both.
#      Peer health: each PeerState says whether the peer is `ok`, `dropped` (NIXL reported
#      it disconnected, or no longer holds its metadata) or `failing` (its last transfers
#      all failed), and why (`health_reason`); a reader that predates them ignores them.
#      An add of a peer held unhealthy fetches its metadata again and replaces its agents,
#      answering `renewed` (a result string older operators read as an open string).
#   5: notifications are sealed and bound to the exact peer process. EngineMetadata carries
#      `notif_key`, the public half of a key pair new on every start; every notification
#      ends with a 16-byte tag only the two processes of the pair can make (`seal`), so a
#      notification counts only from the process whose metadata was added under its agent
#      name. PUSH_HELLO: a rank greets a peer agent it added (the decode sends a request's
#      registration only to a prefill agent that greeted it, so nothing is sent to, or
#      kept by, a process that does not hold its peer). PushRegistration loses
#      `decode_endpoint` (a prefill dials nothing a peer message names): a decode that
#      handshakes lazily introduces itself (`POST /v1/introductions`, signed with the peer
#      credential, which never leaves the engine).
PROTOCOL_VERSION = 5

REG_PREFIX = b"PUSH_REG:"
DONE_PREFIX = b"PUSH_DONE:"
FAIL_PREFIX = b"PUSH_FAIL:"
CANCEL_PREFIX = b"PUSH_CANCEL:"
HELLO_PREFIX = b"PUSH_HELLO:"
NOTIF_KEY_LEN = 32  # an X25519 public key

# Bounds on what a peer may send; anything larger is refused before it is decoded further.
MAX_ID_LEN = 256
MAX_BLOCKS_PER_REQUEST = 65536
MAX_NOTIFICATION_BYTES = 1 << 20
MAX_ENGINE_BLOCKS = 1 << 24  # blocks one engine rank may register
MAX_DEVICE_ID = 1 << 16
# A held peer's `health_reason` (the failure that made it unhealthy) is at most this long, as
# the worker keeps it and as the operator reads it (a longer one is cut where it enters).
MAX_HEALTH_REASON = 300

_T = TypeVar("_T")

# An engine's part in P/D: `prefill` sends KV, `decode` receives it; `both` (vLLM's
# kv_both) does either per request, as its `kv_transfer_params` say. Under the operator a
# `both` engine takes the part its pod's role label gives it.
Role = Literal["prefill", "decode", "both"]


def plays(actual: Role, wanted: Role) -> bool:
    """Whether an engine that says it is `actual` can take the part `wanted`."""
    return actual == wanted or "both" in (actual, wanted)


def pairs_with(a: Role, b: Role) -> bool:
    """Whether engines of roles `a` and `b` move KV between them: a prefill and a decode,
    or a `both` engine and any other engine."""
    return a != b or a == "both"


# A held peer's health (PeerState.health): `ok`; `dropped`: NIXL reported the remote agent
# disconnected (a transfer or notification to it failed with a remote disconnect) or no
# longer holds its metadata; `failing`: its last `--failing-after` transfers all failed.
# A reader must treat a value it does not know as `ok` (and may log it): only the values
# of UNHEALTHY make a worker renew the peer on the next add.
PeerHealth = Literal["ok", "dropped", "failing"]
UNHEALTHY: frozenset[str] = frozenset({"dropped", "failing"})
MemoryKind = Literal["DRAM", "VRAM"]
TransferMode = Literal["push", "pull"]


class FailureType(enum.StrEnum):
    """The closed set of failure types (vLLM's vocabulary, plus kvtopo's own)."""

    HANDSHAKE_FAILED = "handshake_failed"
    INCOMPATIBLE = "incompatible"
    PUSH_REG_NOTIF_FAILED = "push_reg_notif_failed"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_SETUP_FAILED = "transfer_setup_failed"
    NOTIFICATION_FAILED = "notification_failed"
    REGISTRATION_TIMEOUT = "registration_timeout"
    KV_EXPIRED = "kv_expired"
    EVICTED_INFLIGHT = "evicted_inflight"
    MALFORMED_MESSAGE = "malformed_message"
    REMOTE_REJECTED = "remote_rejected"
    SHUTDOWN = "shutdown"  # the engine stopped (drain deadline passed) before it ended
    ABORTED = "aborted"  # the engine's client gave the request up (vLLM's abort)


class ProtocolError(Exception):
    """A message that cannot be used; `failure_type` says how it is counted."""

    failure_type: FailureType = FailureType.MALFORMED_MESSAGE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedMessage(ProtocolError):
    """Bytes that do not decode to the expected struct (garbage, truncation, wrong types)."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    failure_type = FailureType.INCOMPATIBLE


class IncompatibleEngine(ProtocolError):
    """The peer's compatibility hash differs: its KV cannot be read as ours."""

    failure_type = FailureType.INCOMPATIBLE

    def __init__(self, message: str, local_hash: str, remote_hash: str) -> None:
        super().__init__(message)
        self.local_hash = local_hash
        self.remote_hash = remote_hash


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides of a KV transfer must agree on byte for byte."""

    transfer_mode: TransferMode = "push"
    kv_layout: str = "blocks"
    dtype: str = "uint8"
    block_size: int = 16
    block_len: int = 0
    model_id: str = "emulated"
    protocol_version: int = PROTOCOL_VERSION


def compat_hash(info: CompatInfo) -> str:
    """A short stable hash of `info`; equal hashes mean the KV layouts are interchangeable."""
    return hashlib.sha256(msgspec.msgpack.encode(info)).hexdigest()[:16]


class PodIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The pod an engine runs in (the downward API's metadata.namespace, .name, .uid)."""

    namespace: str
    name: str
    uid: str


MAX_KV_SEGMENTS = 4096  # slices one KV block may span (e.g. layers x {K, V})
MAX_KV_DESCRIPTORS = 1 << 24  # blocks x segments one engine rank may register


class KVSegment(msgspec.Struct, frozen=True, array_like=True):
    """One slice of every KV block: block i's part lies at `addr + i * stride`, `length`
    bytes long (an engine with a tensor per layer, K and V apart, has one per layer and
    half: block i is then the concatenation of its parts in every segment)."""

    addr: int
    stride: int
    length: int


class EngineMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """One engine rank as its peers see it: enough to add its NIXL agent and address its KV.

    The KV cache is `num_blocks` blocks of `block_len` bytes on device `kv_device` of memory
    kind `kv_mem`. Without `kv_segments` a block is one piece, block i at
    `kv_addr + i * block_len`; with them, block i is its part in each segment in order (their
    lengths add up to `block_len`, and `kv_addr` is the first segment's). A peer rebuilds the
    block descriptors from these numbers (NIXL then checks them against the memory the agent
    registered); `agent_metadata` is NIXL's own blob, parsed by NIXL, and the agent name
    inside it must be `agent_name`.
    """

    engine_id: str
    role: Role
    agent_name: str
    agent_metadata: bytes
    kv_addr: int
    kv_device: int = 0
    kv_mem: MemoryKind = "DRAM"
    num_blocks: int
    block_len: int
    tp_rank: int = 0
    tp_size: int = 1
    compat: CompatInfo
    compat_hash: str
    incarnation: str = ""  # the engine process's boot id (new on every start)
    pod: PodIdentity | None = None  # None: the engine was started without its pod identity
    kv_segments: list[KVSegment] = []  # empty: one piece per block (see above)
    notif_key: bytes = b""  # the process's notification public key (`seal`); v5: required

    def segments(self) -> list[KVSegment]:
        """The block's segments, the one-piece layout included."""
        if self.kv_segments:
            return list(self.kv_segments)
        return [KVSegment(self.kv_addr, self.block_len, self.block_len)]


class Envelope(msgspec.Struct, frozen=True):
    """Phase one of a decode: checked before the payload is even looked at."""

    version: int
    compat_hash: str
    payload: msgspec.Raw


def encode_metadata(meta: EngineMetadata) -> bytes:
    """Wraps engine metadata in a versioned envelope (`GET /v1/metadata` body)."""
    payload = msgspec.Raw(msgspec.msgpack.encode(meta))
    return msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION, meta.compat_hash, payload))


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_metadata_decoder = msgspec.msgpack.Decoder(EngineMetadata)


def decode_metadata(data: bytes, expected_hash: str) -> EngineMetadata:
    """Two-phase decode of a peer's metadata.

    Raises MalformedMessage for garbage, VersionMismatch for another protocol version and
    IncompatibleEngine when the peer's hash differs from `expected_hash`.
    """
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"metadata envelope does not decode: {exc}") from None
    if env.version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"peer speaks protocol version {env.version}, this worker {PROTOCOL_VERSION}"
        )
    if env.compat_hash != expected_hash:
        raise IncompatibleEngine(
            f"compatibility hash {env.compat_hash} differs from ours {expected_hash}",
            local_hash=expected_hash,
            remote_hash=env.compat_hash,
        )
    try:
        meta = _metadata_decoder.decode(env.payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"metadata payload does not decode: {exc}") from None
    if meta.compat_hash != env.compat_hash or compat_hash(meta.compat) != meta.compat_hash:
        raise MalformedMessage("metadata payload disagrees with its envelope's hash")
    _check_id("engine_id", meta.engine_id)
    _check_id("agent_name", meta.agent_name)
    if not 0 < meta.num_blocks <= MAX_ENGINE_BLOCKS:
        raise MalformedMessage(f"num_blocks must be 1..{MAX_ENGINE_BLOCKS}")
    if meta.block_len != meta.compat.block_len or meta.block_len <= 0:
        raise MalformedMessage(
            f"block_len {meta.block_len} differs from the compatibility info's "
            f"{meta.compat.block_len} (or is not positive)"
        )
    end = meta.kv_addr + meta.num_blocks * meta.block_len
    if meta.kv_addr < 0 or (not meta.kv_segments and end > 1 << 64):
        raise MalformedMessage("the KV region does not fit in a 64-bit address space")
    _check_segments(meta)
    if not 0 <= meta.kv_device < MAX_DEVICE_ID:
        raise MalformedMessage(f"kv_device must be 0..{MAX_DEVICE_ID - 1}")
    if not 0 <= meta.tp_rank < meta.tp_size:
        raise MalformedMessage(f"tp_rank {meta.tp_rank} outside tp_size {meta.tp_size}")
    check_identity(meta.incarnation, meta.pod)
    if len(meta.notif_key) != NOTIF_KEY_LEN:
        raise MalformedMessage(f"notif_key must be {NOTIF_KEY_LEN} bytes")
    return meta


def _check_segments(meta: EngineMetadata) -> None:
    """MalformedMessage unless the segments describe `num_blocks` blocks of `block_len`
    bytes within a 64-bit address space, at a bounded number of descriptors."""
    segs = meta.kv_segments
    if not segs:
        return
    if len(segs) > MAX_KV_SEGMENTS or len(segs) * meta.num_blocks > MAX_KV_DESCRIPTORS:
        raise MalformedMessage(
            f"at most {MAX_KV_SEGMENTS} KV segments and {MAX_KV_DESCRIPTORS} block parts "
            f"in all, not {len(segs)} x {meta.num_blocks}"
        )
    if segs[0].addr != meta.kv_addr:
        raise MalformedMessage("kv_addr must be the first KV segment's address")
    total = 0
    for seg in segs:
        if seg.length <= 0 or seg.stride < seg.length or seg.addr < 0:
            raise MalformedMessage(
                "a KV segment needs a positive length within its stride and an address >= 0"
            )
        if seg.addr + (meta.num_blocks - 1) * seg.stride + seg.length > 1 << 64:
            raise MalformedMessage("a KV segment does not fit in a 64-bit address space")
        total += seg.length
    if total != meta.block_len:
        raise MalformedMessage(
            f"the KV segments add up to {total} bytes a block, block_len says {meta.block_len}"
        )


def check_identity(incarnation: str, pod: PodIdentity | None) -> None:
    """MalformedMessage when an incarnation or pod identity is longer than allowed."""
    if len(incarnation) > MAX_ID_LEN:
        raise MalformedMessage(f"incarnation must be at most {MAX_ID_LEN} characters")
    if pod is not None:
        for name, value in (("namespace", pod.namespace), ("name", pod.name), ("uid", pod.uid)):
            if len(value) > MAX_ID_LEN:
                raise MalformedMessage(f"pod {name} must be at most {MAX_ID_LEN} characters")


def _check_id(field: str, value: str) -> None:
    if not value or len(value) > MAX_ID_LEN:
        raise MalformedMessage(f"{field} must be 1..{MAX_ID_LEN} characters")


# --- Notifications (NIXL notif bytes between engines) -------------------------------------


class PushRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """Decode rank -> the prefill rank of the same TP rank: 'request R may be written into
    these blocks of mine until `expires_at`'.

    `expires_at` is the decode's wall clock (Unix seconds): the prefill starts no WRITE for
    it later than that (node clocks are assumed to agree to well within `write_timeout_s`,
    as NTP keeps them). A WRITE started is given up after `write_timeout_s`. The decode
    reuses the blocks only once the prefill has answered for them, or once
    `expires_at + write_timeout_s` and a margin have passed.
    """

    request_id: str
    decode_engine_id: str
    prefill_engine_id: str
    block_ids: list[int]
    decode_tp_rank: int = 0
    expires_at: float
    write_timeout_s: float
    # The request's blocks from this one on are wanted (the decode holds the ones before
    # from its own prefix cache): the prefill writes its blocks[first_block:] into block_ids.
    first_block: int = 0
    # A digest of the request's prompt tokens (`prompt_digest`), where the decode knows
    # them: a prefill that finds the request by another name than its own id (the id a P/D
    # router gave it) writes only a request whose prompt has the same digest.
    prompt_digest: str = ""


MAX_REQUESTS_PER_WRITE = 64
PROMPT_DIGEST_CHARS = 32


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The digest of a prompt's token ids that registrations carry (`PushRegistration`):
    32 hex characters of BLAKE2b over the ids as little-endian 64-bit integers."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=PROMPT_DIGEST_CHARS // 2).hexdigest()


class PushDone(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Prefill -> decode, attached to the WRITE: the blocks of request R (and of the
    requests in `more_request_ids`, when one WRITE carried several) have landed."""

    request_id: str
    prefill_engine_id: str
    num_blocks: int  # all the WRITE's blocks
    more_request_ids: list[str] = []

    @property
    def request_ids(self) -> list[str]:
        return [self.request_id, *self.more_request_ids]


class PushFail(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode: request R will not be written, and why."""

    request_id: str
    prefill_engine_id: str
    reason: FailureType
    message: str = ""


class PushCancel(msgspec.Struct, frozen=True, kw_only=True):
    """Decode rank -> prefill rank: 'I give request R up; do not start its WRITE'. The
    prefill answers: PUSH_FAIL when no WRITE of R can land any more, PUSH_DONE when R's
    WRITE has landed, nothing yet while it is in flight (its end answers). A cancel that
    found nothing of R is answered within a per-agent rate (a flood of them is not); the
    decode's own deadline ends a request left unanswered."""

    request_id: str
    decode_engine_id: str
    prefill_engine_id: str
    decode_tp_rank: int = 0


class PushHello(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A rank -> the same rank of a peer it has just added: 'I hold your agent: what you send
    me counts, and I can answer'. Answered with `ack` set by a rank that holds the sender
    (so the greeting reaches the side that added the other first, too)."""

    engine_id: str
    ack: bool = False


Notification = PushRegistration | PushDone | PushFail | PushCancel | PushHello

_decoders: dict[bytes, msgspec.msgpack.Decoder[Notification]] = {
    REG_PREFIX: msgspec.msgpack.Decoder(PushRegistration),
    DONE_PREFIX: msgspec.msgpack.Decoder(PushDone),
    FAIL_PREFIX: msgspec.msgpack.Decoder(PushFail),
    CANCEL_PREFIX: msgspec.msgpack.Decoder(PushCancel),
    HELLO_PREFIX: msgspec.msgpack.Decoder(PushHello),
}
_prefix_of: dict[type, bytes] = {
    PushRegistration: REG_PREFIX,
    PushDone: DONE_PREFIX,
    PushFail: FAIL_PREFIX,
    PushCancel: CANCEL_PREFIX,
    PushHello: HELLO_PREFIX,
}


def encode_notification(msg: Notification) -> bytes:
    """Prefix + msgpack, as vLLM's push connector frames its registrations."""
    return _prefix_of[type(msg)] + msgspec.msgpack.encode(msg)


def decode_notification(data: bytes) -> Notification:
    """Decodes a notification from a peer; raises MalformedMessage for anything unusable."""
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise MalformedMessage(f"notification of {len(data)} bytes exceeds the limit")
    for prefix, decoder in _decoders.items():
        if data.startswith(prefix):
            try:
                msg = decoder.decode(data[len(prefix) :])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise MalformedMessage(f"{prefix.decode()} body does not decode: {exc}") from None
            if isinstance(msg, PushHello):
                _check_id("engine_id", msg.engine_id)
                return msg
            _check_id("request_id", msg.request_id)
            if isinstance(msg, PushDone):
                if len(msg.more_request_ids) >= MAX_REQUESTS_PER_WRITE:
                    raise MalformedMessage(
                        f"a completion may name at most {MAX_REQUESTS_PER_WRITE} requests"
                    )
                for rid in msg.more_request_ids:
                    _check_id("more_request_ids[]", rid)
            if isinstance(msg, PushRegistration):
                _check_id("decode_engine_id", msg.decode_engine_id)
                _check_id("prefill_engine_id", msg.prefill_engine_id)
                if not 0 < len(msg.block_ids) <= MAX_BLOCKS_PER_REQUEST:
                    raise MalformedMessage("a registration must name 1..65536 blocks")
                if any(b < 0 for b in msg.block_ids):
                    raise MalformedMessage("block ids must be non-negative")
                if not 0 < msg.write_timeout_s <= 3600 or msg.expires_at != msg.expires_at:
                    raise MalformedMessage("write_timeout_s must be 0..3600 s, expires_at a time")
                if not 0 <= msg.first_block < MAX_BLOCKS_PER_REQUEST:
                    raise MalformedMessage("first_block must be 0..65535")
                if len(msg.prompt_digest) > PROMPT_DIGEST_CHARS:
                    raise MalformedMessage(
                        f"prompt_digest must be at most {PROMPT_DIGEST_CHARS} characters"
                    )
            if isinstance(msg, PushCancel):
                _check_id("decode_engine_id", msg.decode_engine_id)
                _check_id("prefill_engine_id", msg.prefill_engine_id)
            return msg
    raise MalformedMessage(f"unknown notification prefix {data[:16]!r}")


# --- Control API bodies (JSON over the worker's aiohttp server) ----------------------------


class Introduction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/introductions` (msgpack), and its answer: an engine that handshakes lazily
    (no operator) introduces itself to the peer a request names in two steps. First a hello
    (`ranks` empty): the peer answers its own introduction and adds nothing. Once that
    answer proved the peer credential (`credentials.peer_answer_proof`, in the
    `KVTopo-Peer-Proof` header), the introduction with the metadata envelope of each of its
    TP ranks: the peer adds it and answers its own again. Requests are signed with the peer
    credential (`credentials.sign_peer_request`), which is never sent."""

    engine_id: str
    role: Role
    ranks: list[bytes]


class PeerAddRequest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`PUT /v1/peers/{engine_id}`: add this peer, fetching its metadata from `endpoint`."""

    endpoint: str
    role: Role
    # Only this TP rank of the peer (default: every rank). Left out of the JSON when unset,
    # so an operator talks to workers that predate it.
    rank: int | None = None
    # What the peer must be (empty: not checked): the uid of its pod and its incarnation.
    # A peer held under an older incarnation is replaced.
    pod_uid: str = ""
    incarnation: str = ""
    # What the operator minted for this engine to fetch the peer's metadata with
    # (`kvtopo_worker.signing`: "<kid>:<hex>"); empty where lazy handshakes use the peer token.
    ticket: str = ""


MAX_PEER_CHANGES = 1024  # adds plus evictions in one `PATCH /v1/peers`
MAX_HANDSHAKE_TIMEOUT_S = 300.0  # the longest handshake deadline a batch may ask for
MAX_IDLE_TTL_S = 86400.0  # the longest idle TTL the operator may set (a day)
# Adds of one `PATCH /v1/peers` the worker handshakes at once; the operator sizes the call's
# timeout by it (each round of adds may take the worker its handshake timeout).
PEER_BATCH_CONCURRENCY = 16


class PeerAddItem(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """One peer to add in a `PATCH /v1/peers` batch."""

    engine_id: str
    endpoint: str
    role: Role
    rank: int | None = None
    pod_uid: str = ""
    incarnation: str = ""
    ticket: str = ""  # as PeerAddRequest.ticket


class PeerChanges(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`PATCH /v1/peers`: several peer adds and evictions in one call (the operator sends
    one per worker per round, so a rollout costs calls per worker, not per pair). Each item
    is handled exactly as its single-peer route would handle it, except that
    `handshake_timeout_s`, when set (0 < s <= MAX_HANDSHAKE_TIMEOUT_S), bounds this batch's
    handshakes (each metadata fetch and NIXL agent add) instead of the worker's default."""

    add: list[PeerAddItem] = []
    evict: list[str] = []
    handshake_timeout_s: float | None = None


class PeerOutcome(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The outcome of one item of a `PATCH /v1/peers` batch: `status` is the HTTP status its
    single-peer route would have answered; `result` is set on success, `error` otherwise."""

    engine_id: str
    op: Literal["add", "evict"]
    status: int
    result: str = ""
    agents: dict[int, str] = {}
    error: str = ""
    message: str = ""
    failure_type: FailureType | None = None


class PeerChangesResult(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to `PATCH /v1/peers`: one outcome per item, adds first, in request order."""

    results: list[PeerOutcome]


class PeerResult(msgspec.Struct, frozen=True, kw_only=True):
    """Answer to a peer add or delete."""

    engine_id: str
    # `renewed`: the peer was held unhealthy; its metadata was fetched again and its agents
    # replaced (read as an open string by operators that predate it).
    result: Literal["added", "present", "renewed", "evicted", "deferred", "absent"]
    agents: dict[int, str] = {}


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Every 4xx/5xx answer of the control API."""

    error: str
    message: str
    failure_type: FailureType | None = None
    local_hash: str | None = None
    remote_hash: str | None = None


class PeerState(msgspec.Struct, frozen=True, kw_only=True):
    """One remote engine as the worker's registry holds it."""

    engine_id: str
    agents: dict[int, str]
    transfers_in_flight: int
    eviction_pending: bool
    idle_s: float
    incarnation: str = ""  # the peer's incarnation its agents were added under
    health: PeerHealth = "ok"  # see PeerHealth; only the holder's view of the peer
    health_reason: str = ""  # why it is not ok (the failure that made it so)


class FailureRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The most recent failure a worker recorded (wall-clock time)."""

    time: float
    type: FailureType
    request_id: str = ""
    engine_id: str = ""
    message: str = ""


class WorkerSettings(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """`PUT /v1/settings`: the worker settings the operator sets; a field left out is left
    as it is. The answer is the same struct with every field set (the effective values).

    `idle_ttl_s`: the registry's idle-TTL backstop (0..MAX_IDLE_TTL_S; 0 turns it off): a
    peer that carried no transfer for that long is evicted."""

    idle_ttl_s: float | None = None


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/state`: what the operator gathers from each worker. `handshake_timeout_s`
    (the worker's default handshake deadline) and `idle_ttl_s` (its idle-TTL backstop, 0:
    off) are None from a worker that predates `PUT /v1/settings` and the per-batch deadline,
    which then must not be sent them."""

    engine_id: str
    role: Role
    compat_hash: str
    protocol_version: int
    peers: list[PeerState]
    failures: dict[str, int]
    requests_done: int
    requests_failed: int
    requests_in_flight: int
    started_at: float
    last_failure: FailureRecord | None = None
    tp_size: int = 1
    incarnation: str = ""
    pod: PodIdentity | None = None
    handshake_timeout_s: float | None = None
    idle_ttl_s: float | None = None
    # WRITEs past their deadline that NIXL would not release (they may still land; their
    # requests stay held): an engine's NIXL in trouble, for the operator and a person.
    writes_unreleasable: int = 0


def state_tag(state: WorkerState) -> str:
    """The `ETag` of a `/v1/state` answer: a digest of every field except the ones that move
    with each request (`requests_done`, `requests_failed`, `requests_in_flight`, and each
    peer's `transfers_in_flight` and `idle_s`). A reader that sends it back in
    `If-None-Match` is answered `304 Not Modified`, with no body, while nothing else has
    changed: the operator re-reads a thousand idle workers for the cost of their headers.
    A reader of a 304 must not rely on the moving fields of the answer it kept."""
    stable = msgspec.structs.replace(
        state,
        requests_done=0,
        requests_failed=0,
        requests_in_flight=0,
        failures=dict(sorted(state.failures.items())),  # an equal state, an equal tag
        peers=[
            msgspec.structs.replace(
                p, agents=dict(sorted(p.agents.items())), transfers_in_flight=0, idle_s=0.0
            )
            for p in state.peers
        ],
    )
    digest = hashlib.blake2b(msgspec.json.encode(stable), digest_size=12)
    return f'"{digest.hexdigest()}"'


def tag_matches(if_none_match: str | None, tag: str) -> bool:
    """Whether an `If-None-Match` header names `tag` (one of a comma-separated list, or
    `*`); weak tags (`W/"..."`) compare equal to their strong form."""
    if not if_none_match:
        return False
    named = (item.strip() for item in if_none_match.split(","))
    return any(item == "*" or item.removeprefix("W/") == tag for item in named)


class SubmitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/requests` of the emulated engine: start one request's KV transfer.

    On a prefill worker: the request's KV is computed (filled deterministically) and waits
    for the decode side's registration. On a decode worker: blocks are allocated and a
    registration is sent to `peer_engine_id` (the prefill engine).
    """

    request_id: str
    peer_engine_id: str
    num_blocks: int

    def __post_init__(self) -> None:
        _check_id("request_id", self.request_id)
        _check_id("peer_engine_id", self.peer_engine_id)
        if not 0 < self.num_blocks <= MAX_BLOCKS_PER_REQUEST:
            raise MalformedMessage(f"num_blocks must be 1..{MAX_BLOCKS_PER_REQUEST}")


class RequestOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How one request ended (exactly once)."""

    request_id: str
    status: Literal["done", "failed"]
    reason: FailureType | None = None
    message: str = ""
    verified_bytes: int = 0
    peer_engine_id: str = ""
    ended_at: float = 0.0
    seq: int = 0  # its number among the engine's outcomes (1, 2, ...; `GET /v1/finished`)


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/drain` of the emulated engine: stop taking requests, end the ones held.

    From the first call on, `POST /v1/requests` answers 503 `draining`. Requests already
    accepted run on; those still held `timeout_s` after the first call are given up with
    reason `shutdown` (each ends once no WRITE of it can land: a decode cancels and waits
    for the prefill's answer, so both sides report the same outcome). Repeating the call
    changes nothing and answers the current `DrainState`.
    """

    timeout_s: float = 10.0


class DrainState(msgspec.Struct, frozen=True, kw_only=True):
    """The emulated engine's drain: `drained` once every accepted request has ended and its
    outcome has been handed out by `GET /v1/finished` (nothing more can appear)."""

    draining: bool
    requests_held: int
    requests_in_flight: int
    drained: bool
    # KV blocks the engine found written while it held no request in them (a WRITE that
    # landed after its request ended; the emulated engine's guard, 0 where not kept).
    late_writes: int = 0
    # Where the client's aborts found their requests, by stage (the vLLM engine's: e.g.
    # "recv:waiting-for-kv", "recv:reported-unseen", "send:writing"); empty where not kept.
    abort_stages: dict[str, int] = msgspec.field(default_factory=dict)


def decode_json_body(data: bytes, kind: type[_T]) -> _T:
    """Decodes a control-API JSON body; raises MalformedMessage with the field at fault."""
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"bad {kind.__name__} body: {exc}") from None
