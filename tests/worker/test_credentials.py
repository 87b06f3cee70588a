"""The worker token as both sides read it (`kvtopo_worker.credentials`): what counts as a
token, the clear error for a file that holds none, and re-reading on rotation."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvtopo_operator.model import WorkerView
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.credentials import (
    TokenError,
    TokenSource,
    bearer_token,
    read_credential,
    read_token_file,
)
from tests.worker.test_agent import call, make_node


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


def test_the_control_api_authorises_nothing_while_its_token_file_is_empty(
    tmp_path: Path,
) -> None:
    f = tmp_path / "token"
    f.write_text("one")
    node = make_node("pre-tok", "prefill", token=TokenSource(path=f))
    try:
        url = f"{node.url}/v1/state"
        assert call("GET", url, token="one")[0] == 200
        _rewrite(f, " \n")
        for token in ("one", "", None):
            status, body = call("GET", url, token=token)
            assert status == 503
            assert body["error"] == "token_unavailable"
            assert str(f) in str(body["message"])
        assert call("GET", f"{node.url}/healthz", token=None)[0] == 200
        _rewrite(f, "two")
        assert call("GET", url, token="one")[0] == 401
        assert call("GET", url, token="two")[0] == 200
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
    """The operator credential opens the admin routes, the peer credential only a peer's
    metadata: a compromised engine (it holds the peer credential) cannot re-peer or evict."""
    node = make_node(
        "pre-cred",
        "prefill",
        token=TokenSource(value="op-new", previous="op-old"),
        peer_token=TokenSource(value="peer-new", previous="peer-old"),
    )
    try:
        for token in ("op-new", "op-old"):
            assert call("GET", f"{node.url}/v1/state", token=token)[0] == 200
            assert call("GET", f"{node.url}/v1/metadata", token=token)[0] == 403
        for token in ("peer-new", "peer-old"):
            assert call("GET", f"{node.url}/v1/metadata", token=token)[0] == 200
            status, body = call("PUT", f"{node.url}/v1/peers/x", {"endpoint": "10.0.0.1:1"}, token)
            assert status == 403 and "operator credential" in str(body["message"])
            assert call("DELETE", f"{node.url}/v1/peers/x", token=token)[0] == 403
        assert call("GET", f"{node.url}/v1/state", token="older")[0] == 401
        metrics = node.server.metrics
        assert metrics.authenticated_total.labels("operator", "previous")._value.get() == 1
        assert metrics.authenticated_total.labels("peer", "previous")._value.get() == 1
    finally:
        node.server.stop()


def test_a_rotation_applied_to_one_pod_only_keeps_both_sides_talking(tmp_path: Path) -> None:
    """kubelet updates Secret volumes pod by pod: a pod that has the new token (and the old
    one as previous) and a pod that still has only the old one must add each other as peers,
    and the operator, updated or not, must reach both."""
    updated = make_node(
        "pre-rot",
        "prefill",
        token=TokenSource(value="op-new", previous="op-old"),
        peer_token=TokenSource(value="peer-new", previous="peer-old"),
    )
    lagging = make_node(
        "dec-rot",
        "decode",
        token=TokenSource(value="op-old"),
        peer_token=TokenSource(value="peer-old"),
    )
    try:
        body = {"endpoint": lagging.server.endpoint, "role": "decode"}
        status, answer = call("PUT", f"{updated.url}/v1/peers/dec-rot", body, token="op-new")
        assert (status, answer["result"]) == (200, "added"), answer  # new refused, old taken
        body = {"endpoint": updated.server.endpoint, "role": "prefill"}
        status, answer = call("PUT", f"{lagging.url}/v1/peers/pre-rot", body, token="op-old")
        assert (status, answer["result"]) == (200, "added"), answer  # old is the previous
        assert updated.server.metrics.authenticated_total.labels("peer", "previous")._value.get()

        async def operator_reads(token_text: str) -> list[bool]:
            f = tmp_path / f"op-{token_text.replace(chr(10), '-')}"
            f.write_text(token_text)
            client = WorkerClient(f)
            try:
                return [
                    isinstance(await client.state(n.server.endpoint, 5.0), WorkerView)
                    for n in (updated, lagging)
                ]
            finally:
                await client.close()

        assert asyncio.run(operator_reads("op-new\nop-old")) == [True, True]
        assert asyncio.run(operator_reads("op-old")) == [True, True]
        # Without the previous token a sender is locked out of the pod not yet updated.
        assert asyncio.run(operator_reads("op-new")) == [True, False]
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
