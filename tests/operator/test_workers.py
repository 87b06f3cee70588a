"""The operator's worker client: batched peer changes, whole-call failures, calls signed for
the challenge a worker answers (and only for the pod it must be), tickets, and the
operator's key read from its file. Real aiohttp servers on loopback, checking signatures with
the worker's own guard (`kvtopo_worker.signing.CallGuard`)."""

from __future__ import annotations

import asyncio
import dataclasses
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
from kvtopo_operator.workers import KEY_RECHECK_S, CallResult, PeerAdd, WorkerClient
from kvtopo_worker.credentials import TokenError
from kvtopo_worker.signing import (
    CallGuard,
    PrivateKeys,
    PublicKeys,
    new_private_key,
    parse_challenge,
    private_pem,
)

OPERATOR = new_private_key()


def client_of(key=OPERATOR) -> WorkerClient:  # type: ignore[no-untyped-def]
    return WorkerClient(None, PrivateKeys(keys=[key]))


def guarded(guard: CallGuard, signed: list[str] | None = None) -> web.Application:
    """An app whose routes take only calls the operator signed for `guard` (401 with its
    challenge otherwise), as a worker's admin routes do; `signed` collects what verified."""

    @web.middleware
    async def auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
        host = request.host
        which = guard.accepts(
            "operator",
            request.headers.get("Authorization", ""),
            request.method,
            request.path_qs,
            [host],
            await request.read(),
        )
        if which is None:
            return web.json_response(
                {"error": "unauthorized", "message": "sign"},
                status=401,
                headers={"WWW-Authenticate": guard.challenge("operator")},
            )
        if signed is not None:
            signed.append(f"{request.method} {request.path}")
        return await handler(request)

    return web.Application(middlewares=[auth])


def new_guard(uid: str = "", incarnation: str = "") -> CallGuard:
    return CallGuard(
        {"operator": PublicKeys(keys=[OPERATOR.public_key()])},
        pod_uid=uid,
        incarnation=incarnation,
    )


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
        client = client_of()
        try:
            return await client.state(endpoint, timeout_s)
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(body())


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_a_batch_is_signed_for_the_worker_and_gives_each_item_its_outcome() -> None:
    seen: list[dict[str, object]] = []
    signed: list[str] = []

    async def patch(request: web.Request) -> web.Response:
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
        app = guarded(new_guard(), signed)
        app.router.add_patch("/v1/peers", patch)
        runner, endpoint = await serve(app)
        client = client_of()
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
        assert signed == ["PATCH /v1/peers"]  # asked once unsigned (401 + challenge), then signed

    run(body)


def test_an_empty_key_file_fails_the_calls_naming_it(tmp_path: Path) -> None:
    key_file = tmp_path / "operator.key"
    key_file.write_text("\n")
    with pytest.raises(TokenError, match=f"private key file {key_file} holds no PEM block"):
        WorkerClient(key_file)
    signed: list[str] = []

    async def patch(request: web.Request) -> web.Response:
        return web.json_response({"results": []})

    clock = [0.0]

    async def body() -> None:
        key_file.write_text(private_pem(OPERATOR))
        # The client's own key file reading (`KEY_RECHECK_S`), on a clock the test moves.
        keys = PrivateKeys(path=key_file, recheck_s=KEY_RECHECK_S, clock=lambda: clock[0])
        client = WorkerClient(key_file, keys)
        app = guarded(new_guard(), signed)
        app.router.add_patch("/v1/peers", patch)
        app.router.add_get("/v1/state", patch)
        runner, endpoint = await serve(app)
        try:
            await client.change_peers(endpoint, [], ["p0"], 1.0)
            assert signed == ["PATCH /v1/peers"]
            key_file.write_text("  ")  # rotated to nothing: the file is read again
            later = key_file.stat().st_mtime_ns + 5_000_000_000
            os.utime(key_file, ns=(later, later))
            clock[0] += KEY_RECHECK_S
            got = await client.change_peers(endpoint, [], ["p0"], 1.0)
            state = await client.state(endpoint, 1.0)
        finally:
            await client.close()
            await runner.cleanup()
        assert signed == ["PATCH /v1/peers"]  # nothing was signed without a key
        (result,) = got.values()
        assert not result.ok and f"private key file {key_file}" in result.message
        assert isinstance(state, WorkerUnreachable) and str(key_file) in state.message

    run(body)


