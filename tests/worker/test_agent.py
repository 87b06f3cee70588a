"""The control API: auth, bad bodies, handshakes through a peer's metadata, eviction.

Two real ControlServers (real aiohttp, real registry) on loopback, with fake transports."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtopo_operator.model import WorkerView
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.agent import ControlServer, LocalEngine
from kvtopo_worker.credentials import TokenSource
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    CompatInfo,
    EngineMetadata,
    Envelope,
    PodIdentity,
    compat_hash,
    encode_metadata,
)
from kvtopo_worker.registry import EngineRegistry
from tests.worker.fakes import FakeTransport, MetadataPeer

TOKEN = "t0ken-for-tests"


@dataclass
class Node:
    server: ControlServer
    transport: FakeTransport
    registry: EngineRegistry

    @property
    def url(self) -> str:
        return f"http://{self.server.endpoint}"


def make_node(
    engine_id: str,
    role: str,
    model_id: str = "m",
    token: str | TokenSource = TOKEN,
    peer_token: TokenSource | None = None,
    pod: PodIdentity | None = None,
    incarnation: str = "",
    introductions: bool = True,
) -> Node:
    """An in-process worker control API over a fake transport; `token` is its operator
    credential (a token or a source), `peer_token` its peer credential (default: the same)."""
    transport = FakeTransport(agent_name=f"agent-{engine_id}")
    registry = EngineRegistry(remove_agent=transport.remove_remote)
    compat = CompatInfo(block_len=64, model_id=model_id)
    meta = EngineMetadata(
        engine_id=engine_id,
        role=role,
        agent_name=transport.agent_name,  # type: ignore[arg-type]
        agent_metadata=transport.agent_name.encode(),
        kv_addr=0,
        num_blocks=4,
        block_len=64,
        compat=compat,
        compat_hash=compat_hash(compat),
        pod=pod,
        incarnation=incarnation,
        notif_key=bytes(range(32)),  # any 32 bytes: the fake transport seals nothing
    )
    server = ControlServer(
        engine=LocalEngine(engine_id, role, meta, time.time()),  # type: ignore[arg-type]
        registry=registry,
        transport=transport,
        token=token if isinstance(token, TokenSource) else TokenSource(value=token),
        peer_token=peer_token,
        metrics=WorkerMetrics(),
        introductions=introductions,
    )
    server.start()
    return Node(server, transport, registry)


@pytest.fixture
def pair() -> Iterator[tuple[Node, Node]]:
    p, d = make_node("pre-1", "prefill"), make_node("dec-1", "decode")
    yield p, d
    p.server.stop()
    d.server.stop()


def call(
    method: str, url: str, body: object = None, token: str | None = TOKEN, raw: bytes | None = None
) -> tuple[int, dict[str, object]]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read()
            return resp.status, (
                json.loads(text) if resp.headers.get_content_type() == "application/json" else {}
            )
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_routes_need_the_token_except_health_and_metrics(pair: tuple[Node, Node]) -> None:
    p, _ = pair
    for method, path in [
        ("GET", "/v1/state"),
        ("GET", "/v1/metadata"),
        ("PUT", "/v1/peers/x"),
        ("DELETE", "/v1/peers/x"),
        ("PATCH", "/v1/peers"),
    ]:
        assert call(method, p.url + path, token=None)[0] == 401
        assert call(method, p.url + path, token="wrong")[0] == 401
    assert urllib.request.urlopen(p.url + "/healthz", timeout=5).status == 200
    metrics = urllib.request.urlopen(p.url + "/metrics", timeout=5).read().decode()
    assert 'kvtopo_worker_rejected_messages_total{source="control_auth"} 10.0' in metrics


def test_handshake_both_ways_then_evict(pair: tuple[Node, Node]) -> None:
    p, d = pair
    status, body = call(
        "PUT", f"{d.url}/v1/peers/pre-1", {"endpoint": p.server.endpoint, "role": "prefill"}
    )
    assert (status, body["result"], body["agents"]) == (200, "added", {"0": "agent-pre-1"})
    status, body = call(
        "PUT", f"{p.url}/v1/peers/dec-1", {"endpoint": d.server.endpoint, "role": "decode"}
    )
    assert (status, body["result"]) == (200, "added")
    # Idempotent: a second PUT connects nothing twice.
    status, body = call(
        "PUT", f"{d.url}/v1/peers/pre-1", {"endpoint": p.server.endpoint, "role": "prefill"}
    )
    assert (status, body["result"]) == (200, "present")
    assert d.transport.remotes == {"agent-pre-1"}
    status, state = call("GET", f"{d.url}/v1/state")
    assert status == 200 and [peer["engine_id"] for peer in state["peers"]] == ["pre-1"]  # type: ignore[index, union-attr]
    status, body = call("DELETE", f"{d.url}/v1/peers/pre-1")
    assert (status, body["result"]) == (200, "evicted")
    assert d.transport.removed == ["agent-pre-1"]
    assert call("DELETE", f"{d.url}/v1/peers/pre-1")[1]["result"] == "absent"


def test_a_batch_adds_and_evicts_each_item_as_its_own_route_would() -> None:
    d = make_node("dec-1", "decode")
    prefills = [make_node(f"pre-{i}", "prefill") for i in range(3)]
    other = make_node("other", "prefill", model_id="another-model")
    try:
        adds = [
            {
                "engine_id": n.server.engine.engine_id,
                "endpoint": n.server.endpoint,
                "role": "prefill",
            }
            for n in prefills
        ]
        status, body = call("PATCH", f"{d.url}/v1/peers", {"add": adds})
        assert status == 200
        assert [(r["engine_id"], r["op"], r["status"], r["result"]) for r in body["results"]] == [  # type: ignore[union-attr]
            (f"pre-{i}", "add", 200, "added") for i in range(3)
        ]
        assert d.transport.remotes == {"agent-pre-0", "agent-pre-1", "agent-pre-2"}
        # One bad item fails alone: the others still happen, each with its own outcome.
        status, body = call(
            "PATCH",
            f"{d.url}/v1/peers",
            {
                "add": [
                    adds[0],
                    {"engine_id": "other", "endpoint": other.server.endpoint, "role": "prefill"},
                    {"engine_id": "dec-1", "endpoint": d.server.endpoint, "role": "prefill"},
                ],
                "evict": ["pre-1", "never-seen", "x" * 300],
            },
        )
        assert status == 200
        got = [(r["engine_id"][:10], r["op"], r["status"]) for r in body["results"]]  # type: ignore[union-attr]
        assert got == [
            ("pre-0", "add", 200),
            ("other", "add", 409),
            ("dec-1", "add", 400),
            ("pre-1", "evict", 200),
            ("never-seen", "evict", 200),
            ("x" * 10, "evict", 400),
        ]
        results = body["results"]  # type: ignore[index]
        assert results[0]["result"] == "present" and results[1]["error"] == "incompatible"
        assert "own peer" in results[2]["message"]
        assert [r.get("result") for r in results[3:5]] == ["evicted", "absent"]
        assert d.transport.removed == ["agent-pre-1"]
        _, state = call("GET", f"{d.url}/v1/state")
        assert sorted(p["engine_id"] for p in state["peers"]) == ["pre-0", "pre-2"]  # type: ignore[index, union-attr]
        # A batch that is not a batch is refused whole, naming the field; nothing changes.
        status, body = call("PATCH", f"{d.url}/v1/peers", {"add": [{"engine_id": "pre-9"}]})
        assert status == 400 and "endpoint" in str(body["message"])
        status, body = call("PATCH", f"{d.url}/v1/peers", {"evict": ["e"] * 1025})
        assert status == 400 and "1024" in str(body["message"])
        _, state = call("GET", f"{d.url}/v1/state")
        assert len(state["peers"]) == 2  # type: ignore[arg-type]
    finally:
        for n in (d, *prefills, other):
            n.server.stop()


def test_incompatible_peer_is_refused_with_both_hashes() -> None:
    p, d = make_node("pre-x", "prefill", model_id="a"), make_node("dec-x", "decode", model_id="b")
    try:
        status, body = call(
            "PUT", f"{d.url}/v1/peers/pre-x", {"endpoint": p.server.endpoint, "role": "prefill"}
        )
        assert status == 409 and body["error"] == "incompatible"
        assert body["local_hash"] == d.server.engine.compat_hash
        assert body["remote_hash"] == p.server.engine.compat_hash
        assert d.registry.engine_ids() == [] and d.transport.remotes == set()
        assert call("GET", f"{d.url}/v1/state")[1]["failures"] == {"incompatible": 1}
    finally:
        p.server.stop()
        d.server.stop()


def test_wrong_engine_behind_endpoint_and_unreachable_peer(pair: tuple[Node, Node]) -> None:
    p, d = pair
    status, body = call(
        "PUT", f"{d.url}/v1/peers/someone-else", {"endpoint": p.server.endpoint, "role": "prefill"}
    )
    assert status == 409 and "serves engine pre-1" in str(body["message"])
    status, body = call(
        "PUT", f"{d.url}/v1/peers/gone", {"endpoint": "127.0.0.1:9", "role": "prefill"}
    )
    assert status == 502 and body["failure_type"] == "handshake_failed"
    assert d.registry.engine_ids() == []
    assert call("GET", f"{d.url}/v1/state")[1]["failures"] == {"handshake_failed": 2}


def test_peer_with_another_token_fails_the_handshake() -> None:
    p, d = make_node("pre-t", "prefill", token="other"), make_node("dec-t", "decode")
    try:
        status, body = call(
            "PUT", f"{d.url}/v1/peers/pre-t", {"endpoint": p.server.endpoint, "role": "prefill"}
        )
        assert status == 502 and "HTTP 401" in str(body["message"])
    finally:
        p.server.stop()
        d.server.stop()


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"", "bad PeerAddRequest"),
        (b"not json", "bad PeerAddRequest"),
        (b'{"endpoint": 3, "role": "prefill"}', "$.endpoint"),
        (b'{"endpoint": "h:1"}', "role"),
        (b'{"endpoint": "10.0.0.1:1", "role": "decode"}', "pairs with the other role"),
        (b'{"endpoint": "h:1", "role": "prefill"}', "endpoint refused"),
    ],
)
def test_bad_bodies_get_400_with_a_message(
    pair: tuple[Node, Node], body: bytes, fragment: str
) -> None:
    _, d = pair
    status, answer = call("PUT", f"{d.url}/v1/peers/pre-1", raw=body)
    assert status == 400 and fragment in str(answer["message"])


def test_self_and_oversized_ids_are_refused(pair: tuple[Node, Node]) -> None:
    _, d = pair
    assert call("PUT", f"{d.url}/v1/peers/dec-1", {"endpoint": "h:1", "role": "prefill"})[0] == 400
    assert call("DELETE", f"{d.url}/v1/peers/{'x' * 300}")[0] == 400


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=200))
def test_fuzzed_bodies_never_crash_the_server(pair: tuple[Node, Node], body: bytes) -> None:
    _, d = pair
    status, _ = call("PUT", f"{d.url}/v1/peers/pre-1", raw=body)
    assert status in (400, 502)
    assert urllib.request.urlopen(d.url + "/healthz", timeout=5).status == 200


def test_token_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("one\n")
    src = TokenSource(path=f)
    assert src.current() == "one"
    f.write_text("two")
    import os

    os.utime(f, (time.time() + 5, time.time() + 5))
    assert src.current() == "two"
    with pytest.raises(ValueError, match="cannot read the worker token file"):
        TokenSource(path=tmp_path / "missing")


@pytest.fixture(scope="module")
def garbage_peer() -> Iterator[MetadataPeer]:
    peer = MetadataPeer()
    yield peer
    peer.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda meta, version, h: msgspec.msgpack.encode(
                Envelope(version, h, msgspec.Raw(meta))
            ),
            st.binary(max_size=100),
            st.integers(min_value=0, max_value=3),
            st.text(max_size=20),
        ),
    )
)
def test_garbage_and_mismatched_metadata_is_refused_and_counted(
    pair: tuple[Node, Node], garbage_peer: MetadataPeer, payload: bytes
) -> None:
    _, d = pair
    garbage_peer.payload = payload
    before = sum(d.server.metrics.failure_counts().values())
    status, body = call(
        "PUT", f"{d.url}/v1/peers/pre-g", {"endpoint": garbage_peer.endpoint, "role": "prefill"}
    )
    assert status in (409, 502), body
    assert body["error"] in ("handshake_failed", "incompatible")
    assert sum(d.server.metrics.failure_counts().values()) == before + 1
    assert d.registry.engine_ids() == [] and d.transport.remotes == set()
    assert urllib.request.urlopen(d.url + "/healthz", timeout=5).status == 200


def test_a_non_ascii_or_undecodable_token_is_refused_with_401_not_500(
    pair: tuple[Node, Node],
) -> None:
    p, _ = pair
    host, port = p.server.endpoint.rsplit(":", 1)
    for raw in ("Bearer t\u00f6ken".encode(), b"Bearer \xff\xfe\x80"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(
                b"GET /v1/state HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Authorization: " + raw + b"\r\n\r\n"
            )
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"401", answer[:200]


def test_a_peer_that_answers_an_endless_error_body_fails_the_handshake_promptly(
    pair: tuple[Node, Node],
) -> None:
    # A peer whose error answer never ends: the worker reads a bounded prefix of it and
    # fails the handshake with the status, instead of reading until the handshake timeout
    # (or, for a large finite body, holding it all in memory).
    _, d = pair
    d.server.handshake_timeout_s = 30

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=500)
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:
                await resp.write(b"x" * 65536)
        return resp

    app = web.Application()
    app.router.add_get("/v1/metadata", endless)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    try:
        t0 = time.monotonic()
        status, body = call(
            "PUT", d.url + "/v1/peers/liar", {"endpoint": f"127.0.0.1:{port}", "role": "prefill"}
        )
        assert status == 502, body
        assert "HTTP 500" in str(body["message"]), body
        assert len(str(body["message"])) < 1024
        assert time.monotonic() - t0 < 10
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)


def test_a_peer_must_be_the_pod_and_process_the_operator_names() -> None:
    """The operator tells a worker which pod uid and incarnation a peer it adds must have:
    metadata from another pod or another process is refused, and a peer held under an older
    incarnation has its agents replaced."""
    pod = PodIdentity(namespace="ns", name="p0", uid="uid-p0")
    p = make_node("pre-id", "prefill", pod=pod, incarnation="boot-1")
    d = make_node("dec-id", "decode")
    try:
        url = f"{d.url}/v1/peers/pre-id"
        body = {"endpoint": p.server.endpoint, "role": "prefill"}
        for wrong in ({"pod_uid": "uid-other"}, {"incarnation": "boot-0"}):
            status, answer = call("PUT", url, {**body, **wrong})
            assert status == 409 and "not" in str(answer["message"]), (wrong, answer)
        assert "pre-id" not in d.registry
        status, answer = call("PUT", url, {**body, "pod_uid": "uid-p0", "incarnation": "boot-1"})
        assert (status, answer["result"]) == (200, "added"), answer
        assert d.registry.incarnation("pre-id") == "boot-1"
        state = call("GET", f"{p.url}/v1/state")[1]
        assert state["incarnation"] == "boot-1" and state["pod"]["uid"] == "uid-p0"
    finally:
        p.server.stop()
    # The prefill restarts under the same engine id: a new process at a new endpoint.
    p2 = make_node("pre-id", "prefill", pod=pod, incarnation="boot-2")
    try:
        body = {"endpoint": p2.server.endpoint, "role": "prefill", "incarnation": "boot-2"}
        status, answer = call("PUT", f"{d.url}/v1/peers/pre-id", body)
        assert (status, answer["result"]) == (200, "added"), answer
        assert d.registry.incarnation("pre-id") == "boot-2"
        assert d.transport.removed, "the old incarnation's agent was torn down"
        metrics = d.server.metrics
        assert metrics.evictions_total.labels("evicted")._value.get() == 1
    finally:
        p2.server.stop()
        d.server.stop()


@pytest.fixture
def slow_peer() -> Iterator[MetadataPeer]:
    """A prefill engine's real metadata, served only `delay_s` after it is asked for."""
    p = make_node("pre-slow", "prefill")
    p.server.stop()
    peer = MetadataPeer()
    peer.payload = encode_metadata(p.server.engine.metadata)
    yield peer
    peer.close()


