"""The operator's worker client: batched peer changes, whole-call failures, and the worker
token read from its file. Real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from kvtopo_operator.model import (
    WorkerUnreachable,
    WorkerView,
)
from kvtopo_operator.workers import CallResult, PeerAdd, WorkerClient
from kvtopo_worker.credentials import TokenError


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


def read_state(state: dict[str, object], timeout_s: float = 5.0) -> object:
    """What `WorkerClient.state` makes of a worker answering `state` to `GET /v1/state`
    (a real server on 127.0.0.1)."""

    async def body() -> object:
        app = web.Application()

        async def get(_: web.Request) -> web.Response:
            return web.json_response(state)

        app.router.add_get("/v1/state", get)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        try:
            return await client.state(endpoint, timeout_s)
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(body())


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_a_batch_carries_the_token_and_gives_each_item_its_outcome() -> None:
    seen: list[dict[str, object]] = []

    async def patch(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer tok"
        body = json.loads(await request.read())
        seen.append(body)
        return web.json_response(
            {
                "results": [
                    {"engine_id": "p1", "op": "add", "status": 200, "result": "added"},
                    {
                        "engine_id": "bad",
                        "op": "add",
                        "status": 502,
                        "error": "handshake_failed",
                        "message": "no",
                    },
                    {"engine_id": "p0", "op": "evict", "status": 200, "result": "absent"},
                ]
            }
        )

    async def body() -> None:
        app = web.Application()
        app.router.add_patch("/v1/peers", patch)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        try:
            got = await client.change_peers(
                endpoint,
                [PeerAdd("p1", "10.0.0.1:1", "prefill"), PeerAdd("bad", "10.0.0.2:2", "prefill")],
                ["p0"],
                2.0,
            )
        finally:
            await client.close()
            await runner.cleanup()
        assert got == {
            ("add", "p1"): CallResult(True, 200, "", "added"),
            ("add", "bad"): CallResult(False, 502, "handshake_failed: no"),
            ("evict", "p0"): CallResult(True, 200, "", "absent"),
        }
        assert seen == [
            {
                "add": [
                    {"engine_id": "p1", "endpoint": "10.0.0.1:1", "role": "prefill"},
                    {"engine_id": "bad", "endpoint": "10.0.0.2:2", "role": "prefill"},
                ],
                "evict": ["p0"],
            }
        ]

    run(body)


def test_an_empty_token_file_fails_the_calls_naming_it(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    with pytest.raises(TokenError, match=f"worker token file {token_file} is empty"):
        WorkerClient(token_file)
    calls: list[str] = []

    async def patch(request: web.Request) -> web.Response:
        calls.append(request.headers.get("Authorization", ""))
        return web.json_response({"results": []})

    async def body() -> None:
        token_file.write_text("tok\n")
        client = WorkerClient(token_file)
        app = web.Application()
        app.router.add_patch("/v1/peers", patch)
        app.router.add_get("/v1/state", patch)
        runner, endpoint = await serve(app)
        try:
            await client.change_peers(endpoint, [], ["p0"], 1.0)
            assert calls == ["Bearer tok"]
            token_file.write_text("  ")  # rotated to nothing: the file is read again
            later = token_file.stat().st_mtime_ns + 5_000_000_000
            os.utime(token_file, ns=(later, later))
            got = await client.change_peers(endpoint, [], ["p0"], 1.0)
            state = await client.state(endpoint, 1.0)
        finally:
            await client.close()
            await runner.cleanup()
        assert calls == ["Bearer tok"]  # nothing was sent without a token
        (result,) = got.values()
        assert not result.ok and f"worker token file {token_file} is empty" in result.message
        assert isinstance(state, WorkerUnreachable) and str(token_file) in state.message

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
            got = await client.change_peers(
                dead, [PeerAdd("p1", "10.0.0.1:1", "prefill")], ["p0"], 1.0
            )
            assert {k: (r.ok, r.status) for k, r in got.items()} == {
                ("add", "p1"): (False, 0),
                ("evict", "p0"): (False, 0),
            }
            for handler, status, text in (
                (refuse, 401, "unauthorized: token"),
                (leave_out, 502, "left it out"),
                (None, 404, "Not Found"),  # no route: no single calls instead, a failure
            ):
                app = web.Application()
                if handler is not None:
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


def test_a_batch_with_adds_carries_the_handshake_deadline_it_is_given() -> None:
    seen: list[dict[str, object]] = []

    async def patch(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return web.json_response({"results": []})

    async def body() -> None:
        app = web.Application()
        app.router.add_patch("/v1/peers", patch)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        add = PeerAdd("p1", "10.0.0.1:1", "prefill")
        try:
            await client.change_peers(endpoint, [add], [], 7.0, handshake_timeout_s=7.0)
            await client.change_peers(endpoint, [], ["p0"], 7.0, handshake_timeout_s=7.0)
            await client.change_peers(endpoint, [add], [], 7.0)  # a worker that predates it
        finally:
            await client.close()
            await runner.cleanup()
        item = {"engine_id": "p1", "endpoint": "10.0.0.1:1", "role": "prefill"}
        assert seen == [
            {"add": [item], "handshake_timeout_s": 7.0},
            {"evict": ["p0"]},  # no adds: no handshake to bound
            {"add": [item]},
        ]

    run(body)


def test_the_idle_ttl_is_set_with_put_settings_and_confirmed_by_the_answer() -> None:
    seen: list[tuple[str, dict[str, object]]] = []
    answers: list[web.Response] = []

    async def put(request: web.Request) -> web.Response:
        seen.append((request.headers["Authorization"], json.loads(await request.read())))
        return answers.pop(0)

    async def body() -> None:
        app = web.Application()
        app.router.add_put("/v1/settings", put)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        answers.extend(
            [
                web.json_response({"idle_ttl_s": 30.0}),
                web.json_response({"error": "bad_request", "message": "no"}, status=400),
                web.json_response({"idle_ttl_s": 0.0}),  # it holds something else
            ]
        )
        try:
            got = [await client.set_idle_ttl(endpoint, 30.0, 1.0) for _ in range(3)]
            with socket.socket() as s:  # a port nobody listens on
                s.bind(("127.0.0.1", 0))
                dead = f"127.0.0.1:{s.getsockname()[1]}"
            unreachable = await client.set_idle_ttl(dead, 30.0, 1.0)
        finally:
            await client.close()
            await runner.cleanup()
        assert seen == [("Bearer tok", {"idle_ttl_s": 30.0})] * 3
        assert got[0] == CallResult(True, 200, "")
        assert got[1] == CallResult(False, 400, "bad_request: no")
        assert not got[2].ok and "holds idle_ttl_s 0.0" in got[2].message
        assert not unreachable.ok and unreachable.status == 0

    run(body)


def test_the_state_says_which_settings_the_worker_takes() -> None:
    base = {
        "engine_id": "e1",
        "role": "decode",
        "compat_hash": "h",
        "protocol_version": 4,
        "peers": [],
        "failures": {},
        "requests_done": 0,
        "requests_failed": 0,
        "requests_in_flight": 0,
        "started_at": 0.0,
    }
    answers = [{**base, "handshake_timeout_s": 5.0, "idle_ttl_s": 30.0}, base]

    async def state(request: web.Request) -> web.Response:
        return web.json_response(answers.pop(0))

    async def body() -> None:
        app = web.Application()
        app.router.add_get("/v1/state", state)
        runner, endpoint = await serve(app)
        client = WorkerClient(None, token="tok")
        try:
            new, old = [await client.state(endpoint, 1.0) for _ in range(2)]
        finally:
            await client.close()
            await runner.cleanup()
        assert isinstance(new, WorkerView) and isinstance(old, WorkerView)
        assert (new.handshake_timeout_s, new.idle_ttl_s) == (5.0, 30.0)
        assert (old.handshake_timeout_s, old.idle_ttl_s) == (None, None)  # predates them

    run(body)
