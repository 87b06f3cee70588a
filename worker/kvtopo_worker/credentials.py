"""The bearer token of the worker control API, as both sides read it.

Owns reading the token from its file (the mounted worker token Secret) and the one rule
for what counts as a token: the file's text with surrounding whitespace stripped, which must
not be empty. An empty, whitespace-only, missing or unreadable file is a `TokenError` naming
the file, never an empty token: an empty token must not authorise anything. A `TokenSource`
re-reads its file only when the file's stat (mtime, size, inode) changes, so a rotated
Secret takes effect at the next call without a read per request. Used by the worker's
control API (`agent`, which checks the token and sends it to peers) and by the operator's
worker client (which sends it); imports nothing but the standard library.
"""

from __future__ import annotations

from pathlib import Path


class TokenError(ValueError):
    """The token file cannot give a token (missing, unreadable, empty); says which file."""


def read_token_file(path: str | Path) -> str:
    """The token in `path`, stripped of surrounding whitespace (a trailing newline included).

    Raises TokenError, naming the file, when it cannot be read or holds no token.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenError(
            f"cannot read the worker token file {path}: {exc.strerror}; "
            "mount the kvtopo worker token Secret there or pass its path"
        ) from None
    except UnicodeDecodeError:
        raise TokenError(f"the worker token file {path} is not UTF-8 text") from None
    token = text.strip()
    if not token:
        raise TokenError(f"the worker token file {path} is empty; an empty token is refused")
    return token


class TokenSource:
    """The bearer token, from a file (re-read when it changes) or a fixed string.

    A file is read at construction, so a bad one fails at startup; after that `current()`
    raises TokenError for as long as the file is bad (it never falls back to an empty or an
    earlier token) and returns the new token once the file is good again.
    """

    def __init__(self, *, path: str | Path | None = None, value: str | None = None) -> None:
        if (path is None) == (value is None):
            raise ValueError("give exactly one of a token file path or a token value")
        self._path = Path(path) if path is not None else None
        self._stat: tuple[int, int, int] | None = None
        if value is not None:
            if not value.strip():
                raise TokenError("the worker token is empty; an empty token is refused")
            self._value = value.strip()
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
            self._value = read_token_file(self._path)
            self._stat = key

    def current(self) -> str:
        """The token now (never empty); raises TokenError while the token file is bad."""
        if self._path is not None:
            self._reload()
        return self._value
