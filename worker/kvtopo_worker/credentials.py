"""The credentials of the worker control API, as both sides read them.

Owns reading a credential from its file (a mounted Secret) and the one rule for what counts
as one: the file's first non-blank line, stripped of surrounding whitespace, is the current
token; an optional second line is the previous token. An empty, whitespace-only, missing or
unreadable file is a `TokenError` naming the file, never an empty token: an empty token must
not authorise anything. A `TokenSource` re-reads its file only when the file's stat (mtime,
size, inode) changes, so a rotated Secret takes effect at the next call without a read per
request.

Rotation is overlap-safe because each side honours both lines: a receiver accepts the
current and the previous token (`TokenSource.accepts`), and a sender sends the current one
and, when that is refused (401), tries the previous one once (`TokenSource.candidates`). So
while kubelet updates the Secret's volume on different pods at different times, an updated
pod and one not yet updated still accept each other. There are two credentials: the
operator's (the admin routes: peers, state) and the peers' (a peer's metadata only).

Peers never send the peer credential itself: a request to a peer is signed with it
(`sign_peer_request`: an HMAC over the method, the path, the endpoint dialled, a timestamp,
a nonce and the body), so a peer that is not who the request was meant for learns nothing it
could use elsewhere (the signature names the endpoint it was made for, and each nonce is
taken once, `PeerRequestGuard`).

Used by the worker's control API (`agent`, which checks both and signs its requests to
peers), by the vLLM engine's traffic server (`traffic`: the receiving side's
`bearer_token` and `accepts`, as the control API uses them) and by the operator's worker
client (which sends the operator credential); imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

PEER_SCHEME = "KVTopo-Peer"
PEER_SIGNATURE_WINDOW_S = 60.0  # how far a signature's time may be from the receiver's
MAX_NONCES_KEPT = 100_000


class TokenError(ValueError):
    """The token file cannot give a token (missing, unreadable, empty); says which file."""


MAX_TOKEN_FILE_BYTES = 64 << 10


def read_credential(path: str | Path) -> tuple[str, str | None]:
    """(current, previous) from a credential file: its first non-blank line, and its second
    one when there is one (both stripped of surrounding whitespace).

    Raises TokenError, naming the file, when it cannot be read, holds no token, or holds
    more than two lines of tokens.
    """
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise TokenError(
            f"cannot read the worker token file {path}: {exc.strerror}; "
            "mount the kvtopo worker token Secret there or pass its path"
        ) from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise TokenError(f"the worker token file {path} exceeds {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenError(f"the worker token file {path} is not UTF-8 text") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise TokenError(f"the worker token file {path} is empty; an empty token is refused")
    if len(lines) > 2:
        raise TokenError(
            f"the worker token file {path} holds {len(lines)} lines; it holds the current "
            "token and, during a rotation, the previous one on a second line"
        )
    return lines[0], (lines[1] if len(lines) == 2 and lines[1] != lines[0] else None)


def read_token_file(path: str | Path) -> str:
    """The current token in `path` (see `read_credential`)."""
    return read_credential(path)[0]


def bearer_token(header: str) -> bytes:
    """The token an `Authorization` header carries as `Bearer <token>`, as bytes to give
    `TokenSource.accepts`; b"" for another scheme, no header, or header text that cannot be
    encoded (no token of ours looks like that). The one parser of the header on the
    receiving side."""
    if not header.startswith("Bearer "):
        return b""
    try:
        return header[7:].encode()
    except UnicodeError:
        return b""


def _same(given: bytes, token: str) -> bool:
    return hmac.compare_digest(given, token.encode())


class TokenSource:
    """A credential, from a file (re-read when it changes) or a fixed string.

    A file is read at construction, so a bad one fails at startup; after that `current()`
    raises TokenError for as long as the file is bad (it never falls back to an empty or an
    earlier token) and returns the new token once the file is good again.
    """

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        value: str | None = None,
        previous: str | None = None,
    ) -> None:
        if (path is None) == (value is None):
            raise ValueError("give exactly one of a token file path or a token value")
        self._path = Path(path) if path is not None else None
        self._stat: tuple[int, int, int] | None = None
        self._previous: str | None = None
        if value is not None:
            if not value.strip():
                raise TokenError("the worker token is empty; an empty token is refused")
            self._value = value.strip()
            self._previous = previous.strip() if previous and previous.strip() else None
        else:
            self._value = ""
            self._reload()

    @property
    def path(self) -> Path | None:
        """The token file, or None for a fixed token."""
        return self._path

    def _reload(self) -> None:
        assert self._path is not None
        try:
            st = self._path.stat()
        except OSError as exc:
            raise TokenError(
                f"cannot read the worker token file {self._path}: {exc.strerror}; "
                "mount the kvtopo worker token Secret there or pass its path"
            ) from None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._stat:
            # Remember the stat only once the file gave a token: a bad file fails every call.
            self._value, self._previous = read_credential(self._path)
            self._stat = key

    def current(self) -> str:
        """The token to send now (never empty); raises TokenError while the file is bad."""
        if self._path is not None:
            self._reload()
        return self._value

    def previous(self) -> str | None:
        """The previous token during a rotation (None otherwise); TokenError as `current`."""
        if self._path is not None:
            self._reload()
        return self._previous

    def candidates(self) -> list[str]:
        """What a sender tries, in order: the current token, then the previous one (sent
        only when the current one is refused)."""
        current = self.current()
        return [current] if self._previous is None else [current, self._previous]

    def accepts(self, given: bytes) -> str | None:
        """Which token `given` is ("current" or "previous"), compared in constant time;
        None when it is neither (or empty). TokenError while the file is bad."""
        current = self.current()
        if not given:
            return None
        if _same(given, current):
            return "current"
        if self._previous is not None and _same(given, self._previous):
            return "previous"
        return None


def _peer_mac(
    token: str, method: str, path: str, target: str, body: bytes, ts: int, nonce: str
) -> str:
    text = "\n".join(
        [
            "kvtopo-peer-v1",
            method.upper(),
            path,
            target,
            str(ts),
            nonce,
            hashlib.sha256(body).hexdigest(),
        ]
    )
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def sign_peer_request(
    token: str,
    method: str,
    path: str,
    target: str,
    body: bytes = b"",
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """The `Authorization` header of a request to a peer at `target` (ip:port), signed with
    the peer credential `token`; `path` includes the query string. The token is not in it."""
    ts = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(16)
    mac = _peer_mac(token, method, path, target, body, ts, nonce)
    return f"{PEER_SCHEME} ts={ts},nonce={nonce},mac={mac}"


class NonceStoreFull(TokenError):
    """The nonces of one kind of signed request fill their store, none of them expired: the
    request is refused (503) rather than one forgotten, which would let its request be
    replayed. A TokenError, so every path that refuses an unusable credential refuses
    this the same way."""


class NonceStore:
    """The nonces of one kind of signed request seen within `keep_s`, each taken once:
    bounded by `capacity`; full of unexpired entries it refuses (`NonceStoreFull`) instead
    of evicting. One store per kind (operator calls, tickets, peer requests): a flood of one
    kind cannot push another's nonce out."""

    def __init__(self, keep_s: float, capacity: int = MAX_NONCES_KEPT, kind: str = "") -> None:
        self.keep_s = keep_s
        self.capacity = capacity
        self.kind = kind
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def fresh(self, nonce: str, now: float) -> bool:
        """True (and kept) for a nonce not seen within `keep_s`; False for one seen;
        NonceStoreFull when there is no room without forgetting an unexpired one."""
        while self._seen and next(iter(self._seen.values())) < now - self.keep_s:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        if len(self._seen) >= self.capacity:
            raise NonceStoreFull(
                f"{self.capacity} {self.kind or 'signed'} requests within {self.keep_s:g} s: "
                "their nonces fill the store; refused until the oldest expire (retry shortly)"
            )
        self._seen[nonce] = now
        return True


