"""Signed calls: how a worker knows a call comes from the operator (or another trusted
caller) without holding anything that could make such a call, and how a peer fetches an
engine's metadata with a ticket only the operator can mint.

Owns the key files, the per-process engine key, the per-engine call keys, the request
signatures and the tickets:

- A *caller* (the operator; the drill's router as a `client`) holds an EC P-256 private key
  (a mounted Secret: one PEM key, or during a rotation the new one then the old one). An
  engine holds only the caller's public key (a PEM public key or certificate per line of
  rotation), which cannot sign anything.
- Each engine process makes an EC P-256 key pair at start (`EngineKey`; a restart is a new
  key, as it is a new incarnation). Its public half, its pod's uid and its incarnation are
  the *challenge* (`WWW-Authenticate: KVTopo-Sig ...`) of every 401 it answers.
- Caller and engine derive the same *call key* by ECDH of one's private key with the other's
  public key, stretched by HKDF over the caller's role and key id, the engine's public key and
  its pod uid (`call_key`). Only the holder of the caller's private key and that engine
  process can compute it.
- A call carries `Authorization: KVTopo-Sig role=..,kid=..,ts=..,nonce=..,mac=..`: an
  HMAC-SHA256 with the call key over the role, method, path and query, the endpoint dialled,
  the time, a nonce and the body's hash. The engine checks its own endpoint, a 60 s time
  window, and that the nonce is new. So a call the operator made to one pod opens nothing
  elsewhere: another engine has another key, pod uid and endpoint, and this one has seen the
  nonce. The operator signs only for an engine whose challenge names the uid of the pod the
  operator dialled (`CallerKey.authorization`), so nothing an endpoint claims earns a
  signature for another pod.
- A *ticket* lets engine A fetch engine B's metadata: a key the operator derives from B's
  call key and A's engine id and incarnation (`CallerKey.ticket`), handed to A in the peer
  add. A signs the fetch with it (`KVTopo-Ticket`, the same fields as a call); B derives the
  same key from its own call key. No engine can mint a ticket, and one opens only B's
  metadata, only for that incarnation of A.

Rotation: the engine answers to every key in its public key file (current and previous) and
lists their key ids in its challenge; the caller signs with the first of its keys the
engine lists, so while kubelet updates the files pod by pod, every pair of versions still
agrees. Engines verify tickets under every key they know, too.

Pure (cryptography and the standard library): used by the worker's control API (`agent`),
its traffic routes (`traffic`), the operator's worker client, the drill and the tests.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Literal, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtopo_worker.credentials import MAX_NONCES_KEPT, NonceStore, TokenError

SCHEME = "KVTopo-Sig"
TICKET_SCHEME = "KVTopo-Ticket"
ROLES = ("operator", "client")
SIGNATURE_WINDOW_S = 60.0  # how far a signature's time may be from the receiver's clock
MAX_KEY_FILE_BYTES = 64 << 10
MAX_HEADER_FIELD = 512
_SALT = b"kvtopo call key v1"
_CURVE = ec.SECP256R1()


OPEN_PATHS = frozenset({"/healthz", "/metrics"})
PEER_PATHS = frozenset({"/v1/metadata", "/v1/introductions"})
ADMIN_PATHS = frozenset({"/v1/state", "/v1/peers", "/v1/settings"})


def route_kind(path: str) -> Literal["open", "peer", "admin", "client"]:
    """Whose credential a control API path needs: nobody's (`open`), a peer's (`peer`: a
    ticket the operator minted, or the peer token where lazy handshakes are on), the
    operator's (`admin`: a call signed with its key) or a client's (`client`: the traffic
    routes, a bearer client token)."""
    if path in OPEN_PATHS:
        return "open"
    if path in PEER_PATHS:
        return "peer"
    if path in ADMIN_PATHS or path.startswith("/v1/peers/"):
        return "admin"
    return "client"


class KeyFileError(TokenError):
    """A key file that gives no usable key (missing, unreadable, empty, not P-256); says
    which file and what to do. A TokenError, so every path that refuses a bad credential
    refuses a bad key file the same way."""


class SignatureError(ValueError):
    """A challenge or header that cannot be used (malformed, another pod's)."""


def key_id(public: ec.EllipticCurvePublicKey) -> str:
    """A public key's id: the first 8 bytes (hex) of the SHA-256 of its DER encoding."""
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()[:16]


def _raw(public: ec.EllipticCurvePublicKey) -> bytes:
    return public.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _read_pem(path: Path, what: str) -> list[bytes]:
    """The PEM blocks of a key file, in order (at most two: current, previous)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(
            f"cannot read the {what} file {path}: {exc.strerror}; mount the kvtopo "
            "operator key Secret (or, on engines, its public key) there or pass its path"
        ) from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"the {what} file {path} exceeds {MAX_KEY_FILE_BYTES} bytes")
    blocks: list[bytes] = []
    rest = raw
    while b"-----BEGIN " in rest:
        start = rest.index(b"-----BEGIN ")
        end = rest.find(b"-----END ", start)
        if end < 0:
            break
        close = rest.find(b"-----", end + 9)
        if close < 0:
            break
        blocks.append(rest[start : close + 5])
        rest = rest[close + 5 :]
    if not blocks:
        raise KeyFileError(f"the {what} file {path} holds no PEM block; an empty key is refused")
    if len(blocks) > 2:
        raise KeyFileError(
            f"the {what} file {path} holds {len(blocks)} PEM blocks; it holds the current key "
            "and, during a rotation, the previous one after it"
        )
    return blocks


def load_public_keys(path: str | Path) -> list[ec.EllipticCurvePublicKey]:
    """The P-256 public keys of a file (PEM `PUBLIC KEY` or `CERTIFICATE` blocks: the chart
    ships a self-signed certificate, as Helm can derive no bare public key), current first.
    Raises KeyFileError naming the file."""
    out: list[ec.EllipticCurvePublicKey] = []
    for block in _read_pem(Path(path), "public key"):
        try:
            key: object
            if block.startswith(b"-----BEGIN CERTIFICATE-----"):
                key = x509.load_pem_x509_certificate(block).public_key()
            else:
                key = serialization.load_pem_public_key(block)
        except ValueError as exc:
            raise KeyFileError(f"the public key file {path} holds a bad block: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != _CURVE.name:
            raise KeyFileError(f"the public key file {path} holds a key that is not EC P-256")
        out.append(key)
    return out


def load_private_keys(path: str | Path) -> list[ec.EllipticCurvePrivateKey]:
    """The P-256 private keys of a file (PEM, unencrypted), current first. Raises
    KeyFileError naming the file."""
    out: list[ec.EllipticCurvePrivateKey] = []
    for block in _read_pem(Path(path), "private key"):
        try:
            key = serialization.load_pem_private_key(block, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"the private key file {path} holds a bad block: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != _CURVE.name:
            raise KeyFileError(f"the private key file {path} holds a key that is not EC P-256")
        out.append(key)
    return out


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(_CURVE)


def private_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def public_pem(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> str:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


K = TypeVar("K")


class _Watched(Generic[K]):
    """A key file re-read when its stat (mtime, size, inode) changes; a bad file fails every
    use until it is good again (never an earlier key). The stat is taken at most once per
    `recheck_s` seconds of `clock` (0: at every use), unless `fresh` asks for it."""

    def __init__(
        self,
        path: Path,
        load: Callable[[Path], list[K]],
        recheck_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._load = load
        self._recheck_s = recheck_s
        self._clock = clock
        self._checked = -math.inf
        self._stat: tuple[int, int, int] | None = None
        self._keys: list[K] = []
        self.keys()

    def keys(self, *, fresh: bool = False) -> list[K]:
        now = self._clock() if self._recheck_s > 0 else 0.0
        if not fresh and now - self._checked < self._recheck_s:
            return self._keys
        self._checked = -math.inf  # until the file is known good: a bad one fails each use
        try:
            st = self.path.stat()
        except OSError as exc:
            raise KeyFileError(
                f"cannot read the key file {self.path}: {exc.strerror}; mount the kvtopo "
                "operator key Secret (or, on engines, its public key) there or pass its path"
            ) from None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stat:
            self._keys = self._load(self.path)
            self._stat = stamp
        self._checked = now
        return self._keys


def _identified(keys: Iterable[K], kid: Callable[[K], str]) -> list[tuple[str, K]]:
    """[(kid, key)] of keys as loaded: a key's id is a DER encoding and a SHA-256, too
    dear to compute on every call an engine checks or the operator signs."""
    return [(kid(k), k) for k in keys]


def _private_id(key: ec.EllipticCurvePrivateKey) -> str:
    return key_id(key.public_key())


class PublicKeys:
    """The public keys an engine trusts for one caller role: from a file (re-read when it
    changes) or fixed. `[(kid, key)]`, current first."""

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        keys: Sequence[ec.EllipticCurvePublicKey] | None = None,
    ) -> None:
        if (path is None) == (keys is None):
            raise ValueError("give exactly one of a key file path or keys")
        self.path = Path(path) if path is not None else None
        self._file = (
            _Watched(self.path, lambda p: _identified(load_public_keys(p), key_id))
            if self.path is not None
            else None
        )
        self._fixed = _identified(keys or [], key_id)
        if self._file is None and not self._fixed:
            raise KeyFileError("no public key given")

    def current(self) -> list[tuple[str, ec.EllipticCurvePublicKey]]:
        """[(kid, key)], current first; KeyFileError while the file is bad. The ids are
        computed when the keys are loaded (an engine checks every signed call against
        them), not on every call."""
        return list(self._file.keys() if self._file is not None else self._fixed)


class PrivateKeys:
    """A caller's private keys: from a file (re-read when it changes) or fixed, current
    first.

    `recheck_s`: the file's stat is taken at most this often (0: at every call signed).
    The operator signs tens of thousands of calls a minute in a rollout, and a stat each
    was 7% of its event loop at 64 x 2,000; a caller that meets an engine listing none of
    its key ids looks at once (`CallerKey`), so a rotation still never breaks a pair."""

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        keys: Sequence[ec.EllipticCurvePrivateKey] | None = None,
        recheck_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (path is None) == (keys is None):
            raise ValueError("give exactly one of a key file path or keys")
        self.path = Path(path) if path is not None else None
        self._file = (
            _Watched(
                self.path,
                lambda p: _identified(load_private_keys(p), _private_id),
                recheck_s,
                clock,
            )
            if self.path is not None
            else None
        )
        self._fixed = _identified(keys or [], _private_id)
        if self._file is None and not self._fixed:
            raise KeyFileError("no private key given")

    def current(self, *, fresh: bool = False) -> list[tuple[str, ec.EllipticCurvePrivateKey]]:
        """[(kid, key)], current first (the ids computed when the keys were loaded);
        `fresh`: the file looked at now, whenever it was last."""
        return list(self._file.keys(fresh=fresh) if self._file is not None else self._fixed)


def call_key(shared: bytes, role: str, kid: str, engine_public: bytes, pod_uid: str) -> bytes:
    """The call key of (caller key `kid` in `role`, engine key, pod uid) from their ECDH."""
    info = b"\x00".join([role.encode(), kid.encode(), engine_public, pod_uid.encode()])
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(shared)


def _ticket_text(fetcher_engine: str, fetcher_incarnation: str) -> bytes:
    return b"\x00".join(
        [b"kvtopo-ticket-v1", fetcher_engine.encode(), fetcher_incarnation.encode()]
    )


def ticket_key(key: bytes, fetcher_engine: str, fetcher_incarnation: str) -> bytes:
    """The ticket for `fetcher_engine` (that incarnation), from the fetched engine's call key."""
    return hmac.new(key, _ticket_text(fetcher_engine, fetcher_incarnation), hashlib.sha256).digest()


_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


class _Pads:
    """HMAC-SHA256 under one call key with the key's two pads hashed once (RFC 2104): the
    operator mints a ticket per peer add, tens of thousands in a rollout's surge round from
    a few thousand call keys, and `hmac.new` hashes both pads every time."""

    __slots__ = ("inner", "outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:  # RFC 2104: a key longer than the block is hashed first
            key = hashlib.sha256(key).digest()
        block = key.ljust(64, b"\x00")  # call keys are 32 bytes, under SHA-256's block
        self.inner = hashlib.sha256(block.translate(_IPAD))
        self.outer = hashlib.sha256(block.translate(_OPAD))

    def mac(self, text: bytes) -> bytes:
        inner = self.inner.copy()
        inner.update(text)
        outer = self.outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def _mac(
    key: bytes,
    scheme: str,
    role: str,
    method: str,
    path: str,
    target: str,
    body: bytes,
    ts: int,
    nonce: str,
) -> str:
    text = "\n".join(
        [
            scheme,
            role,
            method.upper(),
            path,
            target,
            str(ts),
            nonce,
            hashlib.sha256(body).hexdigest(),
        ]
    )
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _fields(header: str, scheme: str) -> dict[str, str] | None:
    if not header.startswith(scheme + " ") or len(header) > 4 * MAX_HEADER_FIELD:
        return None
    out: dict[str, str] = {}
    for item in header[len(scheme) + 1 :].split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or len(value) > MAX_HEADER_FIELD:
            return None
        out[key] = value
    return out


@dataclass(frozen=True)
class Challenge:
    """What an engine says of itself in a 401: its role's caller key ids, its public key,
    its pod uid and its incarnation, and the time on its clock (epoch seconds; None from
    an engine that predates it). A caller signs against the engine's clock, not its own
    (`CallerKey.authorization`'s `now`): a caller whose clock is off by more than the
    signature window is still understood. The time is not part of the challenge's identity."""

    role: str
    engine_key: bytes  # X9.62 uncompressed point
    pod_uid: str
    incarnation: str
    kids: tuple[str, ...]
    now: int | None = field(default=None, compare=False)

    def header(self) -> str:
        clock = f",now={self.now}" if self.now is not None else ""
        return (
            f"{SCHEME} role={self.role},key={_b64(self.engine_key)},"
            f"uid={_b64(self.pod_uid.encode())},incarnation={_b64(self.incarnation.encode())},"
            f"kids={'.'.join(self.kids)}{clock}"
        )


def parse_challenge(header: str) -> Challenge | None:
    """The challenge of a `WWW-Authenticate` header; None when there is none or it is bad."""
    f = _fields(header, SCHEME)
    if f is None:
        return None
    try:
        key = _unb64(f["key"])
        uid = _unb64(f["uid"]).decode()
        inc = _unb64(f["incarnation"]).decode()
        kids = tuple(k for k in f["kids"].split(".") if k)
        role = f["role"]
        now = int(f["now"]) if "now" in f else None
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
    if len(key) != 65 or role not in ROLES or len(kids) > 2 or any(len(k) != 16 for k in kids):
        return None
    if len(uid) > 256 or len(inc) > 256:
        return None
    if now is not None and not 0 <= now < 1 << 40:
        now = None
    return Challenge(role, key, uid, inc, kids, now)


def engine_key_id(public: bytes) -> str:
    """The id of an engine's public key, as a signature names the key it was made for."""
    return hashlib.sha256(public).hexdigest()[:16]


class EngineKey:
    """One engine process's key pair (new at every start) and the call keys it derives."""

    def __init__(self) -> None:
        self._private = ec.generate_private_key(_CURVE)
        self.public = _raw(self._private.public_key())
        self.id = engine_key_id(self.public)

    def shared(self, caller: ec.EllipticCurvePublicKey) -> bytes:
        return self._private.exchange(ec.ECDH(), caller)


class CallGuard:
    """The engine's side: checks calls signed for one of its roles and tickets of peers,
    against the keys it trusts now, the endpoints it answers at, the time window and the
    nonces it has seen (bounded memory)."""

    def __init__(
        self,
        callers: dict[str, PublicKeys],
        *,
        pod_uid: str = "",
        incarnation: str = "",
        engine_key: EngineKey | None = None,
        clock: Callable[[], float] = time.time,
        nonce_capacity: int = MAX_NONCES_KEPT,
    ) -> None:
        """`nonce_capacity`: how many nonces each kind of signed request (each caller
        role's calls, the tickets) keeps within twice the time window; a kind whose store is
        full is refused (`credentials.NonceStoreFull`, 503), never another's forgotten."""
        unknown = set(callers) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown caller roles {sorted(unknown)}")
        self.callers = callers
        self.pod_uid = pod_uid
        self.incarnation = incarnation
        self.key = engine_key or EngineKey()
        self._clock = clock
        self._keys: dict[tuple[str, str], bytes] = {}  # (role, kid) -> call key
        # One nonce store per kind of signed request (scheme, role): a flood of tickets
        # cannot push an operator call's nonce out and reopen its replay.
        self._nonces = {
            (scheme, role): NonceStore(2 * SIGNATURE_WINDOW_S, nonce_capacity, f"{role} {kind}")
            for scheme, role, kind in (
                *((SCHEME, r, "call") for r in ROLES),
                (TICKET_SCHEME, "peer", "ticket"),
            )
        }

    def _role_keys(self, role: str) -> list[tuple[str, bytes]]:
        """[(kid, call key)] for `role`, current first; KeyFileError while its file is bad."""
        source = self.callers.get(role)
        if source is None:
            return []
        out = []
        for kid, public in source.current():
            k = self._keys.get((role, kid))
            if k is None:
                if len(self._keys) > 16:
                    self._keys.clear()
                k = call_key(self.key.shared(public), role, kid, self.key.public, self.pod_uid)
                self._keys[(role, kid)] = k
            out.append((kid, k))
        return out

    def stale(self, header: str) -> bool:
        """Whether `header` carries no signature, or one made for another engine key (the
        caller holds the challenge of this endpoint's previous process): to be answered
        with our challenge, not counted as a bad message."""
        if not header:
            return True
        f = _fields(header, SCHEME)
        if f is None or not all(f.get(k) for k in ("role", "kid", "ek", "ts", "nonce", "mac")):
            return False  # malformed: a bad message, counted
        return len(f["ek"]) == 16 and len(f["mac"]) == 64 and f["ek"] != self.key.id

    def unknown_key(self, role: str, header: str) -> bool:
        """Whether `header` is signed with a caller key this engine does not know (a key
        file not rotated yet, or rotated wrong): answered with our challenge, which lists
        the keys we know; counted apart from bad signatures."""
        f = _fields(header, SCHEME)
        try:
            known = {kid for kid, _ in self._role_keys(role)}
        except TokenError:
            return False
        return f is not None and f.get("kid") not in known

    def challenge(self, role: str) -> str:
        """The `WWW-Authenticate` value of a 401 on a route of `role`."""
        try:
            kids = tuple(kid for kid, _ in self._role_keys(role))
        except TokenError:
            kids = ()
        now = int(self._clock())
        return Challenge(role, self.key.public, self.pod_uid, self.incarnation, kids, now).header()

    def skew(self, header: str) -> float | None:
        """How far the time a signature carries is from this engine's clock (seconds; its
        time minus ours) when that is beyond the signature window, so a 401 can say the
        caller's clock is off; None otherwise (or when `header` has no time)."""
        f = _fields(header, SCHEME) or _fields(header, TICKET_SCHEME)
        try:
            ts = int((f or {})["ts"])
        except (KeyError, ValueError):
            return None
        off = ts - self._clock()
        return off if abs(off) > SIGNATURE_WINDOW_S else None

    def accepts(
        self,
        role: str,
        header: str,
        method: str,
        path: str,
        targets: Sequence[str],
        body: bytes,
    ) -> str | None:
        """ "current" or "previous" (the caller key that signed it) when `header` is a valid,
        fresh signature of this request by a caller of `role`, made for one of `targets`;
        None otherwise. KeyFileError while the role's key file is bad."""
        keys = self._role_keys(role)
        f = _fields(header, SCHEME)
        if f is None or f.get("role") != role:
            return None
        return self._check(f, keys, SCHEME, role, method, path, targets, body)

    def accepts_ticket(
        self,
        header: str,
        fetcher_engine: str,
        fetcher_incarnation: str,
        method: str,
        path: str,
        targets: Sequence[str],
        body: bytes,
    ) -> str | None:
        """As `accepts`, for a peer's request signed with the ticket the operator minted for
        that engine and incarnation to call this engine."""
        keys = [
            (kid, ticket_key(k, fetcher_engine, fetcher_incarnation))
            for kid, k in self._role_keys("operator")
        ]
        f = _fields(header, TICKET_SCHEME)
        if f is None:
            return None
        return self._check(f, keys, TICKET_SCHEME, "peer", method, path, targets, body)

    def _check(
        self,
        f: dict[str, str],
        keys: list[tuple[str, bytes]],
        scheme: str,
        role: str,
        method: str,
        path: str,
        targets: Sequence[str],
        body: bytes,
    ) -> str | None:
        try:
            ts = int(f["ts"])
            nonce, mac, kid = f["nonce"], f["mac"], f["kid"]
        except (KeyError, ValueError):
            return None
        if not 8 <= len(nonce) <= 64 or len(mac) != 64:
            return None
        now = self._clock()
        if abs(now - ts) > SIGNATURE_WINDOW_S:
            return None
        for i, (known, key) in enumerate(keys):
            if known != kid:
                continue
            for target in targets:
                expected = _mac(key, scheme, role, method, path, target, body, ts, nonce)
                if hmac.compare_digest(expected, mac):
                    if not self._nonces[(scheme, role)].fresh(nonce, now):
                        return None
                    return "current" if i == 0 else "previous"
        return None


class CallerKey:
    """The caller's side (the operator, or a client of the traffic routes): signs calls to
    engines whose challenge it has, and (the operator) mints tickets."""

    MAX_KEYS_KEPT = 65_536

    def __init__(self, role: str, keys: PrivateKeys) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown caller role {role!r}")
        self.role = role
        self.keys = keys
        # (kid, engine key, pod uid) -> (call key, its HMAC pads)
        self._derived: OrderedDict[tuple[str, bytes, str], tuple[bytes, _Pads]] = OrderedDict()

    def _key(self, challenge: Challenge) -> tuple[str, bytes]:
        """(kid, call key) for the engine of `challenge`: the first of our keys it lists,
        else our current one. KeyFileError while our key file is bad."""
        kid, (key, _) = self._entry(challenge, self._mine(challenge, self.keys.current()))
        return kid, key

    def _mine(
        self, challenge: Challenge, held: list[tuple[str, ec.EllipticCurvePrivateKey]]
    ) -> list[tuple[str, ec.EllipticCurvePrivateKey]]:
        """Our keys (`held`, as last looked at), or looked at afresh when the engine lists
        none of them (our key file may have been rotated since: `PrivateKeys.recheck_s`)."""
        if any(kid in challenge.kids for kid, _ in held):
            return held
        return self.keys.current(fresh=True)

    def _entry(
        self, challenge: Challenge, mine: list[tuple[str, ec.EllipticCurvePrivateKey]]
    ) -> tuple[str, tuple[bytes, _Pads]]:
        """`_key` with our keys (`mine`) given, and the call key's HMAC pads."""
        kid, private = mine[0]
        if kid not in challenge.kids:
            kid, private = next(((k, p) for k, p in mine if k in challenge.kids), mine[0])
        cache = (kid, challenge.engine_key, challenge.pod_uid)
        found = self._derived.get(cache)
        if found is not None:
            self._derived.move_to_end(cache)
            return kid, found
        try:
            peer = ec.EllipticCurvePublicKey.from_encoded_point(_CURVE, challenge.engine_key)
            shared = private.exchange(ec.ECDH(), peer)
        except ValueError as exc:
            raise SignatureError(f"the engine's key cannot be used: {exc}") from None
        key = call_key(shared, self.role, kid, challenge.engine_key, challenge.pod_uid)
        entry = self._derived[cache] = (key, _Pads(key))
        if len(self._derived) > self.MAX_KEYS_KEPT:
            self._derived.popitem(last=False)
        return kid, entry

    def authorization(
        self,
        challenge: Challenge,
        method: str,
        path: str,
        target: str,
        body: bytes = b"",
        *,
        pod_uid: str | None = None,
        now: float | None = None,
    ) -> str:
        """The `Authorization` header of one call to the engine of `challenge` at `target`
        (ip:port; `path` with its query). `pod_uid`, when given, is the pod the caller
        dialled: a challenge naming another pod raises SignatureError (no signature goes
        to an endpoint that is not the pod it claims to be)."""
        if pod_uid is not None and challenge.pod_uid != pod_uid:
            raise SignatureError(
                f"the engine at {target} says it runs in pod uid "
                f"{challenge.pod_uid or '(none)'!r}, the pod's is {pod_uid!r}; no signature sent"
            )
        if challenge.role != self.role:
            raise SignatureError(f"the engine at {target} asks for a {challenge.role} credential")
        kid, key = self._key(challenge)
        ts = int(time.time() if now is None else now)
        nonce = secrets.token_hex(16)
        mac = _mac(key, SCHEME, self.role, method, path, target, body, ts, nonce)
        ek = engine_key_id(challenge.engine_key)
        return f"{SCHEME} role={self.role},kid={kid},ek={ek},ts={ts},nonce={nonce},mac={mac}"

    def ticket(self, target: Challenge, fetcher_engine: str, fetcher_incarnation: str) -> str:
        """The ticket ("kid:hex") that lets that incarnation of `fetcher_engine` call the
        engine of `target` (its metadata); only an operator key mints one."""
        return self.tickets([target], fetcher_engine, fetcher_incarnation)[0]

    def tickets(
        self, targets: Sequence[Challenge], fetcher_engine: str, fetcher_incarnation: str
    ) -> list[str]:
        """`ticket` for each of `targets`, for one fetcher: one peer-add batch's (its keys
        read once, each call key's pads hashed once for its life in the cache). Raises
        SignatureError for a target whose key cannot be used: mint those one by one."""
        if self.role != "operator":
            raise SignatureError("only the operator mints tickets")
        mine = self.keys.current()
        text = _ticket_text(fetcher_engine, fetcher_incarnation)
        out = []
        for target in targets:
            mine = self._mine(target, mine)
            kid, (_, pads) = self._entry(target, mine)
            out.append(f"{kid}:{pads.mac(text).hex()}")
        return out


def ticket_authorization(
    ticket: str,
    method: str,
    path: str,
    target: str,
    body: bytes = b"",
    *,
    now: float | None = None,
) -> str:
    """The `Authorization` header of a peer request signed with `ticket` (the ticket itself
    is not in it). SignatureError for a malformed ticket."""
    kid, sep, hexkey = ticket.partition(":")
    try:
        key = bytes.fromhex(hexkey)
    except ValueError:
        key = b""
    if not sep or len(kid) != 16 or len(key) != 32:
        raise SignatureError("a ticket is '<kid>:<64 hex digits>'")
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_hex(16)
    mac = _mac(key, TICKET_SCHEME, "peer", method, path, target, body, ts, nonce)
    return f"{TICKET_SCHEME} kid={kid},ts={ts},nonce={nonce},mac={mac}"


def header_value(text: str) -> str:
    """`text` as a header value (base64url of its UTF-8): ids may hold any character."""
    return _b64(text.encode())


def header_text(value: str) -> str:
    """The text of a `header_value`; "" when it is not one (or longer than an id may be)."""
    if len(value) > 2 * MAX_HEADER_FIELD:
        return ""
    try:
        return _unb64(value).decode()
    except (ValueError, UnicodeDecodeError):
        return ""


def valid_ticket(ticket: str) -> bool:
    kid, sep, hexkey = ticket.partition(":")
    return (
        bool(sep)
        and len(kid) == 16
        and len(hexkey) == 64
        and all(c in "0123456789abcdef" for c in hexkey)
    )
