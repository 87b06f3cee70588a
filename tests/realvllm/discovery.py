"""Stand-ins for vLLM engines at kwok pod IPs, and vllm-router with Kubernetes service
discovery, for `test_router_discovery.py`.

A :class:`StandIn` is a tiny HTTP server in this process (one thread per connection) bound
to a pod's IP (kwok hands out loopback addresses, 127.N.x.y) at the port every engine pod
uses. It records every request it gets (time, method, path, headers, JSON body) and answers
as a vLLM OpenAI server would: `GET /health` 200, `GET /v1/models`, `POST
/v1/completions[/render]`; a completion that carries `kv_transfer_params.do_remote_decode`
is a prefill call and is answered with `prefill_params` (optionally after `prefill_delay_s`).

:func:`discovery_router` builds the vllm-router process (`kvtopo.realvllm.servers.Process`)
in P/D mode with `--service-discovery`, reading the cluster from `$KUBECONFIG`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.router import router_process

MODEL = "tiny"


@dataclass
class Seen:
    """One request a stand-in received; `answered` is when its answer was about to be
    written (nothing of it had left yet), set by the serving thread under the lock."""

    t: float
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    answered: float | None = None

    @property
    def request_id(self) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == "x-request-id":
                return value
        return None

    @property
    def kv_params(self) -> dict[str, Any] | None:
        if isinstance(self.body, dict):
            params = self.body.get("kv_transfer_params")
            return params if isinstance(params, dict) else None
        return None


@dataclass
class StandIn:
    """A vLLM stand-in for one pod: `name` (the pod), `role`, bound at `ip:port`."""

    name: str
    role: str
    ip: str
    port: int
    prefill_params: dict[str, Any] = field(default_factory=dict)
    prefill_delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def default_prefill_params(self) -> dict[str, Any]:
        """What kvtopo's connector answers a prefill call with (see
        kvtopo_worker/vllm/connector.py), naming this pod."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [1],
            "remote_engine_id": f"engine-{self.name}",
            "remote_request_id": f"cmpl-{self.name}-internal",
            "remote_host": self.ip,
            "remote_port": 8975,
            "tp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 3,
            "transfer_mode": "push",
            "kvtopo_incarnation": f"inc-{self.name}",
        }

    def start(self) -> StandIn:
        if not self.prefill_params:
            self.prefill_params = self.default_prefill_params()
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer((self.ip, self.port), handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, name=f"standin-{self.name}", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def requests(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        with self._lock:
            return [
                s
                for s in self.seen
                if (method is None or s.method == method) and (path is None or s.path == path)
            ]

    def forget(self) -> None:
        """Drops what was recorded so far (the test's own probes)."""
        with self._lock:
            self.seen.clear()

    def completions(self) -> list[Seen]:
        """The POST /v1/completions calls received so far (not /render)."""
        return self.requests("POST", "/v1/completions")

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _answered(self, seen: Seen) -> None:
        with self._lock:
            seen.answered = time.monotonic()

    def answer(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any] | str]:
        if path in ("/health", "/ping"):
            return 200, ""
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if method == "POST" and path == "/v1/completions/render":
            return 200, {"prompt_token_ids": [1, 2, 3]}
        if method == "POST" and path == "/v1/completions":
            request = body if isinstance(body, dict) else {}
            out: dict[str, Any] = {
                "id": f"cmpl-{self.name}",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": f"from {self.name}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
            if (request.get("kv_transfer_params") or {}).get("do_remote_decode"):
                if self.prefill_delay_s:
                    time.sleep(self.prefill_delay_s)
                out["kv_transfer_params"] = dict(self.prefill_params)
            return 200, out
        return 404, {"error": f"no route {method} {path}"}


def _handler_for(standin: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a real server (the router pools)

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            path = self.path.split("?", 1)[0]
            seen = Seen(time.monotonic(), self.command, path, dict(self.headers.items()), body)
            standin._record(seen)
            status, payload = standin.answer(self.command, path, body)
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            standin._answered(seen)  # before a byte of it leaves
            self.send_response(status)
            ctype = "text/plain" if isinstance(payload, str) else "application/json"
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


# --- the router ---------------------------------------------------------------------------


def static_router(
    name: str, workdir: Path, prefill: Sequence[StandIn], decode: Sequence[StandIn]
) -> rs.Process:
    """The same router with static worker URLs (`--prefill URL --decode URL`)."""
    port = rs.free_port()
    argv = [rs.vllm_bin("vllm-router"), "--vllm-pd-disaggregation"]
    for p in prefill:
        argv += ["--prefill", p.url]
    for d in decode:
        argv += ["--decode", d.url]
    argv += ["--host", rs.HOST, "--port", str(port)]
    argv += ["--prometheus-host", rs.HOST, "--prometheus-port", str(rs.free_port())]
    return router_process(name, workdir, argv, port, None)


def complete(router: rs.Process, prompt: str, max_tokens: int = 3) -> tuple[int, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return rs.post_json(router.url + "/v1/completions", body, timeout=30.0)
