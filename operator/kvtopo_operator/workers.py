"""The operator's client for the worker control API (`kvtopo_worker.agent`).

Owns the HTTP calls the operator makes to engine pods: read `/v1/state`, and add and evict
peers, all of one worker's in one call (`PATCH /v1/peers`), and set its idle TTL (`PUT
/v1/settings`), each signed with the operator's key, with a timeout, over the operator's own
keep-alive connections (`kvtopo_operator.wire`). Only endpoints that are ip:port are dialled
(`kvtopo_worker.endpoints`), no redirect is followed, and answers are read up to a bound.
Decodes answers with the worker's wire
protocol (`kvtopo_worker.protocol`, which imports neither torch nor nixl).

Credentials (`kvtopo_worker.signing`): a worker answers an unsigned call 401 with its
challenge (its key, pod uid, incarnation and the operator keys it knows); the client keeps
the challenge of each endpoint, signs for it only when it names the uid of the pod the call
is for (else the call fails as an identity mismatch, and nothing signed reaches that
endpoint), and mints each peer add's ticket from the challenge of the peer's endpoint. A
401 with a new challenge (the worker restarted, or its key file rotated) is answered once
more. Called by `reconcile`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec

from kvtopo_operator.model import (
    MAX_COUNT,
    FailureView,
    WorkerUnreachable,
    WorkerView,
)
from kvtopo_operator.wire import TooLarge, WireError, WirePool
from kvtopo_worker.credentials import TokenError
from kvtopo_worker.endpoints import EndpointError, parse_endpoint
from kvtopo_worker.protocol import (
    MAX_HEALTH_REASON,
    MAX_ID_LEN,
    PEER_BATCH_CONCURRENCY,
    UNHEALTHY,
    FailureType,
    PeerAddItem,
    PeerChanges,
    WorkerSettings,
)
from kvtopo_worker.signing import (
    CallerKey,
    Challenge,
    PrivateKeys,
    SignatureError,
    parse_challenge,
)

log = logging.getLogger(__name__)

# --- what the operator reads of workers' answers ---------------------------------------------
# Tolerant views of the worker's wire types: only the fields the operator uses, with open
# strings where the worker has enums (a newer worker may count a failure type this operator
# has never heard of), and unknown fields ignored. A newer worker is read, never called
# unreachable for saying more. (The worker's own types stay strict for what it accepts.)


class _FailureView(msgspec.Struct, frozen=True):
    time: float
    type: str
    request_id: str = ""
    engine_id: str = ""
    message: str = ""


class _PodView(msgspec.Struct, frozen=True):
    uid: str = ""


class _PeerView(msgspec.Struct, frozen=True):
    engine_id: str
    eviction_pending: bool = False
    incarnation: str = ""
    # "ok" from a worker that predates peer health. Only UNHEALTHY values ("dropped",
    # "failing") make the operator re-handshake the peer: those are what a worker renews on
    # an add. A value this operator does not know is read as ok and logged once: counting
    # it unhealthy would plan, round after round, an add the worker may answer `present`,
    # and the pair would never count as connected.
    health: str = "ok"
    health_reason: str = ""


class _StateView(msgspec.Struct, frozen=True):
    engine_id: str
    role: str
    compat_hash: str
    peers: list[_PeerView] = []
    failures: dict[str, int] = {}
    last_failure: _FailureView | None = None
    incarnation: str = ""
    pod: _PodView | None = None
    handshake_timeout_s: float | None = None  # None: predates the per-batch deadline
    idle_ttl_s: float | None = None  # None: predates PUT /v1/settings


class _SettingsView(msgspec.Struct, frozen=True):
    idle_ttl_s: float | None = None


class _OutcomeView(msgspec.Struct, frozen=True):
    engine_id: str
    op: str
    status: int
    result: str = ""
    error: str = ""
    message: str = ""


class _ChangesView(msgspec.Struct, frozen=True):
    results: list[_OutcomeView]


class _ErrorView(msgspec.Struct, frozen=True):
    error: str = ""
    message: str = ""


_unknown_health_seen: set[str] = set()  # peer health values logged once as unknown


def _unhealthy(peers: list[_PeerView]) -> dict[str, str]:
    """Held peers the worker reports unhealthy: engine id -> "health: reason" (the reason
    clamped to the protocol's MAX_HEALTH_REASON characters: it goes into Event messages,
    and a worker answering a 15 MB reason that changed on every read once grew the
    operator by hundreds of MB)."""
    out: dict[str, str] = {}
    for p in peers:
        if p.health in UNHEALTHY:
            reason = p.health_reason[:MAX_HEALTH_REASON]
            out[p.engine_id] = f"{p.health}: {reason}" if reason else p.health
        elif (
            p.health != "ok"
            and p.health[:64] not in _unknown_health_seen
            and len(_unknown_health_seen) < 64  # what a worker says grows nothing unbounded
        ):
            _unknown_health_seen.add(p.health[:64])
            log.warning(
                "a worker reports peer health %r, which this operator does not know: read as ok",
                p.health[:64],
            )
    return out


# The status counts failures in one closed vocabulary, the worker protocol's `FailureType`,
# plus OTHER_FAILURE: a type a newer worker adds is counted there (and logged once, and
# named in `last.message`), so the status's counts stay within their bounded map.
OTHER_FAILURE = "other"
KNOWN_FAILURES = frozenset(t.value for t in FailureType)
_unknown_failures_seen: set[str] = set()


def failure_type(name: str) -> str:
    """`name` if the protocol knows it, else OTHER_FAILURE (logged once per name)."""
    if name in KNOWN_FAILURES:
        return name
    if name[:64] not in _unknown_failures_seen and len(_unknown_failures_seen) < 256:
        _unknown_failures_seen.add(name[:64])
        log.warning(
            "a worker reports failure type %r, which this operator does not know: counted as %r",
            name[:64],
            OTHER_FAILURE,
        )
    return OTHER_FAILURE


def _failure_counts(failures: dict[str, int]) -> dict[str, int]:
    """The worker's counters by known type, each clamped to 0..MAX_COUNT (a counter the
    status could not carry saturates; a negative one counts nothing)."""
    out: dict[str, int] = {}
    for name, count in failures.items():
        key = failure_type(name)
        out[key] = min(out.get(key, 0) + max(count, 0), MAX_COUNT)
    return out


MAX_COMPAT_HASH = 64  # the status's compatHash bound
ROLES = ("prefill", "decode", "both")  # what a worker may say it is
# Failure times the operator takes (epoch seconds): 2000-01-01 .. 2200-01-01. Another
# value is no time (the failure is dated when it was read).
_EARLIEST, _LATEST = 946_684_800.0, 7_258_118_400.0


def _refusal(st: _StateView) -> str | None:
    """Why a worker's answer cannot stand for its engine (a field the status could not
    carry or the pairing could not trust); None when it can. The engine is then Failed with
    this reason; the round and the other engines go on."""
    if not 1 <= len(st.engine_id) <= MAX_ID_LEN:
        return f"its engine id has {len(st.engine_id)} characters (1..{MAX_ID_LEN})"
    if st.role not in ROLES:
        return f"its role {st.role[:32]!r} is none of {', '.join(ROLES)}"
    if len(st.compat_hash) > MAX_COMPAT_HASH:
        return (
            f"its compatibility hash has {len(st.compat_hash)} characters "
            f"(at most {MAX_COMPAT_HASH})"
        )
    if len(st.incarnation) > MAX_ID_LEN or (st.pod is not None and len(st.pod.uid) > MAX_ID_LEN):
        return f"its incarnation or pod uid is longer than {MAX_ID_LEN} characters"
    if len(st.peers) > MAX_STATE_PEERS:
        return (
            f"it reports {len(st.peers)} peers (at most {MAX_STATE_PEERS}: more engines of "
            "the other role than a topology has)"
        )
    for p in st.peers:
        if not 1 <= len(p.engine_id) <= MAX_ID_LEN or len(p.incarnation) > MAX_ID_LEN:
            return f"a peer's engine id or incarnation is not 1..{MAX_ID_LEN} characters"
    return None


def _last_failure(lf: _FailureView | None, now: float) -> FailureView | None:
    """The worker's last failure, clamped to what the status carries."""
    if lf is None:
        return None
    when = lf.time if _EARLIEST <= lf.time <= _LATEST else now  # NaN fails both bounds
    message = lf.message if lf.type in KNOWN_FAILURES else f"({lf.type[:64]}) {lf.message}"
    return FailureView(
        when,
        failure_type(lf.type),
        lf.request_id[:MAX_ID_LEN],
        lf.engine_id[:MAX_ID_LEN],
        message[:512],
    )


