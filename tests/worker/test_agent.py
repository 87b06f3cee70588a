"""The control API: credentials, bad bodies, handshakes through a peer's metadata, eviction.

Real ControlServers (real aiohttp, real registry) on loopback, with fake transports. The
test acts as the operator (`OPERATOR`: admin routes signed with the operator's key for the
challenge each engine answers, peer adds given the tickets the operator would mint) and as
a client of the traffic routes (the client token)."""

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
from typing import Any

import msgspec
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtopo.localkeys import UNUSABLE_TICKET, ControlClient
from kvtopo_operator.model import WorkerView
from kvtopo_operator.workers import WorkerClient
from kvtopo_worker.agent import FROM_HEADER, INCARNATION_HEADER, ControlServer, LocalEngine
from kvtopo_worker.credentials import TokenSource
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    CompatInfo,
    EngineMetadata,
    Envelope,
    Introduction,
    PodIdentity,
    compat_hash,
    encode_metadata,
)
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.serving import ServerLimits
from kvtopo_worker.signing import (
    CallerKey,
    PrivateKeys,
    PublicKeys,
    header_value,
    new_private_key,
    parse_challenge,
    ticket_authorization,
)
from kvtopo_worker.traffic import EngineTraffic
from tests.worker.fakes import FakeTransport, MetadataPeer

OPERATOR_KEY = new_private_key()
OPERATOR_KEYS = PublicKeys(keys=[OPERATOR_KEY.public_key()])  # what engines trust by default
CLIENT_TOKEN = "client-t0ken-for-tests"  # the traffic routes' bearer token
OPERATOR = ControlClient(CallerKey("operator", PrivateKeys(keys=[OPERATOR_KEY])), CLIENT_TOKEN)
SIGNED = "<the credential the route takes>"  # call(): the default `auth`

# The engine serving at each endpoint (engine id, incarnation): whose ticket a peer add sent
# there carries. Filled by make_node.
_engines: dict[str, tuple[str, str]] = {}


@dataclass
class Node:
    server: ControlServer
    transport: FakeTransport
    registry: EngineRegistry
    traffic: EngineTraffic

    @property
    def url(self) -> str:
        return f"http://{self.server.endpoint}"


def make_node(
    engine_id: str,
    role: str,
    model_id: str = "m",
    *,
    operator_keys: PublicKeys | None = OPERATOR_KEYS,
    client_token: str | TokenSource | None = CLIENT_TOKEN,
    peer_token: TokenSource | None = None,
    pod: PodIdentity | None = None,
    incarnation: str = "",
    introductions: bool | None = None,
    port: int = 0,
    limits: ServerLimits | None = None,
) -> Node:
    """An in-process worker control API over a fake transport, with the traffic routes
    (`EngineTraffic`, no engine behind them). `operator_keys`: the operator public keys it
    trusts (None: no operator drives it); `client_token`: its traffic routes' token (None:
    closed); `peer_token`: the lazy handshakes' shared token; `introductions` (default: on
    when it has a peer token): whether it takes lazy handshakes."""
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
        operator_keys=operator_keys,
        client_token=(
            TokenSource(value=client_token) if isinstance(client_token, str) else client_token
        ),
        peer_token=peer_token,
        metrics=WorkerMetrics(),
        introductions=peer_token is not None if introductions is None else introductions,
        port=port,
        limits=limits,
    )
    traffic = EngineTraffic()
    traffic.add_routes(server.app)
    server.start()
    serving(server)
    return Node(server, transport, registry, traffic)


def serving(server: ControlServer) -> None:
    """Notes that `server` (started) serves at its endpoint: the challenge `OPERATOR` held
    for an earlier engine there is stale, and peer adds sent there get tickets minted for
    this engine."""
    OPERATOR.challenges.pop(server.endpoint, None)
    _engines[server.endpoint] = (server.engine.engine_id, server.engine.metadata.incarnation)


@pytest.fixture
def pair() -> Iterator[tuple[Node, Node]]:
    p, d = make_node("pre-1", "prefill"), make_node("dec-1", "decode")
    yield p, d
    p.server.stop()
    d.server.stop()


