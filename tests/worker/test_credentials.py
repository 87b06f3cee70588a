"""The worker token as both sides read it (`kvtopo_worker.credentials`): what counts as a
token, the clear error for a file that holds none, and re-reading on rotation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtopo_worker.credentials import TokenError, TokenSource, read_token_file
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
    node = make_node("pre-tok", "prefill", token="one")
    node.server.token = TokenSource(path=f)
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
