"""Signed calls and tickets (`kvtopo_worker.signing`) as an engine checks them: a call the
operator signed for one engine opens that engine's route once, at the endpoint it was made
for, within its time window, and nothing else; a ticket opens one engine's metadata for one
fetcher; rotations overlap; key files load (public keys and certificates), fail naming the
file, and are re-read when they change. Pure: no server, an injected clock."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvtopo_worker.credentials import (
    PEER_SIGNATURE_WINDOW_S,
    NonceStoreFull,
    PeerRequestGuard,
    TokenError,
    TokenSource,
    sign_peer_request,
)
from kvtopo_worker.signing import (
    MAX_HEADER_FIELD,
    SCHEME,
    SIGNATURE_WINDOW_S,
    CallerKey,
    CallGuard,
    Challenge,
    KeyFileError,
    PrivateKeys,
    PublicKeys,
    SignatureError,
    key_id,
    load_private_keys,
    load_public_keys,
    new_private_key,
    parse_challenge,
    private_pem,
    public_pem,
    ticket_authorization,
    ticket_key,
    valid_ticket,
)

NOW = 1_800_000_000.0
A = "10.0.0.1:8975"  # engine A's endpoint
B = "10.0.0.2:8975"  # engine B's
OLD, NEW, OTHER = new_private_key(), new_private_key(), new_private_key()


def engine(
    *keys: ec.EllipticCurvePrivateKey,
    uid: str = "uid-a",
    incarnation: str = "inc-a",
    now: float = NOW,
    role: str = "operator",
) -> CallGuard:
    """An engine's guard trusting `keys` (public halves, current first) for `role`."""
    public = PublicKeys(keys=[k.public_key() for k in (keys or (OLD,))])
    return CallGuard({role: public}, pod_uid=uid, incarnation=incarnation, clock=lambda: now)


def operator(*keys: ec.EllipticCurvePrivateKey, role: str = "operator") -> CallerKey:
    return CallerKey(role, PrivateKeys(keys=list(keys or (OLD,))))


def challenge_of(guard: CallGuard, role: str = "operator") -> Challenge:
    found = parse_challenge(guard.challenge(role))
    assert found is not None
    return found


BODY = b'{"idle_ttl_s": 3}'
CALL = ("PUT", "/v1/settings", A, BODY)  # a call: method, path, target, body


def signed(
    caller: CallerKey,
    guard: CallGuard,
    method: str = "PUT",
    path: str = "/v1/settings",
    target: str = A,
    body: bytes = BODY,
    now: float = NOW,
) -> str:
    """`caller`'s signature of one call to the engine of `guard` (by its challenge)."""
    return caller.authorization(
        challenge_of(guard, caller.role), method, path, target, body, now=now
    )


def test_a_call_signed_for_an_engine_verifies_there_once() -> None:
    a = engine()
    header = signed(operator(), a)
    assert header.startswith(SCHEME + " ")
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"
    # The nonce replayed (a spy that saw the call sends it again) is refused.
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None
    # A fresh signature of the same call is good again.
    assert a.accepts("operator", signed(operator(), a), "PUT", "/v1/settings", [A], BODY)


def test_a_call_signed_for_engine_a_is_refused_at_engine_b() -> None:
    """Engine B trusts the same operator key, answers at the same endpoint and even claims
    the same pod uid (a restarted process): its own key pair makes another call key."""
    a, b = engine(), engine()
    header = signed(operator(), a)
    assert b.accepts("operator", header, *("PUT", "/v1/settings", [A], BODY)) is None
    # B tells it is a signature for another engine key (answered with its challenge,
    # not counted as a bad message); A does not.
    assert b.stale(header) and not a.stale(header)
    assert a.stale("")  # no signature at all: answered with the challenge too
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"