def test_a_batch_handshake_deadline_bounds_its_handshakes_not_the_worker_default(
    slow_peer: MetadataPeer,
) -> None:
    """`handshake_timeout_s` of a `PATCH /v1/peers` bounds that batch's metadata fetches
    (and NIXL adds) both ways: longer than the worker's default, and shorter. Without it,
    and on the single-peer route, the worker's default still holds."""
    d = make_node("dec-slow", "decode")
    add = {"engine_id": "pre-slow", "endpoint": slow_peer.endpoint, "role": "prefill"}
    try:
        slow_peer.delay_s = 1.5
        d.server.handshake_timeout_s = 0.5
        status, body = call("PATCH", f"{d.url}/v1/peers", {"add": [add]})
        assert status == 200 and body["results"][0]["status"] == 502, body  # type: ignore[index]
        assert "TimeoutError" in body["results"][0]["message"], body  # type: ignore[index]
        status, body = call(
            "PUT", f"{d.url}/v1/peers/pre-slow", {"endpoint": add["endpoint"], "role": "prefill"}
        )
        assert status == 502 and "TimeoutError" in str(body["message"]), body
        # A longer deadline than the worker's own: the slow peer is added.
        status, body = call("PATCH", f"{d.url}/v1/peers", {"add": [add], "handshake_timeout_s": 5})
        assert status == 200, body
        assert body["results"][0]["result"] == "added", body  # type: ignore[index]
        assert d.registry.engine_ids() == ["pre-slow"]
        call("DELETE", f"{d.url}/v1/peers/pre-slow")
        # A shorter one: the peer that answers in 1.5 s fails at 0.3 s, not at the
        # worker's 30 s (nor when the peer answers).
        d.server.handshake_timeout_s = 30
        t0 = time.monotonic()
        status, body = call(
            "PATCH", f"{d.url}/v1/peers", {"add": [add], "handshake_timeout_s": 0.3}
        )
        elapsed = time.monotonic() - t0
        assert status == 200 and body["results"][0]["status"] == 502, body  # type: ignore[index]
        assert "TimeoutError" in body["results"][0]["message"], body  # type: ignore[index]
        assert elapsed < 1.2, elapsed
        assert d.registry.engine_ids() == []
        state = call("GET", f"{d.url}/v1/state")[1]
        assert state["handshake_timeout_s"] == 30
    finally:
        d.server.stop()


