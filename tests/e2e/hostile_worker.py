"""A worker that lies, as its own process: the operator's untrusted input, at its limits.

Serves the control API's routes the operator calls (`GET /v1/state`, `PATCH /v1/peers`,
`PUT /v1/settings`) without authentication (the operator reads any 200 answer; what it must
survive is what the answer says), bound to a pod IP like a real worker:

- `--engine-id` may be another engine's (ids are public: in the status, in every peer add);
- `--invent-peers N`: its state lists N peers no pod has (ids of `--peer-id-len` characters);
- `--unhealthy-peer ID --reason-bytes N`: it holds peer ID and reports it `failing` with a
  reason of N bytes, new on every second read (healthy on the others), so each unhealthy
  report is a new one;
- `--state-bytes N`: every answer is padded to N bytes with an unknown field that changes.

Every peer add and eviction it is asked for is answered done. Run as
`python -m tests.e2e.hostile_worker --host IP --port PORT --pod-uid UID ...`; prints
"listening" once it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.reads = 0
        self.held: set[str] = set()
        self.lock = threading.Lock()
        self.invented = [
            (f"ghost-{i:06d}-" + "x" * args.peer_id_len)[: args.peer_id_len]
            for i in range(args.invent_peers)
        ]
        if args.unhealthy_peer:
            self.held.add(args.unhealthy_peer)

    def answer(self) -> dict[str, Any]:
        a = self.args
        with self.lock:
            self.reads += 1
            n = self.reads
            peers: list[dict[str, Any]] = [{"engine_id": e} for e in sorted(self.held)]
        if a.unhealthy_peer and n % 2 == 1:
            reason = (f"read {n}: " + os.urandom(16).hex() * (a.reason_bytes // 32 + 1))[
                : a.reason_bytes
            ]
            for p in peers:
                if p["engine_id"] == a.unhealthy_peer:
                    p.update(health="failing", health_reason=reason)
        peers += [{"engine_id": e} for e in self.invented]
        state: dict[str, Any] = {
            "engine_id": a.engine_id,
            "role": a.role,
            "compat_hash": a.compat_hash,
            "incarnation": a.incarnation,
            "pod": {"uid": a.pod_uid},
            "peers": peers,
            "failures": {},
        }
        if a.state_bytes:
            pad = a.state_bytes - len(json.dumps(state)) - 32
            state["padding"] = (f"{n}-" + "p" * max(0, pad))[: max(0, pad)]
        return state


def handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            return

        def _send(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            got: dict[str, Any] = json.loads(self.rfile.read(n) or b"{}")
            return got

        def do_GET(self) -> None:
            if self.path == "/v1/state":
                self._send(200, state.answer())
            elif self.path == "/debug/reads":  # the test's count of `/v1/state` answers
                with state.lock:
                    self._send(200, {"reads": state.reads})
            elif self.path == "/healthz":
                self._send(200, {"ok": True})
            else:
                self._send(404, {"error": "not_found", "message": self.path})

        def do_PATCH(self) -> None:
            body = self._body()
            results = []
            with state.lock:
                for item in body.get("add") or ():
                    state.held.add(item["engine_id"])
                    eid = item["engine_id"]
                    results.append(
                        {"engine_id": eid, "op": "add", "status": 200, "result": "added"}
                    )
                for eid in body.get("evict") or ():
                    state.held.discard(eid)
                    results.append(
                        {"engine_id": eid, "op": "evict", "status": 200, "result": "evicted"}
                    )
            self._send(200, {"results": results})

        def do_PUT(self) -> None:
            self._send(200, {"idle_ttl_s": self._body().get("idle_ttl_s")})

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pod-uid", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--role", default="decode")
    p.add_argument("--compat-hash", default="")
    p.add_argument("--incarnation", default="hostile-1")
    p.add_argument("--invent-peers", type=int, default=0)
    p.add_argument("--peer-id-len", type=int, default=256)
    p.add_argument("--unhealthy-peer", default="")
    p.add_argument("--reason-bytes", type=int, default=0)
    p.add_argument("--state-bytes", type=int, default=0)
    args = p.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), handler(State(args)))
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