MAX_STATE_BYTES = 8 << 20
"""The most of a worker's answer the operator reads (a worker holding a thousand peers
answers well under a megabyte; MAX_STATE_PEERS of them, ids of 64 characters, about 6 MiB).
An answer that says it is larger is refused before its body is read (`wire.TooLarge`)."""
MAX_STATE_PEERS = 16_384
"""The most peers a worker may report: its engine's partners, at most the engines of the
other role in its topology. A worker that reports more is Failed with the reason; the
pairing never works on it (600,000 peers once cost 45 s of a round and 1.2 GiB)."""
MAX_ETAG = 128
"""The longest ETag kept; a longer one is cut, so it never matches and the next read is whole."""
# An idle connection to a worker is kept this long for its next call: longer than a
# 2,000-worker topology leaves between two re-reads of one worker (20 s), and under the
# workers' own keep-alive (60 s, `kvtopo_worker.serving`), so the operator lets go first.
KEEPALIVE_S = 45.0
CLOCK_SLACK_S = 5.0  # a worker's clock this far from ours is skew (logged; signed against)


class PeerAdd(NamedTuple):
    """One peer for a worker to add: who it is, where its control API is, and what it must
    be (its pod's uid and its process's incarnation). A tuple: a surge round makes one per
    handshake half, tens of thousands."""

    engine_id: str
    endpoint: str
    role: str
    pod_uid: str = ""
    incarnation: str = ""


