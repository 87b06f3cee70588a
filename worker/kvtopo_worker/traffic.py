"""The traffic routes of an engine that kvtopo's drill, tests and benchmarks drive.

Owns what an engine that takes requests over its control server shares, whatever moves its
KV (the emulated engine, or vLLM's scheduler with KVTopoConnector): admission (refused once
the engine drains), the numbered queue of request outcomes handed out by `GET /v1/finished`
(each outcome once, or again until acknowledged), the drain and its deadline, and the routes:

    POST /v1/requests   SubmitRequest: start a request (answers 202; 503 `draining` once the
                        engine drains, 503 `no_capacity` when it has no KV blocks free)
    DELETE /v1/requests/{id}
                        abort one request (vLLM's abort): it ends failed with reason
                        `aborted` once no WRITE of it can land (202; 404 when not held)
    GET  /v1/finished   ended requests as a list of RequestOutcome, each numbered (`seq`);
                        handed out on return, or with `?ack=N` once a later call
                        acknowledges them (N: the highest `seq` the client has recorded)
    POST /v1/drain      DrainRequest: stop taking requests; those still held after its
                        timeout are given up (`abandon_held`); answers DrainState
    GET  /v1/drain      DrainState

An engine subclasses `EngineTraffic` and implements `submit`, `held`, `abort` and
`abandon_held`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

import msgspec
from aiohttp import web

from kvtopo_worker.credentials import TokenError, TokenSource, bearer_token
from kvtopo_worker.protocol import (
    MAX_ID_LEN,
    DrainRequest,
    DrainState,
    MalformedMessage,
    RequestOutcome,
    SubmitRequest,
    decode_json_body,
)

log = logging.getLogger(__name__)


class EngineDraining(Exception):
    """The engine drains: it takes no new requests."""


def json_error(status: int, error: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=msgspec.json.encode({"error": error, "message": message}),
        content_type="application/json",
    )


class EngineTraffic:
    """Admission, outcomes and drain of an engine; see the module docstring."""

    def __init__(self) -> None:
        # Held around "is the engine draining?" and taking a request in, so no request is
        # accepted once the drain began (subclasses take it in `submit`).
        self.admission = threading.Lock()
        self.draining = False
        self._drain_deadline: threading.Timer | None = None
        self._outcomes: deque[RequestOutcome] = deque()
        self._outcomes_lock = threading.Lock()
        self._accepted = 0
        self._handed_out = 0
        self._last_seq = 0
        self.requests_done = 0
        self.requests_failed = 0
        self.late_writes = 0  # blocks found written while free (an engine's own guard)
        self.abort_stages: dict[str, int] = {}  # where aborts found their requests

    # --- what the engine implements ------------------------------------------------------

    def submit(self, req: SubmitRequest) -> None:
        """Starts a request; raises EngineDraining, BlockingIOError (no capacity) or
        ValueError when it cannot be taken (nothing is lost). Calls `accepted()` once the
        request is the engine's."""
        raise NotImplementedError

    def held(self) -> int:
        """Requests accepted that have not ended yet."""
        raise NotImplementedError

    def abandon_held(self, message: str) -> int:
        """Gives every request still held up (the drain deadline); each ends as soon as no
        WRITE of it can land. Returns how many were held."""
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """The client gives one request up (`DELETE /v1/requests/{id}`): it ends failed
        with reason `aborted` as soon as no WRITE of it can land. False when the engine
        does not hold it (never taken, or ended already)."""
        raise NotImplementedError

    def settles_within(self) -> float:
        """Seconds until every request given up can have ended by its connectors' own
        bounds (no WRITE of it can land after that); 0 when nothing is pending there."""
        return 0.0

    def fail_held(self, message: str) -> int:
        """Ends every request still held as failed at once, for an engine that stops for
        good (its KV memory goes with it); returns how many. By default nothing: the
        engine's `abandon_held` already ends each of them."""
        return 0

    # --- what it provides ----------------------------------------------------------------

    def serve_until_signalled(
        self,
        ready: dict[str, str],
        out: TextIO,
        drain_timeout_s: float,
        stop: threading.Event | None = None,
    ) -> None:
        """An engine process's life once it serves: prints `ready` to `out` (one JSON line,
        what its launcher waits for), waits for SIGTERM or SIGINT, then drains: no new
        requests; those still held after `drain_timeout_s` are given up (`abandon_held`),
        each ending through its connector once no WRITE of it can land (a frozen peer's
        WRITE may still land until the connector's give-up bound, `settles_within`: the
        engine waits for that, never reporting such a request or handing its blocks back
        earlier); returns once every outcome has been handed out, or warns how many were
        not (the process then exits with them: its memory, and any WRITE into it, goes
        with it). Call from the main thread."""
        signalled = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: signalled.set())
        signal.signal(signal.SIGINT, lambda *_: signalled.set())
        print(json.dumps(ready), file=out, flush=True)
        signalled.wait()
        self.begin_drain(drain_timeout_s)
        if self.wait_drained(2 * drain_timeout_s + 1, stop):
            return
        # Given up, and still unanswered by a peer (frozen, or its answer lost): each ends
        # by its connector's own bound, when no WRITE of it can land any more.
        settle = self.settles_within()
        if settle > 0:
            log.info("draining: waiting up to %.1f s for peers' WRITEs to settle", settle)
        if not self.wait_drained(settle + drain_timeout_s + 1, stop):
            log.warning(
                "exiting with requests not drained (outcomes not collected with GET "
                "/v1/finished): %s",
                self.drain_state(),
            )

    def accepted(self) -> None:
        with self._outcomes_lock:
            self._accepted += 1

    def queue_outcomes(self, outcomes: list[RequestOutcome]) -> None:
        """Numbers outcomes (1, 2, ...), counts them and queues them for `GET /v1/finished`."""
        with self._outcomes_lock:
            for o in outcomes:
                self._last_seq += 1
                self._outcomes.append(msgspec.structs.replace(o, seq=self._last_seq))
                if o.status == "done":
                    self.requests_done += 1
                else:
                    self.requests_failed += 1

    def request_counts(self) -> tuple[int, int, int]:
        """(done, failed, in flight): in flight until its outcome has been handed out, so a
        client that waits for 0 and drains once more has every outcome."""
        with self._outcomes_lock:
            return self.requests_done, self.requests_failed, self._accepted - self._handed_out

    def begin_drain(self, timeout_s: float) -> None:
        """Refuses new requests from now on; after `timeout_s`, gives those still held up
        (`abandon_held`). A second call changes nothing."""
        with self.admission:
            if self.draining:
                return
            self.draining = True
        log.info("draining: %d requests held, %.1f s to end them", self.held(), timeout_s)
        timer = threading.Timer(
            timeout_s, self.abandon_held, args=("the engine drained past its deadline",)
        )
        timer.daemon = True
        self._drain_deadline = timer
        timer.start()

    def cancel_drain_deadline(self) -> None:
        if self._drain_deadline is not None:
            self._drain_deadline.cancel()

    def drain_state(self) -> DrainState:
        held = self.held()
        with self._outcomes_lock:
            in_flight = self._accepted - self._handed_out
        return DrainState(
            draining=self.draining,
            requests_held=held,
            requests_in_flight=in_flight,
            drained=self.draining and held == 0 and in_flight == 0,
            late_writes=self.late_writes,
            abort_stages=dict(self.abort_stages),
        )

    def wait_drained(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Waits (polling the engine's own state, with a deadline) until every accepted
        request's outcome has been handed out; False when the deadline came first."""
        wait = stop or threading.Event()
        deadline = time.monotonic() + timeout_s
        while not self.drain_state().drained:
            if time.monotonic() >= deadline:
                return False
            wait.wait(0.05)
        return True

    def drain_outcomes(self, limit: int = 10_000, ack: int | None = None) -> list[RequestOutcome]:
        """Outcomes not yet handed out, oldest first. Without `ack`, those returned are
        handed out (gone from the engine). With `ack`, the outcomes numbered up to `ack`
        are handed out and the rest returned but kept until a later call acknowledges
        them: a client whose answer was lost (a timeout) gets them again."""
        with self._outcomes_lock:
            if ack is None:
                n = min(limit, len(self._outcomes))
                self._handed_out += n
                return [self._outcomes.popleft() for _ in range(n)]
            while self._outcomes and self._outcomes[0].seq <= ack:
                self._outcomes.popleft()
                self._handed_out += 1
            return [self._outcomes[i] for i in range(min(limit, len(self._outcomes)))]

    # --- routes ----------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/requests", self._post_request)
        app.router.add_delete("/v1/requests/{request_id}", self._delete_request)
        app.router.add_get("/v1/finished", self._get_finished)
        app.router.add_post("/v1/drain", self._post_drain)
        app.router.add_get("/v1/drain", self._get_drain)

    async def _post_request(self, request: web.Request) -> web.Response:
        body = decode_json_body(await request.read(), SubmitRequest)
        return admission_answer(lambda: self.submit(body))

    async def _delete_request(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        if not 0 < len(request_id) <= MAX_ID_LEN:
            raise MalformedMessage(f"request_id must be 1..{MAX_ID_LEN} characters")
        if not self.abort(request_id):
            return json_error(404, "not_found", f"request {request_id} is not held")
        return web.Response(status=202, body=b'{"aborting":true}', content_type="application/json")

    async def _post_drain(self, request: web.Request) -> web.Response:
        body = decode_json_body(await request.read() or b"{}", DrainRequest)
        if not 0 <= body.timeout_s <= 3600:
            raise MalformedMessage("timeout_s must be 0..3600")
        self.begin_drain(body.timeout_s)
        return web.Response(
            body=msgspec.json.encode(self.drain_state()), content_type="application/json"
        )

    async def _get_drain(self, request: web.Request) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(self.drain_state()), content_type="application/json"
        )

    async def _get_finished(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("max", "10000"))
            ack = int(request.query["ack"]) if "ack" in request.query else None
        except ValueError:
            raise MalformedMessage("max and ack must be integers") from None
        return web.Response(
            body=msgspec.json.encode(self.drain_outcomes(max(1, min(limit, 100_000)), ack)),
            content_type="application/json",
        )


def admission_answer(take: Callable[[], None]) -> web.Response:
    """The answer to a request an engine route takes in with `take()`: 202 once it is the
    engine's, 503 `draining` or `no_capacity` when it cannot be (nothing is lost); a
    ValueError is the request's fault (raised as MalformedMessage: 400)."""
    try:
        take()
    except EngineDraining as exc:
        return json_error(503, "draining", str(exc))
    except BlockingIOError as exc:
        return json_error(503, "no_capacity", str(exc))
    except ValueError as exc:
        raise MalformedMessage(str(exc)) from None
    return web.Response(status=202, body=b'{"accepted":true}', content_type="application/json")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The command line every engine that takes this traffic shares (the emulated engine's,
    which the drill and the tests start, whichever engine runs)."""
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--engine-id", help="default: a fresh uuid per start")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="control API bind address: the pod IP in a pod ($(POD_IP) from the downward API)",
    )
    p.add_argument("--port", type=int, default=8975, help="control API port (0: pick a free one)")
    p.add_argument(
        "--operator-key-file",
        default=os.environ.get("KVTOPO_OPERATOR_KEY_FILE", ""),
        help="the operator's public key (PEM public key or certificate; during a rotation the "
        "new one, then the previous one): the admin routes take only calls signed for it "
        "(default: $KVTOPO_OPERATOR_KEY_FILE). It verifies nothing else and signs nothing",
    )
    p.add_argument(
        "--token-file",
        help="the client token: a bearer token for the traffic routes (requests, drain) and "
        "nothing else; during a rotation the previous token on a second line. Without it "
        "the traffic routes are closed",
    )
    p.add_argument(
        "--pod-namespace",
        default=os.environ.get("KVTOPO_POD_NAMESPACE", ""),
        help="the engine's pod, as the operator must see it (default: $KVTOPO_POD_NAMESPACE; "
        "from the downward API's metadata.namespace)",
    )
    p.add_argument(
        "--pod-name",
        default=os.environ.get("KVTOPO_POD_NAME", ""),
        help="default: $KVTOPO_POD_NAME (metadata.name)",
    )
    p.add_argument(
        "--pod-uid",
        default=os.environ.get("KVTOPO_POD_UID", ""),
        help="default: $KVTOPO_POD_UID (metadata.uid); the operator acts only on a worker "
        "whose pod uid is the pod's",
    )
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    p.add_argument("--model-id", default="emulated", help="part of the compatibility hash")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks, each with its own NIXL agent and KV cache (as vLLM's TP "
        "workers); a request ends when every rank has; peers must run as many",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] where a GPU is present")
    p.add_argument(
        "--registration-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="decode: give a request up (cancel it) when no completion came within S; it "
        "ends once the prefill answers, or S + --transfer-timeout + 2 s after it was sent",
    )
    p.add_argument("--kv-lease", type=float, default=30.0, metavar="S")
    p.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a WRITE not done within S is aborted (the smaller of both sides' values)",
    )
    p.add_argument(
        "--idle-ttl",
        type=float,
        default=0.0,
        metavar="S",
        help="evict a peer that carried no transfer for S (0: off); the operator sets it "
        "from the KVTopology's eviction.idleTTLSeconds (PUT /v1/settings)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT: requests still held this long after it are given up with "
        "reason shutdown (each ends once no WRITE of it can land); those still held at twice "
        "that fail outright; the process then waits as long again for their outcomes to be "
        "collected (GET /v1/finished) before it exits",
    )
    p.add_argument(
        "--failing-after",
        type=int,
        default=3,
        metavar="K",
        help="a held peer whose last K transfers all failed is reported `failing` in "
        "/v1/state (one that NIXL reports disconnected is `dropped` at once); the operator "
        "then adds it again, and the add renews it (its metadata fetched again, its agents "
        "replaced). A transfer that succeeds starts the count again",
    )
    p.add_argument(
        "--progress-thread",
        choices=["auto", "on", "off"],
        default="auto",
        help="NIXL progress thread (auto: off on hosts with < 8 cores, where it costs a core)",
    )
    p.add_argument("--log-level", default="WARNING")


class TrafficServer:
    """The traffic routes of an engine served on their own (for an engine without the
    kvtopo control API, e.g. vLLM's own connector in a side-by-side benchmark): a bearer
    token from `token_file`, on a thread with its own loop, at `host:port` (0: a free one)."""

    def __init__(self, traffic: EngineTraffic, host: str, port: int, token_file: str) -> None:
        self.token = TokenSource(path=token_file)
        self.host, self.port = host, port
        self.app = web.Application(middlewares=[self._auth])
        traffic.add_routes(self.app)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            accepted = self.token.accepts(bearer_token(request.headers.get("Authorization", "")))
        except TokenError as exc:  # no token of our own: nothing is authorised
            log.error("traffic API refused %s %s: %s", request.method, request.path, exc)
            return json_error(503, "token_unavailable", str(exc))
        if accepted is None:
            return json_error(
                401, "unauthorized", "a valid 'Authorization: Bearer <token>' is required"
            )
        try:
            response: web.StreamResponse = await handler(request)
        except MalformedMessage as exc:
            return json_error(400, "malformed_message", str(exc))
        return response

    def start(self) -> None:
        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            runner = web.AppRunner(self.app)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            if self.port == 0:
                sockets = getattr(site._server, "sockets", None) or []
                self.port = int(sockets[0].getsockname()[1])
            self._runner = runner
            self._ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=serve, name="kvtopo-traffic", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the traffic server did not bind {self.host}:{self.port}")

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
