"""Two pieces of HTTP client behaviour every kvtopo caller of the control API shares.

Owns `read_bounded`, reading an answer's body to its end but never past a bound (aiohttp's
`StreamReader.read(n)` returns as soon as *some* bytes have arrived, so a single call
truncates any answer larger than one network read: a prefill's `/v1/state` holding a
thousand peers, or the metadata of a worker with many blocks), and `request_as`, one request
tried with each candidate credential in turn (`TokenSource.candidates()`: during a rotation
a server whose Secret the kubelet has not updated yet refuses the current token with 401,
and the previous one is tried next). Used by the worker (peer metadata fetches), the
operator (`kvtopo_operator.workers`) and the drill (`kvtopo.drill.fleet`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

_CHUNK = 1 << 16


async def read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to its end, or its first `limit + 1` bytes when it is longer (so the
    caller can tell it was too long)."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await content.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def request_as(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    tokens: Sequence[str | None],
    *,
    headers: Mapping[str, str] | None = None,
    on_fallback: Callable[[], None] | None = None,
    **kwargs: Any,
) -> aiohttp.ClientResponse:
    """The answer to one request made with the first of `tokens` that is not refused with
    401 (the last one's answer whatever it is); None in `tokens` sends no credential. The
    caller releases the response (`async with await request_as(...) as resp`). No redirect
    is followed unless the caller says so."""
    kwargs.setdefault("allow_redirects", False)
    for i, token in enumerate(tokens):
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        resp = await session.request(method, url, headers=sent, **kwargs)
        if resp.status == 401 and i + 1 < len(tokens):
            resp.release()
            if on_fallback is not None:
                on_fallback()
            continue
        return resp
    raise ValueError("no credential to try")