@pytest.mark.parametrize("bad", [0, -1, 300.5, 1e400, "5", True])
def test_a_batch_handshake_deadline_out_of_bounds_is_refused_whole(
    pair: tuple[Node, Node], bad: object
) -> None:
    p, d = pair
    add = {"engine_id": "pre-1", "endpoint": p.server.endpoint, "role": "prefill"}
    raw = json.dumps({"add": [add], "handshake_timeout_s": bad}).replace("Infinity", "1e400")
    status, body = call("PATCH", f"{d.url}/v1/peers", raw=raw.encode())
    assert status == 400, body
    assert "handshake_timeout_s" in str(body["message"]), body
    assert d.registry.engine_ids() == []
    status, body = call("PATCH", f"{d.url}/v1/peers", {"add": [add], "handshake_timeout_s": 300})
    assert status == 200 and body["results"][0]["result"] == "added", body  # type: ignore[index]


def test_the_operator_sets_the_idle_ttl_and_the_state_reports_it(pair: tuple[Node, Node]) -> None:
    _, d = pair
    assert d.registry.idle_ttl_s == 0
    assert call("GET", f"{d.url}/v1/state")[1]["idle_ttl_s"] == 0
    assert call("PUT", f"{d.url}/v1/settings", {"idle_ttl_s": 30}, token=None)[0] == 401
    status, body = call("PUT", f"{d.url}/v1/settings", {"idle_ttl_s": 30})
    assert (status, body) == (200, {"idle_ttl_s": 30})
    assert d.registry.idle_ttl_s == 30
    assert call("GET", f"{d.url}/v1/state")[1]["idle_ttl_s"] == 30
    # A body that names nothing changes nothing; 0 turns the backstop off.
    assert call("PUT", f"{d.url}/v1/settings", {}) == (200, {"idle_ttl_s": 30})
    assert call("PUT", f"{d.url}/v1/settings", {"idle_ttl_s": 0}) == (200, {"idle_ttl_s": 0})
    assert d.registry.idle_ttl_s == 0
    for bad, fragment in (
        ({"idle_ttl_s": -1}, "idle_ttl_s must be 0..86400"),
        ({"idle_ttl_s": 86401}, "idle_ttl_s must be 0..86400"),
        ({"idle_ttl_s": "5"}, "$.idle_ttl_s"),
        ({"idle_ttl": 5}, "unknown field"),
    ):
        status, body = call("PUT", f"{d.url}/v1/settings", bad)
        assert status == 400 and fragment in str(body["message"]), (bad, body)
    assert d.registry.idle_ttl_s == 0