def test_nothing_is_signed_for_an_endpoint_whose_challenge_names_another_pod() -> None:
    """A selected pod whose endpoint answers with another pod's uid (a spy, or a worker
    started without its identity) gets no signed call: the read fails as an identity
    mismatch, and the spy sees only unsigned requests."""
    seen: list[str] = []
    guard = new_guard(uid="uid-of-another-pod")

    @web.middleware
    async def spy(request: web.Request, handler):  # type: ignore[no-untyped-def]
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response(
            {"error": "unauthorized"},
            status=401,
            headers={"WWW-Authenticate": guard.challenge("operator")},
        )

    async def body() -> None:
        runner, endpoint = await serve(web.Application(middlewares=[spy]))
        client = client_of()
        try:
            state = await client.state(endpoint, 1.0, pod_uid="uid-of-this-pod")
            got = await client.change_peers(endpoint, [], ["p0"], 1.0, pod_uid="uid-of-this-pod")
        finally:
            await client.close()
            await runner.cleanup()
        assert isinstance(state, WorkerUnreachable) and state.identity_mismatch
        assert "uid-of-another-pod" in state.message and "uid-of-this-pod" in state.message
        (result,) = got.values()
        assert not result.ok and "nothing signed was sent" in result.message
        # Each call asked the endpoint afresh (a pod IP may have passed to another pod),
        # unsigned; nothing signed reached it.
        assert seen == ["", ""]

    run(body)


def test_a_batch_s_tickets_skip_only_the_adds_that_cannot_have_one() -> None:
    """`WorkerClient.tickets` mints a batch at once; an add whose challenge is not held,
    names another pod or another process, or holds a key that cannot be used gets "" (its
    fetch fails and the next round reads the peer again), and the others keep theirs, in
    the batch's order."""
    client = client_of()
    guards = {
        f"10.0.0.{i}:8975": new_guard(uid=f"uid-{i}", incarnation=f"inc-{i}") for i in range(4)
    }
    for endpoint, guard in guards.items():
        challenge = parse_challenge(guard.challenge("operator"))
        assert challenge is not None
        client._remember(endpoint, challenge)
    # The engine at .3 says its key is a point off the curve: no call key can be derived.
    bad = parse_challenge(guards["10.0.0.3:8975"].challenge("operator"))
    assert bad is not None
    client._remember("10.0.0.3:8975", dataclasses.replace(bad, engine_key=b"\x04" + b"\x01" * 64))
    adds = [
        PeerAdd("e0", "10.0.0.0:8975", "prefill", "uid-0", "inc-0"),
        PeerAdd("e1", "10.0.0.1:8975", "prefill", "uid-of-another-pod", "inc-1"),
        PeerAdd("e3", "10.0.0.3:8975", "prefill", "uid-3", "inc-3"),
        PeerAdd("e2", "10.0.0.2:8975", "prefill", "uid-2", "inc-2-restarted"),
        PeerAdd("e9", "10.0.0.9:8975", "prefill", "uid-9", "inc-9"),
        PeerAdd("e1", "10.0.0.1:8975", "prefill", "uid-1", "inc-1"),
    ]
    tickets = client.tickets(adds, ("d0", "inc-d0"))
    assert [bool(t) for t in tickets] == [True, False, False, False, False, True]
    assert tickets[0] == client.ticket("10.0.0.0:8975", "uid-0", ("d0", "inc-d0"), "inc-0")
    assert tickets[0] != tickets[5]
    assert client.challenge("10.0.0.2:8975") is None, "another process's challenge is dropped"
    assert client.tickets(adds, ("", "")) == [""] * len(adds), "no fetcher, no ticket"


