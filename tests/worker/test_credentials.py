"""The credentials as both sides read them: the tokens of `kvtopo_worker.credentials` (the
client token of the traffic routes, the peer token of lazy handshakes) — what counts as a
token, the clear error for a file that holds none, re-reading on rotation — and which
credential opens which route of the control API (the operator's key the admin routes only,
the client token the traffic routes only, the peer token only a peer's routes), also
through a rotation of the operator's key applied to one pod at a time."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from kvtopo.localkeys import ControlClient
from kvtopo_operator.model import WorkerView
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.credentials import (
    TokenError,
    TokenSource,
    bearer_token,
    read_credential,
    read_token_file,
)
from kvtopo_worker.signing import (
    CallerKey,
    PrivateKeys,
    PublicKeys,
    new_private_key,
    parse_challenge,
    private_pem,
    public_pem,
)
from tests.worker.test_agent import (
    CLIENT_TOKEN,
    OPERATOR_KEY,
    bearer,
    call,
    make_node,
    send,
    signature,
)


def _rewrite(path: Path, text: str) -> None:
    """Rewrites `path` and moves its mtime on, as a Secret rotation would (a write in the
    same clock tick as the last one would otherwise look unchanged on a coarse clock)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    later = before + 5_000_000_000
    os.utime(path, ns=(later, later))


@pytest.mark.parametrize("text", ["", " ", "\n", " \t\r\n  \n"])
def test_an_empty_or_blank_file_is_an_error_naming_it(tmp_path: Path, text: str) -> None:
    f = tmp_path / "token"
    f.write_text(text)
    with pytest.raises(TokenError, match=f"worker token file {f} is empty"):
        read_token_file(f)
    with pytest.raises(TokenError, match=f"worker token file {f} is empty"):
        TokenSource(path=f)


def test_the_token_is_the_text_without_surrounding_whitespace(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert read_token_file(f) == "s3cret"
    assert TokenSource(path=f).current() == "s3cret"
    f.write_text("  s3 cret \r\n\n")
    assert read_token_file(f) == "s3 cret"


def test_a_missing_or_undecodable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(TokenError, match=f"cannot read the worker token file {missing}"):
        read_token_file(missing)
    with pytest.raises(TokenError, match=f"cannot read the worker token file {missing}"):
        TokenSource(path=missing)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TokenError, match=f"{binary} is not UTF-8"):
        read_token_file(binary)


def test_a_fixed_token_must_not_be_empty() -> None:
    assert TokenSource(value="tok").current() == "tok"
    for empty in ("", "  \n"):
        with pytest.raises(TokenError, match="empty"):
            TokenSource(value=empty)
    with pytest.raises(ValueError, match="exactly one"):
        TokenSource()
    with pytest.raises(ValueError, match="exactly one"):
        TokenSource(path="x", value="y")