def test_a_call_signed_for_another_endpoint_is_refused() -> None:
    a = engine()
    header = signed(operator(), a, "PUT", "/v1/settings", B, BODY)  # made for B's address
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None
    # Where the engine answers at several addresses, any of them is its own.
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A, B], BODY) == "current"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/v1/settings", b'{"idle_ttl_s": 0}'),  # another body
        ("PUT", "/v1/peers/x", BODY),  # another path
        ("PUT", "/v1/settings?x=1", BODY),  # another query
        ("PATCH", "/v1/settings", BODY),  # another method
        ("DELETE", "/v1/peers/x", b""),
    ],
)
def test_a_signature_holds_only_for_the_request_it_was_made_for(
    method: str, path: str, body: bytes
) -> None:
    a = engine()
    header = signed(operator(), a)
    assert a.accepts("operator", header, method, path, [A], body) is None
    # Refused without being used up: the request it was made for still passes.
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"


@pytest.mark.parametrize(
    ("skew", "ok"),
    [
        (0.0, True),
        (SIGNATURE_WINDOW_S - 1, True),
        (-(SIGNATURE_WINDOW_S - 1), True),
        (SIGNATURE_WINDOW_S + 1, False),
        (-(SIGNATURE_WINDOW_S + 1), False),
        (3600.0, False),
    ],
)
def test_a_signature_holds_within_its_time_window_only(skew: float, ok: bool) -> None:
    """`skew`: how far the engine's clock is from the time the call was signed."""
    a = engine(now=NOW + skew)
    header = signed(operator(), a, now=NOW)
    got = a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY)
    assert got == ("current" if ok else None)


def test_the_challenge_carries_the_engine_s_clock_and_a_401_names_the_skew() -> None:
    """A caller whose clock is 90 s ahead is out of the window; signed against the time the
    engine's challenge carries, it is understood; the guard says how far off the refused
    one was (the 401's message names it). The time is not part of the challenge's
    identity (a caller keeps the challenge it holds)."""
    a = engine(now=NOW)
    told = challenge_of(a)
    assert told.now == int(NOW)
    assert told == Challenge(told.role, told.engine_key, "uid-a", "inc-a", told.kids, now=1)
    ahead = signed(operator(), a, now=NOW + 90)
    assert a.accepts("operator", ahead, "PUT", "/v1/settings", [A], BODY) is None
    assert a.skew(ahead) == pytest.approx(90)
    on_its_clock = signed(operator(), a, now=told.now)
    assert a.accepts("operator", on_its_clock, "PUT", "/v1/settings", [A], BODY) == "current"
    assert a.skew(on_its_clock) is None
    # An engine that predates the time in the challenge: parsed, with no time.
    old = told.header().rsplit(",now=", 1)[0]
    assert (parsed := parse_challenge(old)) is not None and parsed.now is None