@dataclass(frozen=True)
class CallResult:
    ok: bool
    status: int  # HTTP status, 0 when the worker could not be reached
    message: str
    result: str = ""  # PeerResult.result on success


class IdentityMismatch(Exception):
    """The endpoint's challenge names another pod: nothing was signed for it."""


# How often the operator's key file is looked at for a rotation (`PrivateKeys.recheck_s`):
# kubelet takes up to a minute to update a mounted Secret, and an engine already past the
# rotation (listing only the new key) makes the operator look at once.
KEY_RECHECK_S = 1.0


class WorkerClient:
    """Async client for many workers; one pool, bounded by the caller's semaphore."""

    MAX_CHALLENGES = 65_536  # endpoints whose challenge is kept (least recently used go)

    def __init__(self, key_file: Path | None, keys: PrivateKeys | None = None) -> None:
        """`keys` (when set) wins over `key_file` (the operator's private key, PEM: the
        current key, then during a rotation the previous one). A key file that holds no key
        raises KeyFileError (a TokenError) here, and fails each call while it holds none
        (it is re-read when the mounted Secret changes, not on every call: its stat is
        taken at most every `KEY_RECHECK_S`, and at once for an engine that lists none of
        the keys held)."""
        if keys is None:
            if key_file is None:
                raise ValueError("the operator needs its private key (--worker-key-file)")
            keys = PrivateKeys(path=key_file, recheck_s=KEY_RECHECK_S)
        self.caller = CallerKey("operator", keys)
        self._challenges: OrderedDict[str, Challenge] = OrderedDict()
        # endpoint -> its clock minus ours (seconds), from the time in its last challenge:
        # calls are signed against the worker's clock, so a replica whose clock is off is
        # still understood (a standby 90 s ahead once made every worker answer 401).
        self._offsets: OrderedDict[str, float] = OrderedDict()
        self._skew_said = 0.0  # when skew was last logged (monotonic)
        # An idle connection is kept a minute: a large topology's workers are re-read
        # every 10-20 s (`Settings.state_reads_per_s`), and at 15 s (the default of
        # aiohttp's client, which the operator used before `wire`) each re-read opened a
        # new connection (8% of the operator's samples at 2,000 workers went to
        # connecting). A worker's server keeps one far longer (aiohttp's server default,
        # 3630 s), so the operator is the side that closes an idle connection.
        self._pool = WirePool(limit=256, keepalive_s=KEEPALIVE_S)

    def challenge(self, endpoint: str) -> Challenge | None:
        """The last challenge the worker at `endpoint` answered with (None: none yet)."""
        return self._challenges.get(endpoint)

    def _remember(self, endpoint: str, challenge: Challenge) -> None:
        self._challenges[endpoint] = challenge
        self._challenges.move_to_end(endpoint)
        while len(self._challenges) > self.MAX_CHALLENGES:
            self._challenges.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        self._challenges.pop(endpoint, None)

    def clock_offset(self, endpoint: str) -> float:
        """The worker's clock minus ours, as its last challenge said (0 until one did)."""
        return self._offsets.get(endpoint, 0.0)

    def _clock_from(self, endpoint: str, challenge: Challenge, sent: float, got: float) -> bool:
        """Takes the worker's clock from `challenge` (its time, between `sent` and `got` on
        ours); whether the offset moved by more than CLOCK_SLACK_S (signing afresh then
        makes sense)."""
        if challenge.now is None:
            return False
        offset = challenge.now + 0.5 - (sent + got) / 2  # its time is truncated to a second
        old = self._offsets.get(endpoint)
        self._offsets[endpoint] = offset
        self._offsets.move_to_end(endpoint)
        while len(self._offsets) > self.MAX_CHALLENGES:
            self._offsets.popitem(last=False)
        if abs(offset) > CLOCK_SLACK_S and time.monotonic() - self._skew_said > 60:
            self._skew_said = time.monotonic()
            skewed = sum(abs(o) > CLOCK_SLACK_S for o in self._offsets.values())
            log.warning(
                "clock skew: the worker at %s is %+.0f s from this replica's clock (%d of %d "
                "workers are off by more than %g s); calls are signed against each worker's "
                "own clock. Check NTP on this node and theirs.",
                endpoint,
                offset,
                skewed,
                len(self._offsets),
                CLOCK_SLACK_S,
            )
        return old is None or abs(offset - old) > CLOCK_SLACK_S

    async def _call(
        self,
        method: str,
        endpoint: str,
        path: str,
        timeout_s: float,
        body: bytes | None = None,
        etag: str = "",
        pod_uid: str = "",
    ) -> tuple[int, bytes, str]:
        """One call: status, at most MAX_STATE_BYTES + 1 bytes of the answer, and its ETag
        (""). Signed for the challenge held for `endpoint`; without one, or answered 401
        with a new one, asked again (once) signed for the new one. Raises
        IdentityMismatch when the challenge names a pod uid other than `pod_uid`. `etag`
        is sent as If-None-Match."""
        target = parse_endpoint(endpoint)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if etag:
            headers["If-None-Match"] = etag
        for attempt in range(2):
            held = self._challenges.get(endpoint)
            if held is not None and held.pod_uid != pod_uid:
                if attempt == 1:  # the endpoint's own answer names another pod
                    raise IdentityMismatch(
                        f"the worker at {endpoint} is not this pod's: it says it runs in pod "
                        f"uid {held.pod_uid or '(none)'}, the pod's is {pod_uid}; nothing "
                        "signed was sent; start the worker with its pod identity (--pod-uid, "
                        "from the downward API)"
                    )
                # Held for another pod that had this address (a pod IP is reused): ask the
                # endpoint afresh, unsigned.
                self.forget(endpoint)
                held = None
            sent = dict(headers)
            if held is not None:
                sent["Authorization"] = self.caller.authorization(
                    held,
                    method,
                    path,
                    str(target),
                    body or b"",
                    now=time.time() + self._offsets.get(endpoint, 0.0),
                )
            began = time.time()
            answer = await self._pool.request(
                target, method, path, sent, body, timeout_s, MAX_STATE_BYTES
            )
            if answer.status == 401 and attempt == 0:
                fresh = parse_challenge(answer.fields.get("www-authenticate", ""))
                if fresh is not None:
                    moved = self._clock_from(endpoint, fresh, began, time.time())
                    if fresh != held or moved:
                        self._remember(endpoint, fresh)
                        continue
            tag = answer.fields.get("etag", "")[:MAX_ETAG]
            if answer.status == 304:
                return answer.status, b"", tag
            if answer.status != 200:
                return answer.status, answer.body[:300], tag
            if held is not None:
                self._challenges.move_to_end(endpoint)
            return answer.status, answer.body, tag
        raise AssertionError("unreachable")  # pragma: no cover

    def ticket(
        self, endpoint: str, pod_uid: str, fetcher: tuple[str, str], incarnation: str = ""
    ) -> str:
        """The ticket that lets `fetcher` (engine id, incarnation) fetch the metadata of
        the engine at `endpoint` (of pod `pod_uid`); "" when its challenge is not held or
        names another pod (the add then fails at the fetch, and the next round reads the
        peer again)."""
        return self.tickets([PeerAdd("", endpoint, "", pod_uid, incarnation)], fetcher)[0]

    def tickets(self, adds: list[PeerAdd], fetcher: tuple[str, str]) -> list[str]:
        """`ticket` for each of `adds` (its endpoint, pod uid and incarnation), minted as
        one batch for one fetcher."""
        out = [""] * len(adds)
        if not fetcher[0]:
            return out
        targets: list[Challenge] = []
        at: list[int] = []
        for i, a in enumerate(adds):
            held = self._challenges.get(a.endpoint)
            if held is None or held.pod_uid != a.pod_uid:
                continue
            if a.incarnation and held.incarnation != a.incarnation:
                # The challenge is of another process at that endpoint (the peer restarted
                # since it was read): no ticket it would refuse; the round reads it again.
                self.forget(a.endpoint)
                continue
            targets.append(held)
            at.append(i)
        try:
            minted = self.caller.tickets(targets, *fetcher)
        except (SignatureError, TokenError):  # a key that cannot be used: each on its own
            minted = [self._ticket_or_none(t, fetcher) for t in targets]
        for i, ticket in zip(at, minted, strict=True):
            out[i] = ticket
        return out

    def _ticket_or_none(self, target: Challenge, fetcher: tuple[str, str]) -> str:
        try:
            return self.caller.ticket(target, *fetcher)
        except (SignatureError, TokenError):
            return ""

    async def close(self) -> None:
        self._pool.close()

    async def state(
        self,
        endpoint: str,
        timeout_s: float,
        known: WorkerView | None = None,
        pod_uid: str = "",
    ) -> WorkerView | WorkerUnreachable:
        """The worker's state; `known` itself when it carries the worker's ETag and the
        worker answers 304 (nothing but its request counters moved since). `pod_uid`: the
        pod the worker must be (its challenge must name it before anything is signed)."""
        try:
            etag = known.etag if known is not None else ""
            status, body, tag = await self._call(
                "GET", endpoint, "/v1/state", timeout_s, etag=etag, pod_uid=pod_uid
            )
            if status == 304:
                if known is not None and etag and tag == etag:
                    return known
                # A 304 that does not confirm what was sent: read the state whole.
                status, body, tag = await self._call(
                    "GET", endpoint, "/v1/state", timeout_s, pod_uid=pod_uid
                )
            if status != 200:
                return WorkerUnreachable(f"HTTP {status}: {body[:200]!r}")
            if len(body) > MAX_STATE_BYTES:
                return WorkerUnreachable(
                    f"worker answer refused: it exceeds {MAX_STATE_BYTES} bytes", refused=True
                )
            try:
                st = msgspec.json.decode(body, type=_StateView)
            except msgspec.DecodeError as exc:
                return WorkerUnreachable(f"worker answer refused: {exc}"[:300], refused=True)
        except EndpointError as exc:
            return WorkerUnreachable(f"endpoint refused: {exc}")
        except IdentityMismatch as exc:
            return WorkerUnreachable(str(exc)[:400], identity_mismatch=True)
        except (TokenError, SignatureError) as exc:
            return WorkerUnreachable(str(exc)[:300])
        except TooLarge as exc:
            return WorkerUnreachable(f"worker answer refused: {exc}"[:300], refused=True)
        except (WireError, TimeoutError, OSError, msgspec.DecodeError) as exc:
            return WorkerUnreachable(f"{type(exc).__name__}: {exc}"[:300])
        refused = _refusal(st)
        if refused is not None:
            return WorkerUnreachable(f"worker answer refused: {refused}", refused=True)
        return WorkerView(
            engine_id=st.engine_id,
            role=st.role,
            compat_hash=st.compat_hash,
            peers=frozenset(p.engine_id for p in st.peers),
            evicting=frozenset(p.engine_id for p in st.peers if p.eviction_pending),
            failures=_failure_counts(st.failures),
            last_failure=_last_failure(st.last_failure, time.time()),
            incarnation=st.incarnation,
            pod_uid=st.pod.uid if st.pod is not None else "",
            peer_incarnations={p.engine_id: p.incarnation for p in st.peers},
            unhealthy_peers=_unhealthy(st.peers),
            handshake_timeout_s=st.handshake_timeout_s,
            idle_ttl_s=st.idle_ttl_s,
            etag=tag,
        )

    async def change_peers(
        self,
        endpoint: str,
        adds: list[PeerAdd],
        evicts: list[str],
        timeout_s: float,
        handshake_timeout_s: float | None = None,
        *,
        pod_uid: str = "",
        fetcher: tuple[str, str] = ("", ""),
    ) -> dict[tuple[str, str], CallResult]:
        """Adds peers and evicts peers (engine id) on one worker in one call; the result of
        each, keyed by ("add" | "evict", engine id). A failed call fails every item with its
        reason. `handshake_timeout_s`, when set and there are adds, is sent as the batch's
        handshake deadline (only to a worker whose state reports one: an older worker
        refuses the field). `pod_uid`: the worker's pod; `fetcher`: its engine id and
        incarnation, which each add's ticket is minted for."""
        body = msgspec.json.encode(
            PeerChanges(
                add=[
                    PeerAddItem(
                        engine_id=a.engine_id,
                        endpoint=a.endpoint,
                        role=a.role,  # type: ignore[arg-type]
                        pod_uid=a.pod_uid,
                        incarnation=a.incarnation,
                        ticket=ticket,
                    )
                    for a, ticket in zip(adds, self.tickets(adds, fetcher), strict=True)
                ],
                evict=evicts,
                handshake_timeout_s=handshake_timeout_s if adds else None,
            )
        )
        keys = [("add", a.engine_id) for a in adds] + [("evict", e) for e in evicts]
        # Each add may take the worker up to `timeout_s` (it fetches the peer's metadata).
        rounds = -(-len(adds) // PEER_BATCH_CONCURRENCY) if adds else 1
        try:
            status, data, _ = await self._call(
                "PATCH", endpoint, "/v1/peers", timeout_s * rounds + 2, body, pod_uid=pod_uid
            )
        except EndpointError as exc:
            return dict.fromkeys(keys, CallResult(False, 0, f"endpoint refused: {exc}"))
        except (TokenError, SignatureError, IdentityMismatch) as exc:
            return dict.fromkeys(keys, CallResult(False, 0, str(exc)[:300]))
        except (WireError, TimeoutError, OSError) as exc:
            failed = CallResult(False, 0, f"{type(exc).__name__}: {exc}"[:300])
            return dict.fromkeys(keys, failed)
        if status != 200:
            failed = CallResult(False, status, _error_message(data))
            return dict.fromkeys(keys, failed)
        try:
            answer = msgspec.json.decode(data, type=_ChangesView)
        except msgspec.DecodeError as exc:
            return dict.fromkeys(keys, CallResult(False, 502, f"bad batch answer: {exc}"))
        out: dict[tuple[str, str], CallResult] = {}
        succeeded: dict[str, CallResult] = {}  # one (frozen) result per outcome, shared
        for item in answer.results:
            if item.status == 200:
                res = succeeded.get(item.result)
                if res is None:
                    res = succeeded[item.result] = CallResult(True, 200, "", item.result)
            else:
                res = CallResult(False, item.status, f"{item.error}: {item.message}", item.result)
            out[(item.op, item.engine_id)] = res
        if any(key not in out for key in keys):
            left_out = CallResult(False, 502, "the worker's answer left it out")
            for key in keys:  # an item the worker did not answer has failed
                out.setdefault(key, left_out)
        return out

    async def set_idle_ttl(
        self, endpoint: str, idle_ttl_s: float, timeout_s: float, *, pod_uid: str = ""
    ) -> CallResult:
        """Sets the worker's idle-TTL backstop (`PUT /v1/settings`); ok once the worker
        answers that it holds `idle_ttl_s`."""
        body = msgspec.json.encode(WorkerSettings(idle_ttl_s=idle_ttl_s))
        try:
            status, data, _ = await self._call(
                "PUT", endpoint, "/v1/settings", timeout_s, body, pod_uid=pod_uid
            )
        except EndpointError as exc:
            return CallResult(False, 0, f"endpoint refused: {exc}")
        except (TokenError, SignatureError, IdentityMismatch) as exc:
            return CallResult(False, 0, str(exc)[:300])
        except (WireError, TimeoutError, OSError) as exc:
            return CallResult(False, 0, f"{type(exc).__name__}: {exc}"[:300])
        if status != 200:
            return CallResult(False, status, _error_message(data))
        try:
            answer = msgspec.json.decode(data, type=_SettingsView)
        except msgspec.DecodeError as exc:
            return CallResult(False, 502, f"bad settings answer: {exc}")
        if answer.idle_ttl_s != idle_ttl_s:
            return CallResult(False, 502, f"the worker holds idle_ttl_s {answer.idle_ttl_s}")
        return CallResult(True, status, "")


def _error_message(data: bytes) -> str:
    try:
        err = msgspec.json.decode(data, type=_ErrorView)
        return f"{err.error}: {err.message}"
    except msgspec.DecodeError:
        return data[:300].decode(errors="replace")
