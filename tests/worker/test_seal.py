"""Notification seals and the peer token's signed requests (lazy handshakes only): what a
forger, a replayer or a spy endpoint can and cannot do with what it sees."""

from __future__ import annotations

import pytest

from kvtopo_worker.credentials import PeerRequestGuard, TokenSource, sign_peer_request
from kvtopo_worker.seal import TAG_LEN, NotifKey, SealError


def _pair() -> tuple[object, object]:
    a, b = NotifKey(), NotifKey()
    return a.pair(b.public, "agent-a", "agent-b"), b.pair(a.public, "agent-b", "agent-a")


def test_a_pair_opens_what_the_other_side_sealed_and_nothing_altered() -> None:
    ab, ba = _pair()
    sealed = ab.seal(b"PUSH_DONE:payload")  # type: ignore[attr-defined]
    assert len(sealed) == len(b"PUSH_DONE:payload") + TAG_LEN
    assert ba.open(sealed) == b"PUSH_DONE:payload"  # type: ignore[attr-defined]
    assert ab.open(ba.seal(b"x")) == b"x"  # type: ignore[attr-defined]
    tampered = bytearray(sealed)
    tampered[3] ^= 1
    assert ba.open(bytes(tampered)) is None  # type: ignore[attr-defined]
    assert ba.open(sealed[:-1] + bytes([sealed[-1] ^ 1])) is None  # type: ignore[attr-defined]
    assert ba.open(b"short") is None  # type: ignore[attr-defined]


def test_a_seal_counts_in_one_direction_only() -> None:
    ab, _ = _pair()
    # What a sealed for b, reflected back to a, does not open as b's.
    assert ab.open(ab.seal(b"PUSH_FAIL:x")) is None  # type: ignore[attr-defined]


def test_another_process_under_the_same_agent_name_cannot_forge() -> None:
    a, b, forger = NotifKey(), NotifKey(), NotifKey()
    receiver = b.pair(a.public, "agent-b", "agent-a")
    # The forger knows both public keys and both names, not a's private key.
    forged = forger.pair(b.public, "agent-a", "agent-b").seal(b"PUSH_DONE:r1")
    assert receiver.open(forged) is None
    # Nor does a process restarted under the same name (a new key) open the old one's.
    restarted = NotifKey().pair(b.public, "agent-a", "agent-b")
    assert receiver.open(restarted.seal(b"PUSH_DONE:r1")) is None


@pytest.mark.parametrize("key", [b"", b"\x01" * 31, b"\x01" * 33, b"\x00" * 32])
def test_an_unusable_public_key_is_refused(key: bytes) -> None:
    with pytest.raises(SealError):
        NotifKey().pair(key, "a", "b")


def _guard(token: str = "peer-token", previous: str | None = None) -> PeerRequestGuard:
    return PeerRequestGuard(TokenSource(value=token, previous=previous), clock=lambda: 1000.0)


def test_a_signed_request_carries_no_token_and_holds_only_where_it_was_meant_for() -> None:
    header = sign_peer_request(
        "peer-token", "POST", "/v1/introductions", "10.0.0.2:8975", b"b", now=1000
    )
    assert "peer-token" not in header
    guard = _guard()
    # A spy at another endpoint that relays it to the real peer gets nothing.
    assert guard.accepts(header, "POST", "/v1/introductions", ["10.0.0.3:8975"], b"b") is None
    assert guard.accepts(header, "POST", "/v1/introductions", ["10.0.0.2:8975"], b"b") == "current"


def test_a_signature_is_good_once_within_its_window_for_its_request() -> None:
    guard = _guard()
    args = ("GET", "/v1/metadata?rank=0", ["10.0.0.2:8975"], b"")
    header = sign_peer_request(
        "peer-token", "GET", "/v1/metadata?rank=0", "10.0.0.2:8975", now=1000
    )
    assert guard.accepts(header, *args) == "current"
    assert guard.accepts(header, *args) is None  # replayed
    stale = sign_peer_request("peer-token", "GET", "/v1/metadata?rank=0", "10.0.0.2:8975", now=900)
    assert guard.accepts(stale, *args) is None
    other = sign_peer_request("peer-token", "GET", "/v1/metadata?rank=1", "10.0.0.2:8975", now=1000)
    assert guard.accepts(other, *args) is None  # another path
    body = sign_peer_request(
        "peer-token", "GET", "/v1/metadata?rank=0", "10.0.0.2:8975", b"x", now=1000
    )
    assert guard.accepts(body, *args) is None  # another body
    wrong = sign_peer_request(
        "other-token", "GET", "/v1/metadata?rank=0", "10.0.0.2:8975", now=1000
    )
    assert guard.accepts(wrong, *args) is None
    assert guard.accepts("Bearer peer-token", *args) is None


def test_a_rotation_accepts_a_signature_made_with_the_previous_token() -> None:
    guard = _guard("new-token", previous="old-token")
    header = sign_peer_request("old-token", "GET", "/v1/metadata", "10.0.0.2:1", now=1000)
    assert guard.accepts(header, "GET", "/v1/metadata", ["10.0.0.2:1"], b"") == "previous"