def test_a_signature_of_one_role_opens_nothing_of_another() -> None:
    """A client and the operator, even holding the same key, make different call keys: a
    client's signature opens no admin route, and its role cannot be rewritten."""
    guard = CallGuard(
        {
            "operator": PublicKeys(keys=[OLD.public_key()]),
            "client": PublicKeys(keys=[OLD.public_key()]),
        },
        pod_uid="uid-a",
        clock=lambda: NOW,
    )
    client = operator(role="client")
    header = signed(client, guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None
    forged = header.replace("role=client", "role=operator")
    assert forged != header
    assert guard.accepts("operator", forged, "PUT", "/v1/settings", [A], BODY) is None
    assert guard.accepts("client", header, "PUT", "/v1/settings", [A], BODY) == "current"
    # A caller signs only for a challenge of its own role.
    with pytest.raises(SignatureError, match="asks for a operator credential"):
        client.authorization(challenge_of(guard, "operator"), *CALL)
    # An engine that takes no calls of a role accepts none.
    assert engine().accepts("client", header, "PUT", "/v1/settings", [A], BODY) is None
    with pytest.raises(ValueError, match="unknown caller roles"):
        CallGuard({"admin": PublicKeys(keys=[OLD.public_key()])})
    with pytest.raises(ValueError, match="unknown caller role"):
        CallerKey("peer", PrivateKeys(keys=[OLD]))


def test_the_operator_signs_nothing_for_an_engine_that_claims_another_pod() -> None:
    a = engine(uid="uid-a")
    with pytest.raises(SignatureError, match="uid-a"):
        operator().authorization(challenge_of(a), *CALL, pod_uid="uid-of-the-pod-dialled")
    header = operator().authorization(challenge_of(a), *CALL, pod_uid="uid-a", now=NOW)
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"


def test_a_rotation_keeps_both_key_versions_talking_until_the_old_key_is_dropped() -> None:
    """kubelet updates the key files pod by pod: an engine that has [new, old] and one that
    has [old] each take an operator holding [new, old] or only [old]; once the old key is
    dropped, a signature made with it is refused."""
    updated, lagging = engine(NEW, OLD), engine(OLD)
    assert challenge_of(updated).kids == (key_id(NEW.public_key()), key_id(OLD.public_key()))
    both, old_only, new_only = operator(NEW, OLD), operator(OLD), operator(NEW)
    for caller, at, which in (
        (both, updated, "current"),  # the first of its keys the engine lists: new
        (both, lagging, "current"),  # old: the only one the lagging engine lists
        (old_only, updated, "previous"),
        (old_only, lagging, "current"),
        (new_only, updated, "current"),
    ):
        header = signed(caller, at)
        assert at.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == which
    # An operator already past the rotation cannot reach an engine not yet updated.
    header = signed(new_only, lagging)
    assert lagging.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None
    # The rotation is over: the engine trusts the new key only.
    done = engine(NEW)
    header = signed(old_only, done)
    assert done.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None


META = "/v1/metadata?rank=0"


def test_a_ticket_opens_one_engines_metadata_for_the_fetcher_it_was_minted_for() -> None:
    a, b = engine(), engine(uid="uid-b")
    ticket = operator().ticket(challenge_of(a), "dec-1", "inc-1")
    assert valid_ticket(ticket)
    header = ticket_authorization(ticket, "GET", META, A, now=NOW)
    assert "dec-1" not in header and ticket.split(":")[1] not in header
    for fetcher, incarnation in (("dec-2", "inc-1"), ("dec-1", "inc-2"), ("dec-1", "")):
        assert a.accepts_ticket(header, fetcher, incarnation, "GET", META, [A], b"") is None
    assert a.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [B], b"") is None
    assert (
        a.accepts_ticket(header, "dec-1", "inc-1", "GET", "/v1/metadata?rank=1", [A], b"") is None
    )
    # At another engine (B trusts the same operator): nothing.
    assert b.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") is None
    assert a.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") == "current"
    assert a.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") is None  # replayed
    # A ticket is no call signature, and a call signature no ticket.
    assert a.accepts("operator", header, "GET", META, [A], b"") is None
    call = signed(operator(), a, "GET", META, A, b"")
    assert a.accepts_ticket(call, "dec-1", "inc-1", "GET", META, [A], b"") is None
    # Stale: a ticket's signature holds in the time window only.
    late = engine(now=NOW + SIGNATURE_WINDOW_S + 1)
    minted = operator().ticket(challenge_of(late), "dec-1", "inc-1")
    header = ticket_authorization(minted, "GET", META, A, now=NOW)
    assert late.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") is None


def test_a_batch_of_tickets_is_each_engines_own_ticket_under_rfc_2104() -> None:
    """The operator mints a peer-add batch's tickets at once, with each call key's HMAC pads
    hashed once (`CallerKey.tickets`): each must be the ticket the engine derives itself
    (`ticket_key`, the standard library's HMAC), whatever the batch holds and in its order,
    and a key's second ticket (pads from the cache) must equal its first."""
    engines = [engine(uid=f"uid-{i}") for i in range(3)]
    op = operator()
    targets = [challenge_of(e) for e in engines]
    batch = op.tickets([*targets, targets[0]], "dec-1", "inc-1")
    assert batch[0] == batch[3] and len(set(batch)) == 3
    for e, target, ticket in zip(engines, targets, batch, strict=False):
        kid, key = op._key(target)
        assert ticket == f"{kid}:{ticket_key(key, 'dec-1', 'inc-1').hex()}"
        assert ticket == op.ticket(target, "dec-1", "inc-1")
        header = ticket_authorization(ticket, "GET", META, A, now=NOW)
        assert e.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") == "current"
    assert op.tickets([], "dec-1", "inc-1") == []