def _ticket(client: ControlClient, endpoint: str, fetcher: tuple[str, str]) -> str:
    """The ticket the operator mints for `fetcher` to fetch the metadata at `endpoint`: an
    engine of this test's (its challenge), or a crafted server's (a ticket opening nothing:
    what `ControlClient` gives an endpoint that answers no challenge)."""
    if endpoint not in _engines:
        return UNUSABLE_TICKET
    return client.ticket(endpoint, fetcher)


def with_tickets(
    client: ControlClient, endpoint: str, method: str, path: str, body: object
) -> object:
    """`body` with a ticket in each peer add (`PUT /v1/peers/{id}`, `PATCH /v1/peers`
    adds) that names an endpoint and no ticket, minted for the engine at `endpoint`."""
    fetcher = _engines.get(endpoint, ("", ""))

    def add(item: object) -> object:
        if isinstance(item, dict) and "endpoint" in item and "ticket" not in item:
            return {**item, "ticket": _ticket(client, str(item["endpoint"]), fetcher)}
        return item

    if method == "PUT" and path.startswith("/v1/peers/"):
        return add(body)
    if method == "PATCH" and path == "/v1/peers" and isinstance(body, dict):
        adds = body.get("add")
        if isinstance(adds, list):
            return {**body, "add": [add(item) for item in adds]}
    return body


