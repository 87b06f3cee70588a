"""A vLLM engine in a process of its own, for the connector's two-process tests.

Owns one prefill or decode engine: vLLM's real `Scheduler`, which loads `KVTopoConnector`
through `kv_connector_module_path` (scheduler role), and one worker-side connector per TP
rank with a real per-layer KV cache allocated as vLLM 0.33's model runner does, driven the
way vLLM's model runner drives them each step (bind the metadata, `start_load_kv`,
`get_transfer_results`, `get_block_ids_with_load_errors`; the ranks' outputs combined by
vLLM's own `KVOutputAggregator`). The forward pass is the only stand-in: a prefill step
fills a request's blocks with bytes derived from the request id, rank, layer and block
position (`expected_block`), so a decode verifies every byte it received.

The engine steps on a thread of its own, as an engine core does. The test talks to it over
stdin/stdout, one JSON object a line:

    {"op": "add", "rid", "prompt_len", "max_tokens", "params"}   add a request
    {"op": "wait", "rids", "timeout"}   until each request has left the scheduler; answers
                                         every outcome seen of them
    {"op": "state"}                      free blocks, requests held, peers, outcomes
    {"op": "quit"}

Run: python -m tests.vllm.engine --role prefill --model-dir D --port P --token-file F ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
import zlib
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

from kvtopo_worker.vllm import KVTopoConnector
from kvtopo_worker.vllm import offline as harness


def expected_block(
    rid: str, rank: int, layer: int, position: int, like: torch.Tensor
) -> torch.Tensor:
    """What block `position` of prefill request `rid` holds in `layer` of TP rank `rank`."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{rank}/{layer}/{position}".encode()))
    return torch.randn(like.shape, generator=gen, dtype=like.dtype)


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        extra: dict[str, Any] = {
            "role": args.role,
            "control_host": "127.0.0.1",
            "control_port": args.port,
            "token_file": args.token_file,
            "registration_timeout_s": args.registration_timeout,
            "kv_lease_s": args.kv_lease,
            "transfer_timeout_s": args.transfer_timeout,
            "lazy_handshake": not args.no_lazy,
        }
        if args.peer_token_file:
            extra["peer_token_file"] = args.peer_token_file
        kvt = {
            "kv_connector": "KVTopoConnector",
            "kv_connector_module_path": "kvtopo_worker.vllm",
            "kv_role": "kv_producer" if args.role == "prefill" else "kv_consumer",
            "engine_id": args.engine_id,
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": args.failure_policy,
        }
        self.block_size = 16
        self.num_blocks = args.num_blocks
        self.config = harness.make_vllm_config(
            args.model_dir,
            kvt,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            tp_size=args.tp,
            enable_prefix_caching=False,
        )
        self.kv_cache_config = harness.make_kv_cache_config(self.config, self.num_blocks)
        self.scheduler = harness.make_scheduler(self.config, self.num_blocks, self.kv_cache_config)
        if not isinstance(self.scheduler.connector, KVTopoConnector):
            raise TypeError(f"vLLM loaded {type(self.scheduler.connector).__name__}")
        self.role = args.role
        self.tp = args.tp
        self.workers: list[KVTopoConnector] = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        for rank in range(args.tp):
            kv = harness.make_kv_caches(
                self.config, self.kv_cache_config, self.num_blocks, layout="vllm"
            )
            w = KVTopoConnector(
                self.config,
                KVConnectorRole.WORKER,
                self.kv_cache_config,
                tp_rank=rank,
                local_ranks=args.tp,
            )
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kvs.append(kv)
        self.layers = sorted(self.kvs[0])
        self.aggregator = KVOutputAggregator(args.tp)
        self.lock = threading.Lock()
        self.outcomes: dict[str, list[dict[str, Any]]] = {}
        self.prefill_rid: dict[str, str] = {}  # decode: our request id -> the prefill's
        self.added_at: dict[str, float] = {}
        self.stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _note(self, rid: str, **what: Any) -> None:
        self.outcomes.setdefault(rid, []).append(what)

    def _fill(self, rid: str, block_ids: list[int]) -> None:
        for rank, kv in enumerate(self.kvs):
            for li, name in enumerate(self.layers):
                t = kv[name]
                for pos, b in enumerate(block_ids):
                    t[b].copy_(expected_block(rid, rank, li, pos, t[b]))

    def _verify(self, rid: str) -> int:
        """Blocks of decode request `rid` that differ from the prefill's bytes."""
        prid = self.prefill_rid[rid]
        req = self.scheduler.requests[rid]
        n = math.ceil(len(req.prompt_token_ids or ()) / self.block_size)
        ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0][:n]
        bad = 0
        for rank, kv in enumerate(self.kvs):
            for li, name in enumerate(self.layers):
                t = kv[name]
                for pos, b in enumerate(ids):
                    if not torch.equal(t[b], expected_block(prid, rank, li, pos, t[b])):
                        bad += 1
        return bad

    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        sched = self.scheduler
        if not sched.has_requests() and not sched.connector.has_pending_push_work():
            return False
        out = sched.schedule()
        if self.role == "prefill":
            for new in out.scheduled_new_reqs:
                self._fill(new.req_id, list(new.block_ids[0]))
        outputs = []
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)  # type: ignore[arg-type]
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            errors = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=errors,
            )
            outputs.append(harness.runner_output(out, kvo, scheduler=sched))
        merged = self.aggregator.aggregate(outputs)
        assert merged is not None
        kvo = merged.kv_connector_output
        failed = set(kvo.failed_recving) if kvo is not None else set()
        if kvo is not None:
            for rid in kvo.finished_sending or ():
                self._note(rid, event="finished_sending", t=time.monotonic())
            for rid in kvo.finished_recving or ():
                ok = rid not in failed
                bad = self._verify(rid) if ok and rid in sched.requests else None
                self._note(
                    rid,
                    event="failed_recving" if not ok else "finished_recving",
                    bad_blocks=bad,
                    waited_s=time.monotonic() - self.added_at.get(rid, 0.0),
                )
        engine_outputs = sched.update_from_output(out, merged)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self._note(
                        o.request_id,
                        event="finished",
                        reason=str(o.finish_reason),
                        params=o.kv_transfer_params,
                    )
        return True

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                with self.lock:
                    busy = self.step()
                if not busy:
                    time.sleep(0.002)
        except Exception as exc:  # reported to the test, which fails on it
            import traceback

            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "add":
            params = cmd.get("params")
            req = harness.make_request(
                cmd["rid"],
                cmd["prompt_len"],
                cmd["max_tokens"],
                params,
                block_size=self.block_size,
            )
            with self.lock:
                if params and params.get("remote_request_id"):
                    self.prefill_rid[cmd["rid"]] = params["remote_request_id"]
                self.added_at[cmd["rid"]] = time.monotonic()
                self.scheduler.add_request(req)
            return {"ok": True}
        if op == "wait":
            deadline = time.monotonic() + float(cmd.get("timeout", 30))
            rids = list(cmd["rids"])
            while time.monotonic() < deadline and self.error is None:
                with self.lock:
                    left = [r for r in rids if r in self.scheduler.requests]
                if not left:
                    break
                time.sleep(0.005)
            with self.lock:
                left = [r for r in rids if r in self.scheduler.requests]
                return {
                    "left": left,
                    "outcomes": {r: self.outcomes.get(r, []) for r in rids},
                    "error": self.error,
                }
        if op == "state":
            with self.lock:
                return {
                    "free_blocks": harness.free_block_count(self.scheduler),
                    "requests": sorted(self.scheduler.requests),
                    "peers": sorted(self.workers[0].peers()),
                    "error": self.error,
                }
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--peer-token-file", default="")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--registration-timeout", type=float, default=30.0)
    p.add_argument("--kv-lease", type=float, default=30.0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--failure-policy", choices=["fail", "recompute"], default="fail")
    p.add_argument("--no-lazy", action="store_true")
    args = p.parse_args()
    engine = Engine(args)
    engine.thread.start()
    ready = {
        "ready": True,
        "engine_id": args.engine_id,
        "endpoint": engine.workers[0].control_endpoint,
        "free_blocks": harness.free_block_count(engine.scheduler),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            answer = engine.handle(cmd)
        except Exception as exc:
            answer = {"exception": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer, default=str), flush=True)
    engine.stop.set()
    engine.thread.join(5)
    for w in engine.workers:
        w.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