def test_the_precomputed_pads_are_hmac_sha256_for_every_key_length() -> None:
    """The pads the operator keeps per call key (`_Pads`) give the standard library's
    HMAC-SHA256 for keys shorter than, as long as and longer than SHA-256's block."""
    import hashlib
    import hmac

    from kvtopo_worker.signing import _Pads

    for n in (0, 1, 32, 63, 64, 65, 200):
        key = bytes(range(256))[:n] if n <= 256 else b"k" * n
        for text in (b"", b"kvtopo-ticket-v1\x00dec-1\x00inc-1", b"x" * 1000):
            assert _Pads(key).mac(text) == hmac.new(key, text, hashlib.sha256).digest(), n


def test_only_an_operator_key_mints_a_ticket_and_a_ticket_must_be_well_formed() -> None:
    a = engine(role="client")
    with pytest.raises(SignatureError, match="only the operator"):
        operator(role="client").ticket(challenge_of(a, "client"), "dec-1", "")
    for bad in (
        "",
        "x",
        "0" * 16,
        "0" * 15 + ":" + "0" * 64,
        "0" * 16 + ":" + "0" * 63,
        "0" * 16 + ":" + "g" * 64,
    ):
        assert not valid_ticket(bad)
        with pytest.raises(SignatureError, match="a ticket is"):
            ticket_authorization(bad, "GET", META, A)
    # A ticket minted with another operator key opens nothing.
    a = engine()
    other = operator(OTHER).ticket(challenge_of(a), "dec-1", "")
    header = ticket_authorization(other, "GET", META, A, now=NOW)
    assert a.accepts_ticket(header, "dec-1", "", "GET", META, [A], b"") is None


def test_a_challenge_round_trips_and_a_malformed_or_oversized_one_is_refused() -> None:
    a = engine(NEW, OLD, uid="uid with , and = in it", incarnation="inc\u00e9")
    text = a.challenge("operator")
    parsed = parse_challenge(text)
    assert parsed is not None and parsed.header() == text
    assert (parsed.pod_uid, parsed.incarnation, parsed.role) == (
        "uid with , and = in it",
        "inc\u00e9",
        "operator",
    )
    assert parsed.engine_key == a.key.public and len(parsed.kids) == 2
    good = Challenge("operator", a.key.public, "uid", "inc", (key_id(OLD.public_key()),))
    assert parse_challenge(good.header()) == good
    key = good.header().split("key=")[1].split(",")[0]
    kid = good.kids[0]
    for bad in (
        "",
        "Bearer abc",
        "KVTopo-Sig",
        "KVTopo-Sig role=operator",  # fields missing
        good.header().replace("role=operator", "role=admin"),
        good.header().replace(f"key={key}", "key=AAAA"),  # not a P-256 point's length
        good.header().replace(f"key={key}", "key=!!!!"),  # not base64url
        good.header().replace(f"kids={kid}", f"kids={kid}.{kid}.{kid}"),  # three keys
        good.header().replace(f"kids={kid}", "kids=abc"),  # not a key id
        good.header().replace("uid=", "uid=" + "A" * (MAX_HEADER_FIELD + 1)),  # a field too long
        good.header() + ",x" * (2 * MAX_HEADER_FIELD),  # the header too long
        good.header().replace("uid=dWlk", "uid=" + "QUFB" * 90),  # a uid of 270 characters
        good.header().replace("uid=dWlk", "uid=_w"),  # not UTF-8
        good.header().replace("role=operator,", "role=operator,junk,"),
    ):
        assert parse_challenge(bad) is None, bad


