"""The operator's worker client: batched peer changes, the fallback for workers without
`PATCH /v1/peers`, and whole-call failures. Real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvtopo_operator.workers import CallResult, WorkerClient


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_a_worker_without_batches_gets_one_call_per_peer() -> None:
    seen: list[tuple[str, str, str]] = []

    async def put(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer tok"
        seen.append(("PUT", request.match_info["eid"], json.loads(await request.read())["role"]))
        if request.match_info["eid"] == "bad":
            return web.json_response({"error": "handshake_failed", "message": "no"}, status=502)
        return web.json_response({"engine_id": request.match_info["eid"], "result": "added"})

    async def delete(request: web.Request) -> web.Response:
        seen.append(("DELETE", request.match_info["eid"], ""))
        return web.json_response({"engine_id": request.match_info["eid"], "result": "absent"})

    async def body() -> None:
        app = web.Application()
        app.router.add_put("/v1/peers/{eid}", put)
        app.router.add_delete("/v1/peers/{eid}", delete)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        try:
            got = await client.change_peers(
                endpoint, [("p1", "h:1", "prefill"), ("bad", "h:2", "prefill")], ["p0"], 2.0
            )
        finally:
            await client.close()
            await runner.cleanup()
        assert got == {
            ("add", "p1"): CallResult(True, 200, "", "added"),
            ("add", "bad"): CallResult(False, 502, "handshake_failed: no"),
            ("evict", "p0"): CallResult(True, 200, "", "absent"),
        }
        assert sorted(seen) == [
            ("DELETE", "p0", ""),
            ("PUT", "bad", "prefill"),
            ("PUT", "p1", "prefill"),
        ]

    run(body)


def test_a_failed_batch_fails_every_item_with_its_reason() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "unauthorized", "message": "token"}, status=401)

    async def leave_out(request: web.Request) -> web.Response:
        return web.json_response({"results": []})

    async def body() -> None:
        client = WorkerClient(None, token="tok")
        try:
            with socket.socket() as s:  # a port nobody listens on
                s.bind(("127.0.0.1", 0))
                dead = f"127.0.0.1:{s.getsockname()[1]}"
            got = await client.change_peers(dead, [("p1", "h:1", "prefill")], ["p0"], 1.0)
            assert {k: (r.ok, r.status) for k, r in got.items()} == {
                ("add", "p1"): (False, 0),
                ("evict", "p0"): (False, 0),
            }
            for handler, status, text in (
                (refuse, 401, "unauthorized: token"),
                (leave_out, 502, "left it out"),
            ):
                app = web.Application()
                app.router.add_patch("/v1/peers", handler)
                runner, endpoint = await serve(app)
                try:
                    got = await client.change_peers(endpoint, [], ["p0", "p2"], 1.0)
                finally:
                    await runner.cleanup()
                assert set(got) == {("evict", "p0"), ("evict", "p2")}
                assert all(
                    not r.ok and r.status == status and text in r.message for r in got.values()
                )
        finally:
            await client.close()

    run(body)