PEER_PROOF_HEADER = "KVTopo-Peer-Proof"  # the answer's proof, on answers to signed requests


def peer_answer_proof(token: str, request_header: str, body: bytes) -> str:
    """What the answer to a signed peer request carries (`PEER_PROOF_HEADER`): an HMAC with
    the peer credential over the request's signature (which names the endpoint dialled, the
    time and a nonce) and the answer's body. It proves the answer comes from a holder of
    the credential at that endpoint, for that request: a stranger a request named cannot
    make one, and a relay cannot reuse one (the request's signature names the stranger's
    endpoint, which the engine relayed to refuses). "" for a header that is not a
    signature."""
    parsed = _parse_peer_header(request_header)
    if parsed is None:
        return ""
    text = "\n".join(["kvtopo-peer-answer-v1", parsed[2], hashlib.sha256(body).hexdigest()])
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def verify_peer_answer(token: str, request_header: str, body: bytes, proof: str) -> bool:
    """True when `proof` is `peer_answer_proof` of this answer to this request."""
    want = peer_answer_proof(token, request_header, body)
    return bool(want) and hmac.compare_digest(want, proof.strip())


def _parse_peer_header(header: str) -> tuple[int, str, str] | None:
    if not header.startswith(PEER_SCHEME + " "):
        return None
    fields: dict[str, str] = {}
    for item in header[len(PEER_SCHEME) + 1 :].split(","):
        key, _, value = item.strip().partition("=")
        fields[key] = value
    try:
        ts = int(fields["ts"])
        nonce, mac = fields["nonce"], fields["mac"]
    except (KeyError, ValueError):
        return None
    if not 8 <= len(nonce) <= 64 or len(mac) != 64:
        return None
    return ts, nonce, mac


class PeerRequestGuard:
    """The receiving side of signed peer requests: checks a signature against the peer
    credential's current and previous token, the endpoint this server answers at, the time
    window, and that its nonce was not seen before (bounded memory)."""

    def __init__(
        self,
        source: TokenSource,
        clock: Callable[[], float] = time.time,
        nonce_capacity: int = MAX_NONCES_KEPT,
    ) -> None:
        self.source = source
        self._clock = clock
        self._nonces = NonceStore(2 * PEER_SIGNATURE_WINDOW_S, nonce_capacity, "peer")

    def accepts(
        self, header: str, method: str, path: str, targets: Sequence[str], body: bytes
    ) -> str | None:
        """ "current" or "previous" (the token that signed it) when `header` is a valid,
        fresh signature of this request made for one of `targets`; None otherwise.
        TokenError while the credential file is bad."""
        parsed = _parse_peer_header(header)
        candidates = [("current", self.source.current())]
        previous = self.source.previous()
        if previous is not None:
            candidates.append(("previous", previous))
        if parsed is None:
            return None
        ts, nonce, mac = parsed
        now = self._clock()
        if abs(now - ts) > PEER_SIGNATURE_WINDOW_S:
            return None
        for which, token in candidates:
            for target in targets:
                expected = _peer_mac(token, method, path, target, body, ts, nonce)
                if hmac.compare_digest(expected, mac):
                    return which if self._fresh(nonce, now) else None
        return None

    def _fresh(self, nonce: str, now: float) -> bool:
        return self._nonces.fresh(nonce, now)