def test_each_add_carries_a_ticket_its_peer_verifies_for_the_fetching_engine() -> None:
    peer_guard = new_guard(uid="uid-p1", incarnation="inc-p1")
    received: list[dict[str, object]] = []

    async def state(request: web.Request) -> web.Response:
        return web.json_response({"engine_id": "p1", "role": "prefill", "compat_hash": "h"})

    async def patch(request: web.Request) -> web.Response:
        received.append(json.loads(await request.read()))
        return web.json_response({"results": []})

    async def body() -> None:
        peer_app = guarded(peer_guard)
        peer_app.router.add_get("/v1/state", state)
        worker_app = guarded(new_guard(uid="uid-d0"))
        worker_app.router.add_patch("/v1/peers", patch)
        peer_runner, peer = await serve(peer_app)
        worker_runner, worker = await serve(worker_app)
        client = client_of()
        try:
            assert isinstance(await client.state(peer, 1.0, pod_uid="uid-p1"), WorkerView)
            await client.change_peers(
                worker,
                [PeerAdd("p1", peer, "prefill", "uid-p1", "inc-p1")],
                [],
                1.0,
                pod_uid="uid-d0",
                fetcher=("d0", "inc-d0"),
            )
            # An add of another incarnation of p1 (restarted since its challenge was read)
            # carries no ticket its new process would refuse.
            await client.change_peers(
                worker,
                [PeerAdd("p1", peer, "prefill", "uid-p1", "inc-p1-restarted")],
                [],
                1.0,
                pod_uid="uid-d0",
                fetcher=("d0", "inc-d0"),
            )
        finally:
            await client.close()
            await peer_runner.cleanup()
            await worker_runner.cleanup()
        (item,) = received[0]["add"]  # type: ignore[misc]
        ticket = str(item["ticket"])
        (restarted,) = received[1]["add"]  # type: ignore[misc]
        assert "ticket" not in restarted
        from kvtopo_worker.signing import ticket_authorization

        def verifies(fetcher: str, incarnation: str) -> bool:
            header = ticket_authorization(ticket, "GET", "/v1/metadata?rank=0", peer)
            return (
                peer_guard.accepts_ticket(
                    header, fetcher, incarnation, "GET", "/v1/metadata?rank=0", [peer], b""
                )
                is not None
            )

        assert verifies("d0", "inc-d0")
        assert not verifies("d0", "inc-restarted") and not verifies("d1", "inc-d0")

    run(body)


def test_a_failed_batch_fails_every_item_with_its_reason() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "unauthorized", "message": "token"}, status=401)

    async def leave_out(request: web.Request) -> web.Response:
        return web.json_response({"results": []})

    async def body() -> None:
        client = client_of()
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
        client = client_of()
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
        seen.append((request.headers["Authorization"][:10], json.loads(await request.read())))
        return answers.pop(0)

    async def body() -> None:
        app = guarded(new_guard())
        app.router.add_put("/v1/settings", put)
        runner, endpoint = await serve(app)
        client = client_of()
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
        assert seen == [("KVTopo-Sig", {"idle_ttl_s": 30.0})] * 3
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
        client = client_of()
        try:
            new, old = [await client.state(endpoint, 1.0) for _ in range(2)]
        finally:
            await client.close()
            await runner.cleanup()
        assert isinstance(new, WorkerView) and isinstance(old, WorkerView)
        assert (new.handshake_timeout_s, new.idle_ttl_s) == (5.0, 30.0)
        assert (old.handshake_timeout_s, old.idle_ttl_s) == (None, None)  # predates them

    run(body)


def test_an_idle_connection_outlives_a_large_topology_s_reread_interval() -> None:
    """The operator keeps an idle connection to a worker longer than a 2,000-worker topology
    leaves between two re-reads of one worker (at aiohttp's 15 s nearly every re-read
    connected afresh), and shorter than the worker's server keeps it (so the operator, not
    the worker, closes it: no call is sent on a connection the worker is closing)."""
    from kvtopo_operator.gather import WorkerViews
    from kvtopo_operator.reconcile import Settings
    from kvtopo_operator.workers import KEEPALIVE_S
    from kvtopo_worker.serving import ServerLimits

    settings = Settings()
    views = WorkerViews(
        lambda *a: asyncio.sleep(0),  # type: ignore[arg-type,return-value]
        max_age_s=0.9 * settings.resync_s,
        reads_per_s=settings.state_reads_per_s,
    )
    assert views.refresh_age(2000) < KEEPALIVE_S < ServerLimits().keepalive_s