def test_the_state_is_not_sent_again_while_only_its_request_counters_move() -> None:
    """`GET /v1/state` carries an ETag; `If-None-Match` with it answers 304 and no body while
    nothing but the moving fields changed, and a full answer with a new tag once a peer is
    added. The operator's client, against this real control API, keeps its view on a 304 and
    reads a new one after the change."""
    p, d = make_node("pre-1", "prefill"), make_node("dec-1", "decode")
    try:

        def get(tag: str = "") -> tuple[int, str, bytes]:
            req = urllib.request.Request(f"{d.url}/v1/state")
            req.add_header("Authorization", f"Bearer {TOKEN}")
            if tag:
                req.add_header("If-None-Match", tag)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, resp.headers.get("ETag", ""), resp.read()
            except urllib.error.HTTPError as err:
                return err.code, err.headers.get("ETag", ""), err.read()

        status, tag, body = get()
        assert status == 200 and tag.startswith('"') and body
        assert get(tag)[:3] == (304, tag, b"")
        assert get(f'"other", W/{tag}')[0] == 304  # one of a list, weak form equal
        assert get('"other"')[0] == 200

        client = WorkerClient(None, token=TOKEN)

        async def reads() -> tuple[object, object, object]:
            try:
                first = await client.state(d.server.endpoint, 5.0)
                assert isinstance(first, WorkerView) and first.etag == tag
                kept = await client.state(d.server.endpoint, 5.0, first)
                peer = {"endpoint": p.server.endpoint, "role": "prefill"}
                added = call("PUT", f"{d.url}/v1/peers/pre-1", peer)
                assert added[0] == 200
                return first, kept, await client.state(d.server.endpoint, 5.0, first)
            finally:
                await client.close()

        first, kept, after = asyncio.run(reads())
        assert kept is first  # confirmed by a 304, not decoded again
        assert isinstance(after, WorkerView) and after.peers == {"pre-1"}
        assert after.etag not in ("", tag) and get(tag)[0] == 200
        assert get(after.etag)[0] == 304
    finally:
        p.server.stop()
        d.server.stop()


