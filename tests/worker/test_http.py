"""`kvtopo_worker.http`: an answer larger than one network read is read whole (the bug it
fixes: aiohttp's `StreamReader.read(n)` returns what has arrived, so the operator read a
prefill's `/v1/state` with a thousand peers truncated, "DecodeError: Input data was
truncated", and called the worker unreachable), a bound still holds, and a request refused
with 401 is tried again with the next credential. Real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from kvtopo_worker.http import read_bounded, request_as

BIG = bytes(range(256)) * 8192  # 2 MiB: far more than one read of aiohttp's stream


@asynccontextmanager
async def serving(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/x"
    finally:
        await runner.cleanup()


async def big(_: web.Request) -> web.Response:
    return web.Response(body=BIG)


def test_a_large_answer_is_read_to_its_end() -> None:
    async def body() -> tuple[int, bytes]:
        async with serving(big) as url, aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                one_read = len(await resp.content.read(len(BIG) + 1))
            async with session.get(url) as resp:
                return one_read, await read_bounded(resp.content, len(BIG))

    one_read, whole = asyncio.run(body())
    assert one_read < len(BIG), "a single read returns only what has arrived"
    assert whole == BIG


@pytest.mark.parametrize("limit", [0, 1000, len(BIG) - 1])
def test_the_bound_holds_and_says_it_was_longer(limit: int) -> None:
    async def body() -> bytes:
        async with (
            serving(big) as url,
            aiohttp.ClientSession() as session,
            session.get(url) as resp,
        ):
            return await read_bounded(resp.content, limit)

    assert asyncio.run(body()) == BIG[: limit + 1]


def test_a_refused_credential_falls_back_to_the_next() -> None:
    seen: list[str] = []

    async def auth(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        ok = request.headers.get("Authorization") == "Bearer old"
        return web.Response(status=200 if ok else 401, text="ok" if ok else "no")

    async def body() -> tuple[int, int, int]:
        fallbacks = []
        async with serving(auth) as url, aiohttp.ClientSession() as session:
            resp = await request_as(
                session, "GET", url, ["new", "old"], on_fallback=lambda: fallbacks.append(1)
            )
            async with resp:
                first = resp.status
            resp = await request_as(session, "GET", url, ["new"])
            async with resp:
                return first, resp.status, len(fallbacks)

    assert asyncio.run(body()) == (200, 401, 1)
    assert seen == ["Bearer new", "Bearer old", "Bearer new"]
