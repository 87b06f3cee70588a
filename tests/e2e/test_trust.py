"""What a pod author can make the operator (and its workers) do: nothing outside the pod.

On a real API server with real workers: pods whose `kvtopo.dev/control-endpoint` annotation
points elsewhere (paths, queries, fragments, userinfo, foreign hosts, IPv6 forms) are
refused, reported and never dialled, which a sink HTTP server listening at those places
proves by receiving no request at all; a pod that claims another pod's IP is not acted on
(the worker there reports another pod's identity); a worker asked to fetch a peer's
metadata from such an endpoint refuses; a pod whose IP is IPv6 is reached at its
bracketed address; and what the operator sends a selected pod's endpoint (a spy) opens
nothing at any other engine.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.cluster.kube import CONTROL_PORT, create_engine_pod, loopback_pod_ip, mark_pod_ready
from tests.e2e.env import Env, peers, ready_status

pytestmark = pytest.mark.nixl


@dataclass
class Sink:
    """HTTP servers that record every request they get (and answer 200 to all)."""

    port: int = 0
    port6: int = 0
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, auth)
    servers: list[http.server.ThreadingHTTPServer] = field(default_factory=list)

    def start(self) -> None:
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                auth = self.headers.get("Authorization", "")
                sink.requests.append((self.command, self.path, auth))
                # A redirect to a place of the sink's own: a client following it would
                # show up as a second request.
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{sink.port}/redirected")
                self.end_headers()
                self.wfile.write(b"sink")

            do_GET = do_PUT = do_PATCH = do_DELETE = do_POST = _record  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        class Server6(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6

        v4 = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        v6 = Server6(("::1", 0), Handler)
        self.port, self.port6 = v4.server_address[1], v6.server_address[1]
        for server in (v4, v6):
            self.servers.append(server)
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink()
    s.start()
    try:
        yield s
    finally:
        s.stop()


def engine_of(st: dict[str, Any], pod: str) -> dict[str, Any] | None:
    return next((e for e in st.get("engines", []) if e["pod"] == pod), None)


def test_endpoints_not_the_pods_are_refused_and_never_dialled(env: Env, sink: Sink) -> None:
    hostile = {
        "foreign-host": f"127.0.0.1:{sink.port}",
        "path": f"127.0.0.1:{sink.port}/latest/meta-data/iam/security-credentials/#:80",
        "query": f"127.0.0.1:{sink.port}?x=:80",
        "fragment": f"127.0.0.1:{sink.port}#:80",
        "userinfo": f"user@127.0.0.1:{sink.port}",
        "hostname": f"localhost:{sink.port}",
        "ipv6-bracketed": f"[::1]:{sink.port6}",
        "ipv6-bare": f"::1:{sink.port6}",
        "ipv6-mapped": f"[::ffff:127.0.0.1]:{sink.port}",
        "metadata-service": "169.254.169.254:80",
    }
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    for i, annotation in enumerate(hostile.values()):
        name = f"evil-{i}"
        role = "decode" if i % 2 else "prefill"
        create_engine_pod(
            env.cluster, env.namespace, name, role, {"version": "v1"}, annotation=annotation
        )
        mark_pod_ready(env.cluster, env.namespace, name, [loopback_pod_ip()])
    env.topology()
    env.start_operator()
    names = [f"evil-{i}" for i in range(len(hostile))]
    st = env.wait(
        "every hostile pod reported as refused, the real pair connected",
        lambda: (
            (s := env.status())
            and all(
                (e := engine_of(s, n)) is not None
                and e["state"] == "Failed"
                and e["message"].startswith("refused control-endpoint annotation")
                for n in names
            )
            and s["summary"]["pairs"] == "1/1"
            and s
        ),
    )
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "EndpointRefused")

    def refused_events() -> str:
        # Events are posted off the reconcile path: shortly after the status says so.
        out: str = env.cluster.kubectl(
            "get", "events", "-n", env.namespace, "--field-selector", "reason=EndpointRefused"
        ).stdout
        return out if all(n in out for n in names) else ""

    events = env.wait("an EndpointRefused Event for each pod", refused_events)
    assert all(n in events for n in names), events
    # The real pair is untouched by its hostile neighbours.
    p0, d0 = env.workers["p0"], env.workers["d0"]
    assert peers(p0) == {d0.engine_id} and peers(d0) == {p0.engine_id}
    # Many more rounds (a deletion, its grace, the eviction): still nothing reaches the sink.
    env.delete_pod("d0")
    env.wait("d0 evicted from p0", lambda: peers(p0) == set(), timeout=30)
    env.wait(
        "the status shows d0 evicted",
        lambda: any(
            e["engineId"] == d0.engine_id and e["state"] == "Evicted"
            for e in env.status().get("engines", [])
        ),
    )
    assert sink.requests == [], sink.requests


def test_a_worker_refuses_to_fetch_from_an_endpoint_that_is_not_ip_port(
    env: Env, sink: Sink
) -> None:
    """The operator is not the only one told where to dial: workers apply the same rule to
    every peer endpoint they are given, before any request is made."""
    w = env.pod("d0", "decode", env.worker("decode"))
    for endpoint in (
        f"127.0.0.1:{sink.port}/x#",
        f"127.0.0.1:{sink.port}?a=b",
        f"user@127.0.0.1:{sink.port}",
        f"localhost:{sink.port}",
        f"::1:{sink.port6}",
        "169.254.169.254:80",
    ):
        status, body = w.call("PUT", "/v1/peers/p-evil", {"endpoint": endpoint, "role": "prefill"})
        assert status == 400 and "endpoint refused" in body["message"], (endpoint, body)
    assert sink.requests == []
    # A well-formed endpoint that is not a worker (the sink) is dialled once: its redirect is
    # not followed, and the handshake fails saying so.
    status, body = w.call(
        "PUT", "/v1/peers/p-evil", {"endpoint": f"127.0.0.1:{sink.port}", "role": "prefill"}
    )
    assert status == 502 and "HTTP 302" in body["message"], body
    # (The test's own client, acting as the operator, first asked the sink for its challenge
    # to mint the add's ticket: one unsigned state read, its redirect not followed either.)
    fetched = [(m, p) for m, p, _ in sink.requests if p != "/v1/state"]
    assert fetched == [("GET", "/v1/metadata?rank=0")], sink.requests


def test_a_pod_claiming_another_pods_ip_is_not_acted_on(env: Env) -> None:
    p0 = env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    # "impostor" is a decode pod whose IP is p0's: the worker there reports p0's identity.
    p0_ip = env.identities["p0"][env.identities["p0"].index("--host") + 1]
    create_engine_pod(env.cluster, env.namespace, "impostor", "decode", {"version": "v1"})
    mark_pod_ready(env.cluster, env.namespace, "impostor", [p0_ip])
    env.topology()
    env.start_operator()
    st = env.wait(
        "the impostor reported, the real pair connected",
        lambda: (
            (s := env.status())
            and (e := engine_of(s, "impostor")) is not None
            and e["state"] == "Failed"
            and "is not this pod's" in e["message"]
            and s["summary"]["pairs"] == "1/1"
            and s
        ),
    )
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "IdentityMismatch", degraded
    assert peers(p0) == {env.workers["d0"].engine_id}  # never told to pair with itself


def test_an_ipv6_pod_is_reached_at_its_bracketed_address(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    uid = create_engine_pod(
        env.cluster, env.namespace, "d6", "decode", {"version": "v1"}, annotation=str(port)
    )
    identity = ["--host", "::1", "--port", str(port)]
    identity += ["--pod-namespace", env.namespace, "--pod-name", "d6", "--pod-uid", uid]
    d6 = env.worker("decode")(identity)
    env.workers["d6"] = d6
    assert d6.endpoint == f"[::1]:{port}"
    mark_pod_ready(env.cluster, env.namespace, "d6", ["::1"])
    env.topology()
    env.start_operator()
    st = env.wait(
        "the IPv6 engine connected",
        lambda: (s := env.status()) and ready_status(s) == "True" and s,
    )
    e = engine_of(st, "d6")
    assert e is not None and e["endpoint"] == f"[::1]:{port}" and e["state"] == "Connected"
    assert peers(env.workers["p0"]) == {d6.engine_id}


@dataclass
class Spy:
    """A selected pod's endpoint that is no worker: it answers as an engine would, 401 with a
    challenge naming its own pod's uid (and, to make the most of what it gets, claiming the
    victim engine's public key), records the `Authorization` of every request the operator
    sends it, and answers a signed one 500."""

    ip: str
    victim: str  # the victim worker's endpoint, whose challenge the spy copies
    uid: str = ""
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, auth)
    server: http.server.ThreadingHTTPServer | None = None

    def challenge(self) -> str:
        """The victim's challenge with the spy's own pod uid ("" when the victim gives none)."""
        import base64
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(f"http://{self.victim}/v1/state", timeout=5)
        except urllib.error.HTTPError as err:
            header = err.headers.get("WWW-Authenticate", "")
        else:
            return ""
        uid = base64.urlsafe_b64encode(self.uid.encode()).rstrip(b"=").decode()
        return ",".join(
            f"uid={uid}" if part.startswith("uid=") else part for part in header.split(",")
        )

    def start(self) -> None:
        spy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                auth = self.headers.get("Authorization", "")
                spy.seen.append((self.command, self.path, auth))
                self.send_response(500 if auth else 401)
                if not auth and (challenge := spy.challenge()):
                    self.send_header("WWW-Authenticate", challenge)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_PUT = do_PATCH = do_DELETE = do_POST = _answer  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((self.ip, CONTROL_PORT), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def replay(endpoint: str, method: str, path: str, auth: str) -> int:
    """The status a worker at `endpoint` answers to a request carrying `auth`."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{endpoint}{path}", method=method)
    req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_what_the_operator_sends_a_spy_pod_opens_nothing_at_another_engine(env: Env) -> None:
    """Defect 10 (9cfedae sent its bearer token to any selected pod on the first state
    read, and every engine took it): a spy pod is selected by the topology, gets everything
    the operator sends it, and replays each credential to a real decode: reading its state,
    and evicting its prefill. Every replay is refused, and the pair stays connected."""
    p0 = env.pod("p0", "prefill", env.worker("prefill"))
    d0 = env.pod("d0", "decode", env.worker("decode"))
    spy = Spy(ip=loopback_pod_ip(), victim=d0.endpoint)
    spy.uid = create_engine_pod(env.cluster, env.namespace, "spy", "decode", {"version": "v1"})
    spy.start()
    try:
        mark_pod_ready(env.cluster, env.namespace, "spy", [spy.ip])
        env.topology()
        env.start_operator()
        env.wait(
            "the operator has called the spy, signed, and the pair is connected",
            lambda: (
                any(auth for _, _, auth in spy.seen)
                and peers(d0) == {p0.engine_id}
                and peers(p0) == {d0.engine_id}
            ),
            timeout=60,
        )
        got = [(m, p, a) for m, p, a in spy.seen if a]
        assert got, spy.seen
        for method, path, auth in got:
            # The same request at the victim, and an eviction of its prefill.
            assert replay(d0.endpoint, method, path, auth) == 401, (method, path, auth[:40])
            evict = f"/v1/peers/{p0.engine_id}"
            assert replay(d0.endpoint, "DELETE", evict, auth) == 401, auth[:40]
            assert replay(p0.endpoint, "GET", "/v1/state", auth) == 401, auth[:40]
        assert peers(d0) == {p0.engine_id} and peers(p0) == {d0.engine_id}
    finally:
        spy.stop()