def test_a_rotated_file_gives_the_new_token(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("one\n")
    src = TokenSource(path=f)
    assert src.current() == "one"
    _rewrite(f, "two\n")
    assert src.current() == "two"
    _rewrite(f, "three-and-longer")
    assert src.current() == "three-and-longer"


def test_the_file_is_reread_only_when_its_stat_changes(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("one")
    src = TokenSource(path=f)
    st = f.stat()
    f.write_text("two")  # same size, same inode: only the mtime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.current() == "one"
    _rewrite(f, "two")
    assert src.current() == "two"


def test_a_file_emptied_after_start_fails_every_call_until_it_holds_a_token(
    tmp_path: Path,
) -> None:
    f = tmp_path / "token"
    f.write_text("one")
    src = TokenSource(path=f)
    _rewrite(f, "\n")
    for _ in range(2):  # neither the old token nor an empty one, however often asked
        with pytest.raises(TokenError, match=f"worker token file {f} is empty"):
            src.current()
    f.unlink()
    with pytest.raises(TokenError, match=f"cannot read the worker token file {f}"):
        src.current()
    _rewrite(f, "two")
    assert src.current() == "two"


def test_the_traffic_routes_take_nothing_while_the_client_token_file_is_empty(
    tmp_path: Path,
) -> None:
    f = tmp_path / "token"
    f.write_text("one")
    node = make_node("pre-tok", "prefill", client_token=TokenSource(path=f))
    try:
        url = f"{node.url}/v1/finished"
        assert call("GET", url, auth=bearer("one"))[0] == 200
        _rewrite(f, " \n")
        for auth in (bearer("one"), bearer(""), None):
            status, body = call("GET", url, auth=auth)
            assert status == 503
            assert body["error"] == "token_unavailable"
            assert str(f) in str(body["message"])
        assert call("GET", f"{node.url}/healthz", auth=None)[0] == 200
        # The client token's file is no part of the admin routes' credential.
        assert call("GET", f"{node.url}/v1/state")[0] == 200
        _rewrite(f, "two")
        assert call("GET", url, auth=bearer("one"))[0] == 401
        assert call("GET", url, auth=bearer("two"))[0] == 200
    finally:
        node.server.stop()


def test_the_admin_routes_take_nothing_while_the_operator_key_file_is_bad(
    tmp_path: Path,
) -> None:
    """An engine whose operator public key file is emptied answers every admin call 503
    naming the file (never falling back to the key it had), and takes signed calls again
    once the file holds the key."""
    f = tmp_path / "operator.pub"
    f.write_text(public_pem(OPERATOR_KEY))
    node = make_node("pre-key", "prefill", operator_keys=PublicKeys(path=f))
    try:
        state = f"{node.url}/v1/state"
        assert call("GET", state)[0] == 200
        _rewrite(f, "\n")
        for auth in (signature(state), None):
            status, body = call("GET", state, auth=auth)
            assert status == 503 and body["error"] == "key_unavailable", body
            assert str(f) in str(body["message"])
        assert call("GET", f"{node.url}/v1/finished", auth=bearer(CLIENT_TOKEN))[0] == 200
        _rewrite(f, public_pem(OPERATOR_KEY))
        assert call("GET", state)[0] == 200
    finally:
        node.server.stop()


def test_a_credential_holds_the_current_and_during_a_rotation_the_previous_token(
    tmp_path: Path,
) -> None:
    f = tmp_path / "token"
    f.write_text("new\n\n  old  \n")
    assert read_credential(f) == ("new", "old")
    src = TokenSource(path=f)
    assert (src.current(), src.previous(), src.candidates()) == ("new", "old", ["new", "old"])
    assert src.accepts(b"new") == "current" and src.accepts(b"old") == "previous"
    assert src.accepts(b"") is None and src.accepts(b"older") is None
    _rewrite(f, "new\n")  # the rotation is over: the old token is refused from now on
    assert src.candidates() == ["new"] and src.accepts(b"old") is None
    _rewrite(f, "a\nb\nc\n")
    with pytest.raises(TokenError, match=f"{f} holds 3 lines"):
        src.current()


def test_each_route_takes_its_own_credential() -> None:
    """The operator's signature opens the admin routes, and only those; the client token
    the traffic routes only; the peer token (where lazy handshakes are on) a peer's
    metadata only. So an engine (it holds the peer token) or a client of the traffic routes
    cannot add, evict or read peers, and no token opens anything but its own routes."""
    node = make_node(
        "pre-cred",
        "prefill",
        client_token=TokenSource(value="client-new", previous="client-old"),
        peer_token=TokenSource(value="peer-new", previous="peer-old"),
    )
    url = node.url
    admin = [
        ("GET", "/v1/state", None),
        ("PUT", "/v1/peers/x", {"endpoint": "127.0.0.1:9", "role": "decode"}),
        ("DELETE", "/v1/peers/x", None),
        ("PATCH", "/v1/peers", {"evict": ["x"]}),
        ("PUT", "/v1/settings", {"idle_ttl_s": 9}),
    ]
    try:
        for token in ("client-new", "client-old", "peer-new", "peer-old"):
            for method, path, body in admin:
                status, answer = call(method, url + path, body, auth=bearer(token))
                assert status == 401, (token, method, path, answer)
                assert "no bearer token opens it" in str(answer["message"])
        for token in ("client-new", "client-old"):
            assert call("GET", f"{url}/v1/finished", auth=bearer(token))[0] == 200
            assert call("GET", f"{url}/v1/metadata", auth=bearer(token))[0] == 401
        for token in ("peer-new", "peer-old"):
            assert call("GET", f"{url}/v1/metadata", auth=bearer(token))[0] == 200
            assert call("GET", f"{url}/v1/finished", auth=bearer(token))[0] == 401
        # The operator's signature opens each admin route, and no other route.
        for method, path, body in admin:
            status, answer = call(method, url + path, body)
            assert status == 200 or (path == "/v1/peers/x" and status == 502), answer
        for path in ("/v1/metadata", "/v1/finished"):
            assert call("GET", url + path, auth=signature(url + path))[0] == 401
        assert call("GET", f"{url}/v1/finished", auth=bearer("older"))[0] == 401
        assert node.registry.idle_ttl_s == 9
        metrics = node.server.metrics
        assert metrics.authenticated_total.labels("client", "previous")._value.get() == 1
        assert metrics.authenticated_total.labels("peer", "previous")._value.get() == 1
        assert metrics.authenticated_total.labels("operator", "current")._value.get() == len(admin)
    finally:
        node.server.stop()


def test_an_engine_without_an_operator_key_closes_its_admin_routes(tmp_path: Path) -> None:
    """An engine that pairs lazily only (no operator key) answers the admin routes 403 and
    signs nothing; one without a client token closes its traffic routes (403). Lazy
    handshakes need the peer token, and an engine needs an operator key or them."""
    lazy = make_node(
        "pre-lazy", "prefill", operator_keys=None, peer_token=TokenSource(value="peer")
    )
    closed = make_node("pre-closed", "prefill", client_token=None)
    try:
        status, _, headers = send("GET", f"{lazy.url}/v1/state", None, {})
        assert status == 403 and "WWW-Authenticate" not in headers
        assert call("GET", f"{lazy.url}/v1/finished", auth=bearer(CLIENT_TOKEN))[0] == 200
        assert call("GET", f"{closed.url}/v1/finished", auth=bearer(CLIENT_TOKEN))[0] == 403
        assert call("GET", f"{closed.url}/v1/state")[0] == 200
    finally:
        lazy.server.stop()
        closed.server.stop()
    with pytest.raises(ValueError, match="need the peer token"):
        make_node("x", "prefill", introductions=True)
    with pytest.raises(ValueError, match="operator's public key or lazy handshakes"):
        make_node("x", "prefill", operator_keys=None)


def test_an_operator_key_rotation_applied_to_one_pod_only_keeps_everyone_talking(
    tmp_path: Path,
) -> None:
    """kubelet updates the key Secrets pod by pod: an engine that trusts the new key and
    the old one, and an engine that trusts only the old one, must add each other as peers
    (with the tickets the operator mints), and the operator, updated or not, must reach
    both; an operator already past the rotation reaches only the updated engine."""
    new, old = new_private_key(), OPERATOR_KEY
    updated = make_node(
        "pre-rot",
        "prefill",
        operator_keys=PublicKeys(keys=[new.public_key(), old.public_key()]),
    )
    lagging = make_node("dec-rot", "decode", operator_keys=PublicKeys(keys=[old.public_key()]))
    both = ControlClient(CallerKey("operator", PrivateKeys(keys=[new, old])), CLIENT_TOKEN)
    try:
        body = {"endpoint": lagging.server.endpoint, "role": "decode"}
        status, answer = call("PUT", f"{updated.url}/v1/peers/dec-rot", body, client=both)
        assert (status, answer["result"]) == (200, "added"), answer
        body = {"endpoint": updated.server.endpoint, "role": "prefill"}
        status, answer = call("PUT", f"{lagging.url}/v1/peers/pre-rot", body, client=both)
        assert (status, answer["result"]) == (200, "added"), answer
        # The ticket for the lagging engine was minted with the old key: its only one.
        assert lagging.server.metrics.authenticated_total.labels("ticket", "current")._value.get()
        assert updated.server.metrics.authenticated_total.labels("operator", "current")._value.get()

        async def operator_reads(*keys: ec.EllipticCurvePrivateKey) -> list[bool]:
            f = tmp_path / f"op-{len(keys)}-{id(keys)}.key"
            f.write_text("".join(private_pem(k) for k in keys))
            client = WorkerClient(f)
            try:
                return [
                    isinstance(await client.state(n.server.endpoint, 5.0), WorkerView)
                    for n in (updated, lagging)
                ]
            finally:
                await client.close()

        assert asyncio.run(operator_reads(new, old)) == [True, True]
        assert asyncio.run(operator_reads(old)) == [True, True]
        assert updated.server.metrics.authenticated_total.labels(
            "operator", "previous"
        )._value.get()
        # Without the previous key the operator is locked out of the pod not yet updated.
        assert asyncio.run(operator_reads(new)) == [True, False]
        # The rotation over, an old-key signature opens nothing at the updated engine.
        done = make_node("pre-done", "prefill", operator_keys=PublicKeys(keys=[new.public_key()]))
        try:
            assert call("GET", f"{done.url}/v1/state")[0] == 401  # OPERATOR holds the old key
            challenge = parse_challenge(
                send("GET", f"{done.url}/v1/state", None, {})[2]["WWW-Authenticate"]
            )
            assert challenge is not None and len(challenge.kids) == 1
            assert call("GET", f"{done.url}/v1/state", client=both)[0] == 200
        finally:
            done.server.stop()
    finally:
        updated.server.stop()
        lagging.server.stop()


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer s3cret", b"s3cret"),
        ("bearer s3cret", b""),  # another scheme, as the control API reads it
        ("Basic czNjcmV0", b""),
        ("", b""),
        ("Bearer \udcff", b""),  # header text no token can be: refused, not a crash
    ],
)
def test_the_bearer_header_is_read_one_way_on_every_receiving_server(
    header: str, token: bytes
) -> None:
    assert bearer_token(header) == token


def test_the_traffic_server_refuses_a_bad_token_and_answers_503_while_it_has_none(
    tmp_path: Path,
) -> None:
    """The vLLM engine's traffic server checks the bearer as the control API does: 401 for a
    wrong or missing token, 503 (not a 500) while its token file holds no token."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvtopo_worker.traffic import EngineTraffic, TrafficServer

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    server = TrafficServer(EngineTraffic(), "127.0.0.1", 0, str(f))

    async def scenario() -> list[tuple[int, str]]:
        seen = []
        async with TestClient(TestServer(server.app)) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await client.get("/v1/finished", headers=headers)
                seen.append((r.status, (await r.json())["error"]))
            _rewrite(f, "\n")
            r = await client.get("/v1/finished", headers={"Authorization": "Bearer s3cret"})
            seen.append((r.status, (await r.json())["error"]))
        return seen

    assert asyncio.run(scenario()) == [
        (401, "unauthorized"),
        (401, "unauthorized"),
        (503, "token_unavailable"),
    ]
