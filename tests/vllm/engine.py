"""A vLLM engine in a process of its own, for the connector's two-process tests.

`kvtopo_worker.vllm.engine.VllmEngine` (vLLM's scheduler loading KVTopoConnector, one
worker-side connector per TP rank, real KV tensors, the forward pass stood in for), driven
over stdin/stdout, one JSON object a line, with what vLLM itself tells a caller recorded per
request: the prefill's `kv_transfer_params` (what a P/D proxy hands the decode), the
connector's finished_sending / finished_recving / failed_recving, and how vLLM finished it.

    {"op": "add", "rid", "prompt_len", "max_tokens", "params"}   add a request (a decode's
                                         params name the prefill's request to receive;
                                         optional: "prompt_of", the request whose prompt
                                         tokens it has, "content_id", the prefill request
                                         whose bytes it receives)
    {"op": "wait", "rids", "timeout"}   until each request has left the scheduler; answers
                                         every event seen of them, and the engine's outcome
    {"op": "abort", "rid"}              the client aborts a request (vLLM's abort)
    {"op": "state"}                      free blocks, requests held, peers, abort stages
    {"op": "quit"}

Run: python -m tests.vllm.engine --role prefill --model-dir D --port P --token-file F
         --operator-key-file K [--peer-token-file T] ...

`--operator-key-file`: the operator's public key (the admin routes take calls signed with
its private key); `--token-file`: the client token of the traffic routes;
`--peer-token-file`: the token of lazy handshakes (on when given, unless `--no-lazy`). The
ready line names the engine's incarnation, which the operator's tickets are minted for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from kvtopo_worker.protocol import RequestOutcome
from kvtopo_worker.vllm import offline
from kvtopo_worker.vllm.engine import VllmEngine


class DrivenEngine(VllmEngine):
    """The engine, with every event of a request recorded for the test."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.added_at: dict[str, float] = {}

    def _note(self, rid: str, **what: Any) -> None:
        self.events.setdefault(rid, []).append(what)

    def observe(self, kv_output: Any, engine_outputs: dict[int, Any]) -> None:
        if kv_output is not None:
            failed = set(kv_output.failed_recving)
            for rid in kv_output.finished_sending or ():
                self._note(rid, event="finished_sending")
            for rid in kv_output.finished_recving or ():
                kind = "failed_recving" if rid in failed else "finished_recving"
                self._note(
                    rid,
                    event=kind,
                    waited_s=time.monotonic() - self.added_at[rid],
                    # Whether vLLM let the request (and its blocks) go in the step that
                    # reported it, and the connector then had nothing left to do.
                    freed=rid not in self.scheduler.requests,
                    pending_push_work=self.scheduler.connector.has_pending_push_work(),
                )
        for batch in engine_outputs.values():
            for o in batch.outputs:
                if o.finish_reason is not None:
                    self._note(
                        o.request_id,
                        event="finished",
                        reason=str(o.finish_reason),
                        params=o.kv_transfer_params,
                    )

    def outcome(self, o: RequestOutcome) -> None:
        self._note(
            o.request_id,
            event="outcome",
            status=o.status,
            reason=o.reason,
            message=o.message,
            verified_bytes=o.verified_bytes,
        )

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "add":
            params = cmd.get("params") or {}
            self.added_at[cmd["rid"]] = time.monotonic()
            self.add_request(
                cmd["rid"],
                cmd["prompt_len"],
                cmd["max_tokens"],
                params,
                peer_engine_id=str(params.get("remote_engine_id", "")),
                content_id=str(
                    cmd.get("content_id") or params.get("remote_request_id") or cmd["rid"]
                ),
                prompt_of=cmd.get("prompt_of"),
            )
            return {"ok": True}
        if op == "abort":
            return {"ok": self.abort(cmd["rid"])}
        if op == "wait":
            deadline = time.monotonic() + float(cmd.get("timeout", 30))
            rids = list(cmd["rids"])
            while time.monotonic() < deadline and self.step_error is None:
                with self.lock:
                    if not any(r in self.scheduler.requests for r in rids):
                        break
                time.sleep(0.005)
            for o in self.drain_outcomes():
                self.outcome(o)
            with self.lock:
                return {
                    "left": [r for r in rids if r in self.scheduler.requests],
                    "events": {r: self.events.get(r, []) for r in rids},
                    "error": self.step_error,
                }
        if op == "state":
            with self.lock:
                return {
                    "free_blocks": offline.free_block_count(self.scheduler),
                    "requests": sorted(self.scheduler.requests),
                    "peers": sorted(self.workers[0].peers()),
                    "error": self.step_error,
                    "pending_push_work": self.scheduler.connector.has_pending_push_work(),
                    "receiving": sum(
                        p.in_flight()
                        for p in [self.workers[0].push_connector]
                        if p is not None and self.role != "prefill"
                    ),
                    "abort_stages": dict(self.abort_stages),
                }
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--operator-key-file", default="")
    p.add_argument("--peer-token-file", default="")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--registration-timeout", type=float, default=30.0)
    p.add_argument("--kv-lease", type=float, default=30.0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--failure-policy", choices=["fail", "recompute"], default="fail")
    p.add_argument("--no-lazy", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true")
    args = p.parse_args()
    # stdout carries this driver's answers only (vLLM may log to stdout).
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    engine = DrivenEngine(
        role=args.role,
        engine_id=args.engine_id,
        model_dir=args.model_dir,
        port=args.port,
        token_file=args.token_file,
        operator_key_file=args.operator_key_file,
        peer_token_file=args.peer_token_file,
        tp_size=args.tp,
        num_blocks=args.num_blocks,
        registration_timeout_s=args.registration_timeout,
        kv_lease_s=args.kv_lease,
        transfer_timeout_s=args.transfer_timeout,
        failure_policy=args.failure_policy,
        lazy_handshake=False if args.no_lazy else None,  # None: on with a peer token
        async_scheduling=not args.no_async_scheduling,
    )
    engine.start()
    ready = {
        "ready": True,
        "engine_id": args.engine_id,
        "endpoint": engine.endpoint,
        "incarnation": engine.incarnation,
        "free_blocks": offline.free_block_count(engine.scheduler),
    }
    print(json.dumps(ready), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            answer = engine.handle(cmd)
        except Exception as exc:
            answer = {"exception": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer, default=str), file=answers, flush=True)
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