class _Spy:
    """An endpoint a request's parameters point at (an API client chose it): it records
    every request that reaches it and answers 401."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                spy.seen.append(bytes(self.headers) + self.rfile.read(length))
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._record()

            def do_POST(self) -> None:
                self._record()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_lazy_handshake_sends_no_credential_where_a_request_points() -> None:
    """The vLLM connector handshakes lazily with the endpoint a request's kv_transfer_params
    name (an API client chose it): a spy there learns nothing it could present elsewhere,
    through the lazy path (an introduction) or the operator's (a metadata fetch)."""
    d = make_node("dec-1", "decode", peer_token=TokenSource(value="the-peer-secret"))
    spy = _Spy()
    try:
        status, _ = d.server.introduce("pre-x", spy.endpoint, "prefill")
        assert status != 200
        status, _ = d.server.add_peer("pre-x", spy.endpoint, "prefill")
        assert status != 200
        assert spy.seen, "the spy was never asked"
        for request in spy.seen:
            assert b"the-peer-secret" not in request, request
        assert d.registry.engine_ids() == []
    finally:
        spy.close()
        d.server.stop()


def test_an_introduction_adds_both_sides_and_refuses_an_id_a_live_process_holds() -> None:
    peer = TokenSource(value="peer-secret")
    p = make_node("pre-1", "prefill", peer_token=peer, incarnation="p-inc")
    d = make_node("dec-1", "decode", peer_token=peer, incarnation="d-inc")
    imposter = make_node("dec-1", "decode", peer_token=peer, incarnation="other-inc")
    wrong = make_node("dec-2", "decode", peer_token=TokenSource(value="not-the-secret"))
    try:
        status, answer = d.server.introduce("pre-1", p.server.endpoint, "prefill")
        assert status == 200, answer
        assert d.registry.engine_ids() == ["pre-1"] and p.registry.engine_ids() == ["dec-1"]
        # Another process claiming dec-1 while dec-1 is held (healthy) takes nothing over.
        status, answer = imposter.server.introduce("pre-1", p.server.endpoint, "prefill")
        assert status != 200
        assert p.registry.incarnation("dec-1") == "d-inc"
        # Without the peer credential nothing is added.
        status, answer = wrong.server.introduce("pre-1", p.server.endpoint, "prefill")
        assert status != 200 and "dec-2" not in p.registry.engine_ids()
        # The answer must be the engine the request named.
        status, answer = d.server.introduce("pre-other", p.server.endpoint, "prefill")
        assert status == 409, answer
    finally:
        for node in (p, d, imposter, wrong):
            node.server.stop()


