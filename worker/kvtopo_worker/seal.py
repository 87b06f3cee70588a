"""Notification keys: every NIXL notification between two engines is sealed by its sender and
opened by its receiver with a key only that pair of processes can derive.

Owns the per-process key pair (`NotifKey`, X25519, new on every start, so a key names one
incarnation), the key of one pair of agents (`PairKey`: X25519 agreement of one agent's
private key with the other's public key, stretched by HKDF with both agent names), and the
seal itself: the payload followed by a 16-byte HMAC-SHA256 tag over the direction (sender and
receiver agent names) and the payload.

Why: NIXL tells a receiver the name a sender's agent *chose*; any process that can reach an
engine could pick a name. The public key travels in the engine's metadata, which the peer
fetched through an authenticated handshake (the operator's, or an introduction signed with
the peer credential), so a tag that opens proves the notification comes from the process
whose metadata was added under that agent name, in that direction. Holding the peer
credential lets nobody pose as another engine: the private key never leaves its process.
Pure: no NIXL, no torch; the transport seals and opens.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PUBLIC_KEY_LEN = 32
TAG_LEN = 16
_SALT = b"kvtopo notification seal v5"


class SealError(ValueError):
    """A peer's public key that cannot be used."""


class PairKey:
    """The key of one (local agent, remote agent) pair: seals what the local agent sends the
    remote one, opens what it receives from it."""

    def __init__(self, key: bytes, local_agent: str, remote_agent: str) -> None:
        self._out = hmac.new(key, _direction(local_agent, remote_agent), hashlib.sha256)
        self._in = hmac.new(key, _direction(remote_agent, local_agent), hashlib.sha256)

    def seal(self, payload: bytes) -> bytes:
        """`payload` with its tag appended (what the remote agent can open)."""
        mac = self._out.copy()
        mac.update(payload)
        return payload + mac.digest()[:TAG_LEN]

    def open(self, data: bytes) -> bytes | None:
        """The payload of `data` sealed by the remote agent for us; None when its tag does
        not verify (forged, altered, sealed for another pair or another direction)."""
        if len(data) < TAG_LEN:
            return None
        payload, tag = data[:-TAG_LEN], data[-TAG_LEN:]
        mac = self._in.copy()
        mac.update(payload)
        if not hmac.compare_digest(mac.digest()[:TAG_LEN], tag):
            return None
        return payload


def _direction(sender: str, receiver: str) -> bytes:
    s, r = sender.encode(), receiver.encode()
    return len(s).to_bytes(2, "big") + s + len(r).to_bytes(2, "big") + r


class NotifKey:
    """One engine process's notification key pair; the public half goes in its metadata."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def pair(self, peer_public: bytes, local_agent: str, remote_agent: str) -> PairKey:
        """The key shared with the agent whose metadata carried `peer_public`."""
        if len(peer_public) != PUBLIC_KEY_LEN:
            raise SealError(f"a notification key is {PUBLIC_KEY_LEN} bytes, not {len(peer_public)}")
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError as exc:  # e.g. a low-order point: an all-zero agreement
            raise SealError(f"unusable notification key: {exc}") from None
        names = sorted([local_agent, remote_agent])
        info = b"\x00".join(name.encode() for name in names)
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(shared)
        return PairKey(key, local_agent, remote_agent)