def test_a_caller_looks_at_its_key_file_once_per_recheck_and_at_once_for_an_engine_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator signs tens of thousands of calls a minute: its key file's stat is taken
    at most once per `recheck_s`, not per call. A rotation still never breaks a pair: an
    engine that lists none of the keys held (it already trusts only the new one) makes the
    caller look at once; a file gone bad fails each use once looked at, until good."""
    k = tmp_path / "operator.key"
    k.write_text(private_pem(OLD))
    stats: list[Path] = []
    real_stat = Path.stat

    def counting(self: Path, **kwargs: bool) -> os.stat_result:
        if self == k:
            stats.append(self)
        return real_stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", counting)
    clock = [100.0]
    caller = CallerKey("operator", PrivateKeys(path=k, recheck_s=1.0, clock=lambda: clock[0]))
    both = engine(NEW, OLD)  # mid-rotation: trusts the new key, and the old one still
    for _ in range(50):
        header = signed(caller, both)
        assert both.accepts("operator", header, *CALL[:2], [A], BODY) == "previous"
    assert len(stats) == 1, "one look at the file when loaded, none per call"
    _rewrite(k, private_pem(NEW) + private_pem(OLD))  # the rotation begins here
    # Within the recheck the old key signs, which an engine mid-rotation takes.
    assert both.accepts("operator", signed(caller, both), *CALL[:2], [A], BODY) == "previous"
    clock[0] += 1.0
    assert both.accepts("operator", signed(caller, both), *CALL[:2], [A], BODY) == "current"
    # An engine past the rotation lists NEW only; the caller, holding [NEW, OLD] and then
    # rotated to a file it has not looked at yet, signs with the key the engine lists.
    _rewrite(k, private_pem(OTHER))
    past = engine(OTHER)
    looks = len(stats)
    assert past.accepts("operator", signed(caller, past), *CALL[:2], [A], BODY) == "current"
    assert len(stats) == looks + 1, "looked at once, not after the recheck"
    assert [kid for kid, _ in caller.keys.current()] == [key_id(OTHER.public_key())]
    # Tickets for such an engine are minted with the key it lists, too.
    _rewrite(k, private_pem(NEW))
    target = challenge_of(engine(NEW))
    (ticket,) = caller.tickets([target], "engine-b", "inc-b")
    assert ticket.startswith(key_id(NEW.public_key()) + ":")
    # A file gone bad: noticed at the next look, then every use fails until it is good.
    _rewrite(k, "  ")
    clock[0] += 1.0
    for _ in range(2):
        with pytest.raises(KeyFileError, match=str(k)):
            caller.keys.current()
    _rewrite(k, private_pem(NEW))
    assert [kid for kid, _ in caller.keys.current()] == [key_id(NEW.public_key())]


# --- key files ---------------------------------------------------------------------------


def _rewrite(path: Path, text: str) -> None:
    """Rewrites `path` and moves its mtime on, as a Secret rotation would."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    later = before + 5_000_000_000
    os.utime(path, ns=(later, later))