def test_an_engine_paired_by_the_operator_only_refuses_introductions() -> None:
    """Lazy handshakes are the vLLM connector's, without an operator: an engine that pairs
    through the operator only adds nobody who merely holds the peer credential."""
    peer = TokenSource(value="peer-secret")
    p = make_node("pre-1", "prefill", peer_token=peer, introductions=False)
    d = make_node("dec-1", "decode", peer_token=peer)
    try:
        status, answer = d.server.introduce("pre-1", p.server.endpoint, "prefill")
        assert status == 502 and "403" in str(answer), answer
        assert p.registry.engine_ids() == [] and d.registry.engine_ids() == []
        assert p.server.metrics.rejected_total.labels("introduction")._value.get() == 1
    finally:
        p.server.stop()
        d.server.stop()


def test_kv_both_engines_pair_with_each_other_and_with_either_role() -> None:
    """A kv_both engine takes either part: it pairs with another kv_both engine, and with a
    prefill or a decode as the operator names it; two prefills still never pair."""
    a, b = make_node("both-a", "both"), make_node("both-b", "both")
    p, p2 = make_node("pre-1", "prefill"), make_node("pre-2", "prefill")
    try:
        assert a.server.introduce("both-b", b.server.endpoint, "prefill")[0] == 200
        assert a.registry.engine_ids() == ["both-b"] and b.registry.engine_ids() == ["both-a"]
        assert p.server.add_peer("both-a", a.server.endpoint, "decode")[0] == 200
        assert a.server.add_peer("pre-1", p.server.endpoint, "prefill")[0] == 200
        status, answer = p.server.add_peer("pre-2", p2.server.endpoint, "prefill")
        assert status == 400 and "other role" in str(answer), answer
    finally:
        for node in (a, b, p, p2):
            node.server.stop()