def send(
    method: str, url: str, data: bytes | None, headers: dict[str, str]
) -> tuple[int, bytes, dict[str, str]]:
    """One plain HTTP request: status, body and headers of the answer."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def call(
    method: str,
    url: str,
    body: object = None,
    auth: str | None = SIGNED,
    raw: bytes | None = None,
    client: ControlClient = OPERATOR,
) -> tuple[int, Any]:
    """A call and its JSON answer ({} when it is not JSON). `auth`: SIGNED sends the
    credential the route takes, as `client` does (admin routes signed with the operator's
    key, a peer add given a ticket; traffic routes the client token; peer routes none);
    another string is sent as the `Authorization` header as it is; None sends none."""
    endpoint, _, rest = url.removeprefix("http://").partition("/")
    path = "/" + rest
    if raw is None and auth == SIGNED:
        body = with_tickets(client, endpoint, method, path, body)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if auth == SIGNED:
        status, answer = client.call_raw(method, endpoint, path, data)
    else:
        headers = {} if auth is None else {"Authorization": auth}
        status, answer, _ = send(method, url, data, headers)
    try:
        return status, json.loads(answer or b"{}")
    except ValueError:
        return status, {}


def bearer(token: str) -> str:
    return f"Bearer {token}"


def signature(
    url: str, method: str = "GET", body: bytes = b"", client: ControlClient = OPERATOR
) -> str:
    """`client`'s signature of one call to `url` (for the engine whose challenge it holds
    for that endpoint), to send as it is."""
    endpoint, _, rest = url.removeprefix("http://").partition("/")
    challenge = client.challenge(endpoint)
    assert challenge is not None
    return client.caller.authorization(challenge, method, "/" + rest, endpoint, body)


def test_routes_need_their_credential_except_health_and_metrics(pair: tuple[Node, Node]) -> None:
    """No bearer token opens an admin route (401 with the engine's challenge); the client
    token opens only the traffic routes; nothing but a ticket (or, where lazy handshakes
    are on, the peer token) reads the metadata. An admin call without any credential is
    answered with the challenge and counted as no fault; a wrong credential is counted."""
    p, _ = pair
    admin = [
        ("GET", "/v1/state"),
        ("PUT", "/v1/peers/x"),
        ("DELETE", "/v1/peers/x"),
        ("PATCH", "/v1/peers"),
        ("PUT", "/v1/settings"),
    ]
    counted = 0
    for method, path in admin:
        for auth in (None, bearer(CLIENT_TOKEN), bearer("wrong")):
            status, body, headers = send(
                method, p.url + path, None, {} if auth is None else {"Authorization": auth}
            )
            assert status == 401, (method, path, auth, body)
            challenge = parse_challenge(headers.get("WWW-Authenticate", ""))
            assert challenge is not None and challenge.engine_key == p.server.guard.key.public
            assert b"no bearer token opens it" in body
            counted += auth is not None
    assert p.server.metrics.rejected_total.labels("control_auth")._value.get() == counted
    for method, path in [("GET", "/v1/metadata"), ("GET", "/v1/finished")]:
        for auth in (None, bearer("wrong")):
            assert call(method, p.url + path, auth=auth)[0] == 401
            counted += 1
    assert call("GET", p.url + "/v1/metadata", auth=bearer(CLIENT_TOKEN))[0] == 401
    counted += 1
    assert call("GET", p.url + "/v1/finished", auth=bearer(CLIENT_TOKEN)) == (200, [])
    assert call("GET", p.url + "/v1/state")[0] == 200  # signed by the operator's key
    assert urllib.request.urlopen(p.url + "/healthz", timeout=5).status == 200
    metrics = urllib.request.urlopen(p.url + "/metrics", timeout=5).read().decode()
    line = f'kvtopo_worker_rejected_messages_total{{source="control_auth"}} {counted:.1f}'
    assert line in metrics, metrics
    # Each refusal counted is a malformed message in the state's failures.
    assert call("GET", p.url + "/v1/state")[1]["failures"] == {"malformed_message": counted}


def test_a_signed_call_opens_its_route_at_its_engine_once(pair: tuple[Node, Node]) -> None:
    """A signature the operator made for one call to one engine, seen by a spy (or sent to
    the wrong engine), opens nothing else: not the same call again, not another engine, not
    another route, method or body, and not the engine under another endpoint name."""
    p, d = pair
    state = f"{p.url}/v1/state"
    header = signature(state)
    assert call("GET", state, auth=header)[0] == 200
    assert call("GET", state, auth=header)[0] == 401  # replayed: the nonce was used
    # Made for p, presented to d (another engine key, and another endpoint).
    status, body = call("GET", f"{d.url}/v1/state", auth=signature(state))
    assert status == 401 and "signed by the operator's key" in body["message"], body
    # Made for one request of p's, presented with another.
    settings_body = json.dumps({"idle_ttl_s": 5}).encode()
    header = signature(f"{p.url}/v1/settings", "PUT", settings_body)
    for method, path, raw in (
        ("PUT", "/v1/settings", json.dumps({"idle_ttl_s": 6}).encode()),  # another body
        ("PATCH", "/v1/peers", settings_body),  # another route
        ("DELETE", "/v1/peers/pre-2", None),
    ):
        assert call(method, p.url + path, auth=header, raw=raw)[0] == 401, (method, path)
    assert p.registry.idle_ttl_s == 0
    # Made for p under another address of its port (the engine answers at its own only).
    port = p.server.endpoint.rsplit(":", 1)[1]
    challenge = OPERATOR.challenge(p.server.endpoint)
    assert challenge is not None
    elsewhere = OPERATOR.caller.authorization(challenge, "GET", "/v1/state", f"10.9.9.9:{port}")
    assert call("GET", state, auth=elsewhere)[0] == 401
    # Signed with a key the engine does not trust.
    stranger = ControlClient(CallerKey("operator", PrivateKeys(keys=[new_private_key()])), "")
    assert call("GET", state, auth=signature(state, client=stranger))[0] == 401
    # The request each signature was made for still passes once.
    assert call("PUT", f"{p.url}/v1/settings", auth=header, raw=settings_body) == (
        200,
        {"idle_ttl_s": 5},
    )
    # At p: the replay, 3 altered requests and the other address were bad signatures; the
    # stranger's key is one p does not know (counted apart: a key file not rotated yet looks
    # the same); at d, the signature for p's key is a stale one (answered with the
    # challenge, no fault).
    assert p.server.metrics.rejected_total.labels("control_auth")._value.get() == 5
    assert p.server.metrics.rejected_total.labels("unknown_key")._value.get() == 1
    assert d.server.metrics.rejected_total.labels("control_auth")._value.get() == 0


def test_a_signature_for_the_previous_process_at_an_endpoint_is_asked_again() -> None:
    """An engine restarted at the same address has a new key: the operator's signature for
    the old one is answered 401 with the new challenge (no fault counted), and signed for
    it the call goes through."""
    client = ControlClient(CallerKey("operator", PrivateKeys(keys=[OPERATOR_KEY])), "")
    first = make_node("pre-restart", "prefill", incarnation="boot-1")
    endpoint, port = first.server.endpoint, first.server.port
    try:
        assert client.call("GET", endpoint, "/v1/state")[0] == 200
        old = client.challenges[endpoint]
    finally:
        first.server.stop()
    second = make_node("pre-restart", "prefill", incarnation="boot-2", port=port)
    try:
        assert second.server.endpoint == endpoint
        status, state = client.call("GET", endpoint, "/v1/state")
        assert (status, state["incarnation"]) == (200, "boot-2"), state
        assert client.challenges[endpoint] != old
        assert client.challenges[endpoint].incarnation == "boot-2"
        assert second.server.metrics.rejected_total.labels("control_auth")._value.get() == 0
    finally:
        second.server.stop()


def fetch_metadata(
    node: Node, ticket: str, fetcher: str, incarnation: str = "", target: str = ""
) -> int:
    """`GET /v1/metadata` at `node` signed with `ticket`, from `fetcher` (that
    incarnation), made for `target` (default: the node's endpoint): the status."""
    path = "/v1/metadata?rank=0"
    auth = ticket_authorization(ticket, "GET", path, target or node.server.endpoint)
    headers = {
        "Authorization": auth,
        FROM_HEADER: header_value(fetcher),
        INCARNATION_HEADER: header_value(incarnation),
    }
    return send("GET", node.url + path, None, headers)[0]


def test_a_ticket_opens_one_engines_metadata_for_the_engine_it_was_minted_for(
    pair: tuple[Node, Node],
) -> None:
    p, d = pair
    ticket = OPERATOR.ticket(p.server.endpoint, ("dec-1", "inc-1"))
    assert fetch_metadata(p, ticket, "dec-2", "inc-1") == 401  # another engine shows it
    assert fetch_metadata(p, ticket, "dec-1", "inc-0") == 401  # another process of dec-1
    assert fetch_metadata(d, ticket, "dec-1", "inc-1") == 401  # at another engine
    assert fetch_metadata(p, ticket, "dec-1", "inc-1", target="10.9.9.9:1") == 401
    assert fetch_metadata(p, UNUSABLE_TICKET, "dec-1", "inc-1") == 401
    assert fetch_metadata(p, ticket, "dec-1", "inc-1") == 200
    # Neither a bearer token nor the operator's call signature reads the metadata.
    meta = f"{p.url}/v1/metadata"
    for auth in (bearer(CLIENT_TOKEN), signature(meta)):
        assert call("GET", meta, auth=auth)[0] == 401
    assert OPERATOR.metadata(p.server.endpoint) == encode_metadata(p.server.engine.metadata)
    assert p.server.metrics.authenticated_total.labels("ticket", "current")._value.get() == 2


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


def test_a_ticket_the_peer_does_not_take_fails_the_handshake(pair: tuple[Node, Node]) -> None:
    """The operator mints each peer add's ticket for the engine it sends the add to: a
    ticket minted for another engine, or by an operator the peer does not trust, gets the
    peer's 401 and adds nothing."""
    p, d = pair
    body = {"endpoint": p.server.endpoint, "role": "prefill"}
    for_another = OPERATOR.ticket(p.server.endpoint, ("dec-2", ""))
    status, answer = call("PUT", f"{d.url}/v1/peers/pre-1", {**body, "ticket": for_another})
    assert status == 502 and "HTTP 401" in str(answer["message"]), answer
    other = make_node(
        "pre-t", "prefill", operator_keys=PublicKeys(keys=[new_private_key().public_key()])
    )
    try:
        status, answer = call(
            "PUT", f"{d.url}/v1/peers/pre-t", {"endpoint": other.server.endpoint, "role": "prefill"}
        )
        assert status == 502 and "HTTP 401" in str(answer["message"]), answer
    finally:
        other.server.stop()
    assert d.registry.engine_ids() == []
    # A malformed ticket is the request's fault; no ticket at all cannot fetch anything.
    status, answer = call("PUT", f"{d.url}/v1/peers/pre-1", {**body, "ticket": "x"})
    assert status == 400 and "ticket" in str(answer["message"]), answer
    status, answer = call("PUT", f"{d.url}/v1/peers/pre-1", {**body, "ticket": ""})
    assert status == 502 and "no ticket" in str(answer["message"]), answer
    assert call("PUT", f"{d.url}/v1/peers/pre-1", body)[1]["result"] == "added"


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
    for path in (b"/v1/state", b"/v1/finished", b"/v1/metadata"):
        for raw in (
            "Bearer t\u00f6ken".encode(),
            b"Bearer \xff\xfe\x80",
            "KVTopo-Sig role=operator,kid=\u00e9,ts=1,nonce=\u00e9,mac=x".encode(),
            b"KVTopo-Ticket kid=\xff\xfe,ts=1,nonce=\x80,mac=\xff",
        ):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(
                    b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"KVTopo-From: \xff\r\nAuthorization: " + raw + b"\r\n\r\n"
                )
                answer = b""
                while chunk := s.recv(4096):
                    answer += chunk
            assert answer.split(b"\r\n", 1)[0].split()[1] == b"401", (path, answer[:200])


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
        # A shorter one: a peer that answers in 10 s fails at 0.3 s, not at the worker's
        # 30 s (nor when the peer answers). The margin is wide: a loaded CI machine once
        # took 1.8 s here with a peer that answered in 1.5 s.
        d.server.handshake_timeout_s = 30
        slow_peer.delay_s = 10
        t0 = time.monotonic()
        status, body = call(
            "PATCH", f"{d.url}/v1/peers", {"add": [add], "handshake_timeout_s": 0.3}
        )
        elapsed = time.monotonic() - t0
        assert status == 200 and body["results"][0]["status"] == 502, body  # type: ignore[index]
        assert "TimeoutError" in body["results"][0]["message"], body  # type: ignore[index]
        assert elapsed < 5, elapsed
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
    assert call("PUT", f"{d.url}/v1/settings", {"idle_ttl_s": 30}, auth=None)[0] == 401
    assert call("PUT", f"{d.url}/v1/settings", {"idle_ttl_s": 30}, bearer(CLIENT_TOKEN))[0] == 401
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
            req.add_header("Authorization", signature(f"{d.url}/v1/state"))
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

        client = WorkerClient(None, keys=PrivateKeys(keys=[OPERATOR_KEY]))

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
    every request that reaches it (headers and body; `bodies`: the bodies alone) and
    answers 401, or `status` with `answer`."""

    def __init__(self, status: int = 401, answer: bytes = b"") -> None:
        self.seen: list[bytes] = []
        self.bodies: list[bytes] = []
        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                spy.seen.append(bytes(self.headers) + body)
                spy.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/msgpack")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

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
        # The operator's add names the spy with a ticket: the fetch is signed with it, and
        # the ticket itself is never sent.
        ticket = "a" * 16 + ":" + "5ec7e7" * 10 + "abcd"
        body = {"endpoint": spy.endpoint, "role": "prefill", "ticket": ticket}
        assert call("PUT", f"{d.url}/v1/peers/pre-x", body)[0] == 502
        assert len(spy.seen) == 3, "the spy was not asked each time"
        assert b"KVTopo-Ticket" in spy.seen[2]
        for request in spy.seen:
            assert b"the-peer-secret" not in request, request
            assert ticket.split(":")[1].encode() not in request, request
        assert d.registry.engine_ids() == []
    finally:
        spy.close()
        d.server.stop()


def test_a_stranger_answering_an_introduction_gets_no_metadata_and_adds_nothing() -> None:
    """Issue 55, defects 1 and 2: a stranger a request named, holding no peer credential,
    answers the introduction with a well-formed one of a real engine's (its id, its
    metadata). The answer carries no proof of the credential: the decode adds nothing,
    and the stranger got only the hello, which carries no metadata (metadata opens the
    engine's KV memory to whoever holds it)."""
    peer = TokenSource(value="peer-secret")
    p = make_node("pre-1", "prefill", peer_token=peer, incarnation="p-inc")
    d = make_node("dec-1", "decode", peer_token=peer, incarnation="d-inc")
    forged = msgspec.msgpack.encode(
        Introduction(
            engine_id="pre-1",
            role="prefill",
            ranks=[encode_metadata(p.server.engine.metadata)],
        )
    )
    spy = _Spy(200, forged)
    try:
        status, answer = d.server.introduce("pre-1", spy.endpoint, "prefill")
        assert status == 502 and "proof" in str(answer), answer
        assert d.registry.engine_ids() == []
        assert len(spy.bodies) == 1, "more than the hello reached the stranger"
        hello = msgspec.msgpack.decode(spy.bodies[0], type=Introduction)
        assert hello.engine_id == "dec-1" and hello.ranks == [], hello
        # The engine itself proves the credential: the pair is made.
        assert d.server.introduce("pre-1", p.server.endpoint, "prefill")[0] == 200
        assert p.registry.engine_ids() == ["dec-1"] and d.registry.engine_ids() == ["pre-1"]
    finally:
        spy.close()
        for node in (p, d):
            node.server.stop()


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


def test_a_request_never_moves_a_held_healthy_peer_and_dials_only_allowed_networks() -> None:
    """Issue 55, defect 1 (the initiating side): a lazy handshake's endpoint and incarnation
    are a request's word. A peer held healthy is re-checked where it proved itself, and
    while it answers there no other endpoint is dialled; once it is gone from there, the
    request's endpoint may be tried. A peer the operator paired is not moved at all, and
    only `introduction_networks` are dialled."""
    peer = TokenSource(value="peer-secret")
    p = make_node("pre-1", "prefill", peer_token=peer, incarnation="p-inc")
    other = make_node("pre-1", "prefill", peer_token=peer, incarnation="other-inc")
    d = make_node("dec-1", "decode", peer_token=peer, incarnation="d-inc")
    d2 = make_node("dec-2", "decode", peer_token=peer, incarnation="d2-inc")
    try:
        assert d.server.introduce("pre-1", p.server.endpoint, "prefill")[0] == 200
        status, answer = d.server.introduce("pre-1", other.server.endpoint, "prefill", "x")
        assert status == 409 and "held live at" in str(answer), answer
        assert d.registry.incarnation("pre-1") == "p-inc"
        assert other.registry.engine_ids() == [], "the other endpoint was introduced to"
        # Outside the allowed networks: refused before any dial.
        status, answer = d.server.introduce("pre-9", "203.0.113.7:80", "prefill")
        assert status == 403 and "lazy_peer_networks" in str(answer), answer
        # Paired by the operator (not through an introduction): a request does not move it.
        assert d2.server.add_peer("pre-1", p.server.endpoint, "prefill")[0] == 200
        status, answer = d2.server.introduce("pre-1", other.server.endpoint, "prefill")
        assert status == 409 and "operator paired" in str(answer), answer
        # The process held is gone from where it proved itself: the request's endpoint is
        # tried, and the engine's new process there is added in the old one's place.
        p.server.stop()
        status, answer = d.server.introduce("pre-1", other.server.endpoint, "prefill")
        assert status == 200, answer
        assert d.registry.incarnation("pre-1") == "other-inc"
    finally:
        for node in (p, other, d, d2):
            if node.server.loop is not None and not node.server.loop.is_closed():
                node.server.stop()
    with pytest.raises(ValueError):
        ControlServer(
            engine=d.server.engine,
            registry=EngineRegistry(remove_agent=lambda _: None),
            transport=FakeTransport(agent_name="x"),
            operator_keys=OPERATOR_KEYS,
            metrics=WorkerMetrics(),
            introduction_networks=["not-a-network"],
        )


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
    """A kv_both engine takes either part: it pairs with another kv_both engine (lazily),
    and with a prefill or a decode as the operator names it; two prefills still never
    pair."""
    peer = TokenSource(value="peer-secret")
    a, b = (
        make_node("both-a", "both", peer_token=peer),
        make_node("both-b", "both", peer_token=peer),
    )
    p, p2 = make_node("pre-1", "prefill"), make_node("pre-2", "prefill")
    try:
        assert a.server.introduce("both-b", b.server.endpoint, "prefill")[0] == 200
        assert a.registry.engine_ids() == ["both-b"] and b.registry.engine_ids() == ["both-a"]
        status, answer = call(
            "PUT", f"{p.url}/v1/peers/both-a", {"endpoint": a.server.endpoint, "role": "decode"}
        )
        assert (status, answer["result"]) == (200, "added"), answer
        status, answer = call(
            "PUT", f"{a.url}/v1/peers/pre-1", {"endpoint": p.server.endpoint, "role": "prefill"}
        )
        assert (status, answer["result"]) == (200, "added"), answer
        status, answer = call(
            "PUT", f"{p.url}/v1/peers/pre-2", {"endpoint": p2.server.endpoint, "role": "prefill"}
        )
        assert status == 400 and "other role" in str(answer), answer
        # From another thread (the connector's lazy path) the same rule holds.
        status, answer = p.server.add_peer("pre-2", p2.server.endpoint, "prefill")
        assert status == 400 and "other role" in str(answer), answer
    finally:
        for node in (a, b, p, p2):
            node.server.stop()


def _wait(probe: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.05)


def _status_line(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_idle_silent_slow_and_oversized_clients_cannot_exhaust_the_control_api() -> None:
    """Issue 55, defect 7: under aiohttp's defaults (keep-alive 3,630 s, no head or body
    deadline, no connection cap) 2,154 idle connections used up a prefill's descriptors and
    the operator's calls timed out; a `Content-Length: 2000000` with a 10 KB body stayed
    open until the client gave up. Now: a cap per source and in all, a head deadline, a body
    deadline, Content-Length checked first, and a short keep-alive."""
    limits = ServerLimits(
        max_connections=40, max_per_source=16, head_s=1.0, body_s=1.0, keepalive_s=1.0
    )
    node = make_node("pre-cap", "prefill", limits=limits)
    conns = node.server.connections
    host, port = "127.0.0.1", node.server.port
    flood: list[socket.socket] = []
    try:
        for _ in range(100):  # idle connections from one source
            flood.append(socket.create_connection((host, port), source_address=("127.0.0.2", 0)))
        _wait(lambda: conns.refused >= 84, 5, "84 connections refused")
        assert conns.by_source.get("127.0.0.2", 0) <= 16
        # Another source is served meanwhile.
        assert send("GET", node.url + "/healthz", None, {})[0] == 200
        # The silent ones are closed at the head deadline.
        _wait(lambda: "127.0.0.2" not in conns.by_source, 5, "the silent connections closed")
        # A body that does not arrive in time: 408; one announced too large: 413 at once.
        with socket.create_connection((host, port)) as slow:
            slow.sendall(
                b"PUT /v1/settings HTTP/1.1\r\nHost: x\r\nContent-Length: 500000\r\n\r\n"
                + b"x" * 10_000
            )
            assert b" 408 " in _status_line(slow, 5)
        with socket.create_connection((host, port)) as huge:
            huge.sendall(
                b"PUT /v1/settings HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"
                + b"x" * 10_000
            )
            assert b" 413 " in _status_line(huge, 2)
        # An idle keep-alive connection is closed after keepalive_s.
        with socket.create_connection((host, port)) as kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 200 " in _status_line(kept, 2)
            kept.settimeout(5)
            started = time.monotonic()
            while kept.recv(4096):
                pass
            assert time.monotonic() - started < 4
        refused = node.server.metrics.connections_refused_total
        assert refused.labels("per_source")._value.get() >= 84
        assert refused.labels("head_timeout")._value.get() >= 1
    finally:
        for sock in flood:
            sock.close()
        node.server.stop()