def certificate_pem(key: ec.EllipticCurvePrivateKey) -> str:
    """A self-signed certificate of `key` (what the chart ships: Helm derives no bare
    public key)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtopo-operator")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def test_a_public_key_file_takes_pem_public_keys_and_certificates(tmp_path: Path) -> None:
    f = tmp_path / "operator.pub"
    f.write_text(public_pem(NEW))
    assert [key_id(k) for k in load_public_keys(f)] == [key_id(NEW.public_key())]
    f.write_text(certificate_pem(NEW))
    assert [key_id(k) for k in load_public_keys(f)] == [key_id(NEW.public_key())]
    # During a rotation: the new one, then the old one (either form), in that order.
    f.write_text(certificate_pem(NEW) + "\n" + public_pem(OLD))
    assert [key_id(k) for k in load_public_keys(f)] == [
        key_id(NEW.public_key()),
        key_id(OLD.public_key()),
    ]
    # An engine trusting the certificate takes the operator's calls.
    guard = CallGuard({"operator": PublicKeys(path=f)}, clock=lambda: NOW)
    header = signed(operator(OLD), guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "previous"


def test_a_private_key_file_loads_and_signs(tmp_path: Path) -> None:
    f = tmp_path / "operator.key"
    f.write_text(private_pem(NEW) + private_pem(OLD))
    assert [key_id(k.public_key()) for k in load_private_keys(f)] == [
        key_id(NEW.public_key()),
        key_id(OLD.public_key()),
    ]
    a = engine(OLD)
    header = signed(CallerKey("operator", PrivateKeys(path=f)), a)
    assert a.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"


def _p384_pem(private: bool) -> str:
    key = ec.generate_private_key(ec.SECP384R1())
    if private:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
    return public_pem(key.public_key())


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "holds no PEM block"),
        ("   \n", "holds no PEM block"),
        ("not a key\n", "holds no PEM block"),
        (public_pem(NEW) * 3, "holds 3 PEM blocks"),
        (_p384_pem(private=False), "not EC P-256"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "bad block"),
    ],
)
def test_a_public_key_file_without_a_usable_key_is_an_error_naming_it(
    tmp_path: Path, text: str, fragment: str
) -> None:
    f = tmp_path / "operator.pub"
    f.write_text(text)
    with pytest.raises(KeyFileError, match=fragment) as err:
        load_public_keys(f)
    assert str(f) in str(err.value)
    assert isinstance(err.value, TokenError)  # refused the way a bad token file is
    with pytest.raises(KeyFileError, match=fragment):
        PublicKeys(path=f)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "holds no PEM block"),
        (private_pem(NEW) * 3, "holds 3 PEM blocks"),
        (_p384_pem(private=True), "not EC P-256"),
        (public_pem(NEW), "bad block"),  # a public key where the private one belongs
    ],
)
def test_a_private_key_file_without_a_usable_key_is_an_error_naming_it(
    tmp_path: Path, text: str, fragment: str
) -> None:
    f = tmp_path / "operator.key"
    f.write_text(text)
    with pytest.raises(KeyFileError, match=fragment) as err:
        load_private_keys(f)
    assert str(f) in str(err.value)


def test_a_missing_key_file_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pub"
    for load in (load_public_keys, load_private_keys, lambda p: PublicKeys(path=p)):
        with pytest.raises(KeyFileError, match=f"cannot read the .*{missing}"):
            load(missing)
    with pytest.raises(ValueError, match="exactly one"):
        PublicKeys()
    with pytest.raises(ValueError, match="exactly one"):
        PrivateKeys(path=missing, keys=[OLD])


def test_a_rewritten_key_file_is_read_again_and_a_bad_one_fails_every_use(
    tmp_path: Path,
) -> None:
    f = tmp_path / "operator.pub"
    f.write_text(public_pem(OLD))
    guard = CallGuard({"operator": PublicKeys(path=f)}, clock=lambda: NOW)
    assert challenge_of(guard).kids == (key_id(OLD.public_key()),)
    header = signed(operator(OLD), guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"
    _rewrite(f, public_pem(NEW) + public_pem(OLD))  # the rotation begins
    assert challenge_of(guard).kids == (key_id(NEW.public_key()), key_id(OLD.public_key()))
    header = signed(operator(OLD), guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "previous"
    _rewrite(f, "\n")  # emptied: neither key holds, however often asked
    for _ in range(2):
        with pytest.raises(KeyFileError, match=str(f)):
            guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY)
    assert challenge_of(guard).kids == ()  # the challenge still answers, naming no key
    _rewrite(f, public_pem(NEW))  # the rotation is over
    header = signed(operator(OLD), guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) is None
    header = signed(operator(NEW), guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"
    # The operator's own key file is read again too.
    k = tmp_path / "operator.key"
    k.write_text(private_pem(OLD))
    caller = CallerKey("operator", PrivateKeys(path=k))
    assert caller.keys.current()[0][0] == key_id(OLD.public_key())
    _rewrite(k, private_pem(NEW))
    assert caller.keys.current()[0][0] == key_id(NEW.public_key())
    header = signed(caller, guard)
    assert guard.accepts("operator", header, "PUT", "/v1/settings", [A], BODY) == "current"


def test_the_key_ids_are_computed_when_a_key_file_is_loaded_not_on_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine checks every signed call against its trusted keys, the operator signs
    every call with its own: a key's id (a DER encoding and a SHA-256) is computed when the
    file is (re)loaded, and every key loaded later gets its own id."""
    import kvtopo_worker.signing as signing

    computed: list[str] = []

    def counting(public: ec.EllipticCurvePublicKey) -> str:
        kid = key_id(public)
        computed.append(kid)
        return kid

    monkeypatch.setattr(signing, "key_id", counting)
    pub, priv = tmp_path / "operator.pub", tmp_path / "operator.key"
    pub.write_text(public_pem(OLD))
    priv.write_text(private_pem(OLD))
    trusted, mine = PublicKeys(path=pub), PrivateKeys(path=priv)
    for _ in range(50):
        assert [kid for kid, _ in trusted.current()] == [key_id(OLD.public_key())]
        assert [kid for kid, _ in mine.current()] == [key_id(OLD.public_key())]
    assert len(computed) == 2, "one id per key loaded, not one per call"
    # Rotations, one after another: each load's keys get their own ids (a key object freed
    # by the reload may leave its address to the next one).
    for _ in range(5):
        fresh = new_private_key()
        _rewrite(pub, public_pem(fresh) + public_pem(OLD))
        _rewrite(priv, private_pem(fresh))
        want = key_id(fresh.public_key())
        assert [kid for kid, _ in trusted.current()] == [want, key_id(OLD.public_key())]
        assert [kid for kid, _ in mine.current()] == [want]
    fixed = PublicKeys(keys=[NEW.public_key()])
    before = len(computed)
    for _ in range(10):
        assert fixed.current()[0][0] == key_id(NEW.public_key())
    assert len(computed) == before


def test_a_flood_of_tickets_never_reopens_the_replay_of_an_operator_call() -> None:
    """Issue 55, defect 6: one store held the nonces of operator calls and tickets alike,
    evicting the oldest when full, so 100,000 ticket fetches pushed a captured call's nonce
    out and the call replayed. Each kind of signed request now has its own store, and a
    full one refuses (NonceStoreFull, a 503) rather than forget an unexpired nonce."""
    public = PublicKeys(keys=[OLD.public_key()])
    a = CallGuard({"operator": public}, pod_uid="uid-a", clock=lambda: NOW, nonce_capacity=20)
    call = signed(operator(), a)
    assert a.accepts("operator", call, *CALL[:2], [A], BODY) == "current"
    ticket = operator().ticket(challenge_of(a), "dec-1", "inc-1")
    for _ in range(20):
        header = ticket_authorization(ticket, "GET", META, A, now=NOW)
        assert a.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"") == "current"
    header = ticket_authorization(ticket, "GET", META, A, now=NOW)
    with pytest.raises(NonceStoreFull, match="ticket"):
        a.accepts_ticket(header, "dec-1", "inc-1", "GET", META, [A], b"")
    assert a.accepts("operator", call, *CALL[:2], [A], BODY) is None, "the call replayed"
    # Operator calls still go through beside the full ticket store.
    assert a.accepts("operator", signed(operator(), a), *CALL[:2], [A], BODY) == "current"
    # Past twice the window the old nonces expire and tickets are taken again.
    later = NOW + 2 * SIGNATURE_WINDOW_S + 1
    b = CallGuard({"operator": public}, pod_uid="uid-a", clock=lambda: later, nonce_capacity=20)
    assert b.accepts("operator", signed(operator(), b, now=later), *CALL[:2], [A], BODY)


def test_a_full_peer_nonce_store_refuses_instead_of_forgetting() -> None:
    clock = [NOW]
    guard = PeerRequestGuard(TokenSource(value="peer-secret"), lambda: clock[0], nonce_capacity=3)
    headers = [sign_peer_request("peer-secret", "GET", META, A, now=NOW) for _ in range(4)]
    for h in headers[:3]:
        assert guard.accepts(h, "GET", META, [A], b"") == "current"
    with pytest.raises(NonceStoreFull):
        guard.accepts(headers[3], "GET", META, [A], b"")
    assert guard.accepts(headers[0], "GET", META, [A], b"") is None  # still refused: replay
    clock[0] = NOW + 2 * PEER_SIGNATURE_WINDOW_S + 1
    fresh = sign_peer_request("peer-secret", "GET", META, A, now=clock[0])
    assert guard.accepts(fresh, "GET", META, [A], b"") == "current"
