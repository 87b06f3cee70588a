"""`python -m kvtopo_worker.vllm.engine`: a vLLM engine whose KV moves with KVTopoConnector.

Owns a prefill or decode engine made of vLLM's real parts except the model: vLLM's v1
`Scheduler` (which loads `KVTopoConnector` through `kv_connector_module_path`), one
worker-side connector per TP rank with a per-layer KV cache allocated as vLLM's model runner
does, driven each step as vLLM's model runner drives them (bind the metadata,
`start_load_kv`, `get_transfer_results`, `get_block_ids_with_load_errors`; the ranks'
outputs combined by vLLM's `KVOutputAggregator`), on a thread of its own as an engine core
steps. The forward pass is the one stand-in: a prefill step writes bytes derived from the
request id, rank, layer and block position into the request's blocks (`expected_block`), so
the decode verifies every byte it received.

It takes the traffic of the emulated engine (`kvtopo_worker.traffic`: POST /v1/requests,
GET /v1/finished, drain) on its kvtopo control API, so the drill (`kvtopo drill --engine
vllm`) and the tests drive it the same way: a request of `num_blocks` blocks is a prompt of
`num_blocks * 16` tokens; a prefill runs it with `do_remote_decode`, a decode with the
`kv_transfer_params` a P/D proxy would hand it (the prefill engine `peer_engine_id`, the same
request id). Its outcome is the transfer's, as every TP rank's connector ended it (a decode's
verified), each request once. Prints one JSON line {engine_id, endpoint, role, incarnation,
nixl_agent: {progress_thread, num_threads}} on stdout when ready; SIGTERM drains it, then it
exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvtopo_worker.protocol import (
    FailureType,
    MalformedMessage,
    RequestOutcome,
    Role,
    SubmitRequest,
)
from kvtopo_worker.push import FailedRequest
from kvtopo_worker.traffic import (
    EngineDraining,
    EngineTraffic,
    TrafficServer,
    add_engine_arguments,
    admission_answer,
)
from kvtopo_worker.vllm import offline
from kvtopo_worker.vllm.connector import KVTopoConnector, attach_traffic

log = logging.getLogger(__name__)

BLOCK_SIZE = 16  # tokens per KV block


def expected_block(
    rid: str, rank: int, layer: int, position: int, like: torch.Tensor
) -> torch.Tensor:
    """What block `position` of prefill request `rid` holds in `layer` of TP rank `rank`."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rid}/{rank}/{layer}/{position}".encode()))
    return torch.randn(like.shape, generator=gen, dtype=like.dtype)


@dataclass
class _Held:
    peer_engine_id: str
    prompt_len: int
    content_id: str  # the prefill request whose bytes it holds (or will)
    # Its part, from its kv_transfer_params: "send" (prefill for a remote decode), "recv"
    # (decode from a remote prefill) or "plain" (neither).
    part: str = "plain"
    given_up: FailedRequest | None = None  # why the engine gave it up, once it did


def request_part(params: dict[str, Any] | None) -> str:
    """A request's part as a P/D proxy's `kv_transfer_params` say (vLLM's own reading)."""
    if params and params.get("do_remote_prefill"):
        return "recv"
    if params and params.get("do_remote_decode"):
        return "send"
    return "plain"


class VllmEngine(EngineTraffic):
    """One prefill or decode vLLM engine (scheduler and TP ranks) in this process."""

    def __init__(
        self,
        *,
        role: Role,
        engine_id: str,
        model_dir: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token_file: str,
        operator_key_file: str = "",
        peer_token_file: str = "",
        tp_size: int = 1,
        num_blocks: int = 256,
        registration_timeout_s: float = 30.0,
        kv_lease_s: float = 30.0,
        transfer_timeout_s: float = 30.0,
        idle_ttl_s: float = 0.0,
        handshake_timeout_s: float = 5.0,
        pod: tuple[str, str, str] = ("", "", ""),
        failure_policy: str = "fail",
        lazy_handshake: bool | None = None,
        model_id: str = "",
        connector: str = "kvtopo",
        block_size: int = BLOCK_SIZE,
        async_scheduling: bool = True,
        nixl_num_threads: int | None = None,
    ) -> None:
        """`role` "both" is vLLM's kv_both: each request's part comes from its
        `kv_transfer_params` (`add_request`). `connector`: "kvtopo" (KVTopoConnector, its
        control API serving the traffic routes) or "nixl" (vLLM's own NixlPushConnector, for
        side-by-side benchmarks: the traffic routes on a server of their own at
        `host:port`; the process needs VLLM_TARGET_DEVICE=cpu and
        VLLM_NIXL_SIDE_CHANNEL_PORT set before vLLM is imported). `async_scheduling`
        (vLLM 0.33's default): step N+1 is scheduled before step N's output reaches the
        scheduler, as the engine core's batch queue of two does. `nixl_num_threads`: the
        UCX backend threads of vLLM's own connector (its `num_threads`; None: vLLM's
        default, 4); KVTopoConnector's are its transport's (KVTOPO_NIXL_NUM_THREADS)."""
        super().__init__()
        self.role: Role = role
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.block_size = block_size
        self.connector = connector
        # No "role" key: the kv_role says it (kv_both: each request's params do).
        extra: dict[str, Any] = {
            "control_host": host,
            "control_port": port,
            "token_file": token_file,
            "operator_key_file": operator_key_file,
            "peer_token_file": peer_token_file,
            "registration_timeout_s": registration_timeout_s,
            "kv_lease_s": kv_lease_s,
            "transfer_timeout_s": transfer_timeout_s,
            "idle_ttl_s": idle_ttl_s,
            "handshake_timeout_s": handshake_timeout_s,
            "lazy_handshake": lazy_handshake,
            "pod_namespace": pod[0],
            "pod_name": pod[1],
            "pod_uid": pod[2],
            "model_id": model_id,
        }
        kv_transfer: dict[str, Any] = {
            "kv_connector": "KVTopoConnector",
            "kv_connector_module_path": "kvtopo_worker.vllm",
            "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role],
            "engine_id": engine_id,
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": failure_policy,
        }
        if connector == "nixl":
            kv_transfer.pop("kv_connector_module_path")
            kv_transfer["kv_connector"] = "NixlPushConnector"
            kv_transfer["kv_buffer_device"] = "cpu"
            kv_transfer["kv_connector_extra_config"] = {
                "backends": ["UCX"],
                "kv_lease_duration": kv_lease_s,
            }
            if nixl_num_threads is not None:
                kv_transfer["kv_connector_extra_config"]["num_threads"] = nixl_num_threads
        elif connector != "kvtopo":
            raise ValueError(f"connector must be kvtopo or nixl, not {connector!r}")
        self.config = offline.make_vllm_config(
            model_dir,
            kv_transfer,
            block_size=block_size,
            num_blocks=num_blocks,
            tp_size=tp_size,
            enable_prefix_caching=False,
            async_scheduling=async_scheduling,
        )
        self.kv_cache_config = offline.make_kv_cache_config(self.config, num_blocks)
        self.traffic_server: TrafficServer | None = None
        if connector == "kvtopo":
            attach_traffic(engine_id, self)
        self.scheduler = offline.make_scheduler(self.config, num_blocks, self.kv_cache_config)
        self.workers: list[Any] = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        if connector == "kvtopo":
            if not isinstance(self.scheduler.connector, KVTopoConnector):
                raise TypeError(f"vLLM loaded {type(self.scheduler.connector).__name__}")
            for rank in range(tp_size):
                kv = offline.make_kv_caches(self.config, self.kv_cache_config, num_blocks, "vllm")
                worker = KVTopoConnector(
                    self.config,
                    KVConnectorRole.WORKER,
                    self.kv_cache_config,
                    tp_rank=rank,
                    local_ranks=tp_size,
                )
                worker.on_end = self._rank_ender(rank)
                worker.register_kv_caches(kv)
                self.workers.append(worker)
                self.kvs.append(kv)
        else:
            self.workers, self.kvs = offline.nixl_push_workers(
                self.config, self.kv_cache_config, self.scheduler, num_blocks
            )
            self.traffic_server = TrafficServer(self, host, port, token_file)
            self.traffic_server.start()
        self._finished: dict[str, dict[str, Any]] = {}  # what vLLM answered, by request
        self.layers = sorted(self.kvs[0])
        self.aggregator = KVOutputAggregator(tp_size)
        self.lock = threading.Lock()  # the scheduler and the request tables
        self._held: dict[str, _Held] = {}
        self._rank_ends: dict[str, dict[int, FailedRequest | None]] = {}
        # Steps scheduled whose output the scheduler has not seen yet, newest first: up
        # to two with async scheduling (the engine core's batch queue), else one.
        self._batches: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self._depth = 2 if async_scheduling else 1
        # Requests the workers reported ended whose step output the scheduler has not
        # seen yet (an abort then lands "after finished_recving, before the scheduler").
        self._reported: set[str] = set()
        self._reported_now: set[str] = set()  # ended while the step being executed ran
        self._unseen: dict[int, set[str]] = {}  # by step (its output's id): ended in it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self.verified_bytes = 0
        self.step_error: str | None = None

    @property
    def endpoint(self) -> str:
        if self.traffic_server is not None:
            return self.traffic_server.endpoint
        endpoint = self.workers[0].control_endpoint
        if endpoint is None:
            raise RuntimeError("the control API is not serving")
        return str(endpoint)

    @property
    def incarnation(self) -> str:
        if self.traffic_server is not None:
            return ""
        return str(self.workers[0].incarnation)

    def nixl_agent_settings(self) -> dict[str, Any]:
        """The NIXL agent settings its connector's agents run with: {progress_thread,
        num_threads (the UCX backend's worker threads)}. KVTopoConnector's transport takes
        its defaults (KVTOPO_NIXL_PROGRESS_THREAD, else on with >= 8 cores;
        KVTOPO_NIXL_NUM_THREADS, else 0); vLLM's NixlConnector passes `num_threads` (its
        extra config's, default 4) and leaves the progress thread at NIXL's default (on;
        vLLM has no setting for it)."""
        if self.connector == "kvtopo":
            from kvtopo_worker.transport import nixl_num_threads_default, progress_thread_default

            return {
                "progress_thread": progress_thread_default(),
                "num_threads": nixl_num_threads_default(),
            }
        from kvtopo_worker.transport import nixl_library_progress_thread_default

        threads = self.config.kv_transfer_config.get_from_extra_config("num_threads", 4)
        return {
            "progress_thread": nixl_library_progress_thread_default(),
            "num_threads": int(threads),
        }

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.cancel_drain_deadline()
        self._thread.join(10)
        for worker in self.workers:
            worker.shutdown()
        if self.traffic_server is not None:
            self.traffic_server.stop()

    # --- requests ------------------------------------------------------------------------

    def submit(self, req: SubmitRequest) -> None:
        prompt_len = req.num_blocks * self.block_size
        most = self.config.model_config.max_model_len // self.block_size - 1
        if req.num_blocks > most:
            raise ValueError(f"num_blocks must be at most {most}")
        if self.role != "decode":
            params: dict[str, Any] = {"do_remote_decode": True}
        else:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": req.peer_engine_id,
                "remote_request_id": req.request_id,
                "remote_host": "",
                "remote_port": 0,
                "remote_block_ids": [],
                "tp_size": self.tp_size,
            }
        self.add_request(req.request_id, prompt_len, 1, params, peer_engine_id=req.peer_engine_id)

    def add_request(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int,
        params: dict[str, Any],
        *,
        peer_engine_id: str,
        content_id: str | None = None,
        prompt_of: str | None = None,
    ) -> None:
        """Hands vLLM a request with these `kv_transfer_params` (what a P/D proxy sends);
        `content_id`: the prefill request whose bytes a decode request receives (default:
        its own id); `prompt_of`: the request whose prompt tokens it has (default: its own,
        derived from its id)."""
        request = offline.make_request(
            rid, prompt_len, max_tokens, params, block_size=self.block_size, prompt_of=prompt_of
        )
        blocks = math.ceil(prompt_len / self.block_size)
        with self.admission:
            if self.draining:
                raise EngineDraining("the engine is draining: it takes no new requests")
            with self.lock:
                if rid in self._held or rid in self.scheduler.requests:
                    raise ValueError(f"request {rid} is already in flight")
                free = offline.free_block_count(self.scheduler)
                if free < blocks + 1:
                    raise BlockingIOError(f"only {free} free KV blocks")
                part = request_part(params)
                self._held[rid] = _Held(peer_engine_id, prompt_len, content_id or rid, part)
                self.scheduler.add_request(request)
        self.accepted()

    # --- a P/D proxy's view: vLLM's own request API, stood in for ----------------------

    def add_routes(self, app: web.Application) -> None:
        """The traffic routes, and what a P/D proxy asks of a vLLM engine:

        POST /v1/vllm/requests        {request_id, prompt_len, max_tokens,
                                       kv_transfer_params[, content_id]}: a request as a
                                       proxy sends it (202)
        GET  /v1/vllm/requests/{rid}  {finished: {reason, kv_transfer_params} | null, held}:
                                       how vLLM finished it (a prefill's params are what the
                                       proxy hands the decode)
        """
        super().add_routes(app)
        app.router.add_post("/v1/vllm/requests", self._post_vllm_request)
        app.router.add_get("/v1/vllm/requests/{rid}", self._get_vllm_request)

    async def _post_vllm_request(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            rid = str(body["request_id"])
            prompt_len, max_tokens = int(body["prompt_len"]), int(body["max_tokens"])
            params = dict(body.get("kv_transfer_params") or {})
            content_id = body.get("content_id")
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedMessage(f"bad request body: {exc}") from None
        if not 0 < len(rid) <= 256 or not prompt_len > 0 or not 0 < max_tokens <= 4096:
            raise MalformedMessage("request_id 1..256 characters, prompt_len and max_tokens > 0")
        peer = str(params.get("remote_engine_id", ""))
        return admission_answer(
            lambda: self.add_request(
                rid, prompt_len, max_tokens, params, peer_engine_id=peer, content_id=content_id
            )
        )

    async def _get_vllm_request(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        with self.lock:
            finished = self._finished.get(rid)
            held = rid in self._held
        body = json.dumps({"finished": finished, "held": held}, default=list)
        return web.Response(body=body.encode(), content_type="application/json")

    def held(self) -> int:
        with self.lock:
            return len(self._held)

    def abandon_held(self, message: str) -> int:
        """The drain deadline: every request held is given up with reason `shutdown`."""
        with self.lock:
            held = list(self._held)
        self.queue_outcomes(
            [o for rid in held if (o := self._give_up(rid, FailureType.SHUTDOWN, message))]
        )
        return len(held)

    def abort(self, request_id: str) -> bool:
        """The client aborts one request, as vLLM's API server does when its client leaves."""
        with self.lock:
            request = self.scheduler.requests.get(request_id)
            running = request is not None and not request.is_finished()
            if request_id not in self._held and not running:
                return False
        outcome = self._give_up(request_id, FailureType.ABORTED, "aborted by the client")
        if outcome is not None:
            self.queue_outcomes([outcome])
        return True

    def _give_up(self, rid: str, reason: FailureType, message: str) -> RequestOutcome | None:
        """Gives one request up. One vLLM still runs is aborted there (vLLM holds the blocks
        of one waiting for remote KV until the workers report it ended, once no WRITE can
        land); a prefill whose blocks wait for their decode gives them up. The outcome when
        the request ended here; None when it ends later (through its connector) or ended
        already."""
        with self.lock:
            held = self._held.get(rid)
            failure = FailedRequest(rid, reason, message)
            if held is not None:
                held.given_up = failure
            request = self.scheduler.requests.get(rid)
            self._count_abort_stage(rid, held, request)
            if request is not None and not request.is_finished():
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                if rid not in self.scheduler.requests:  # freed at once: no transfer to wait for
                    return self._end(rid, failure)
                return None
            if held is None or held.part != "send":
                return None
            if self.connector == "nixl":
                # vLLM's own connector frees the blocks when its lease ends; the
                # request ends here, as it would when the engine stops.
                return self._end(rid, failure)
            for worker in self.workers:
                if worker.sending is not None:
                    worker.sending.abandon(rid, reason, message)
        return None

    def _count_abort_stage(self, rid: str, held: _Held | None, request: Any) -> None:
        """Counts where an abort found request `rid` (call with the lock held)."""
        if held is not None and held.part == "send":
            senders = [getattr(w, "sending", None) for w in self.workers]
            writing = any(p is not None and p.writing(rid) for p in senders)
            if writing:
                stage = "send:writing"
            elif request is not None and not request.is_finished():
                stage = "send:prefilling"
            else:
                stage = "send:waiting-for-decode"
        elif request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # The workers may have reported its KV already, in a step whose output the
            # scheduler has not seen yet (async scheduling).
            stage = "recv:reported-unseen" if rid in self._reported else "recv:waiting-for-kv"
        elif held is not None and held.part == "recv":
            stage = "recv:queued"
        else:
            stage = "other"
        self.abort_stages[stage] = self.abort_stages.get(stage, 0) + 1

    def _rank_ender(self, rank: int) -> Any:
        def ended(rid: str, failure: FailedRequest | None) -> None:
            ends = self._rank_ends.setdefault(rid, {})
            ends[rank] = failure
            if len(ends) < self.tp_size:
                return
            del self._rank_ends[rid]
            self._reported_now.add(rid)
            failures = [f for _, f in sorted(ends.items()) if f is not None]
            outcome = self._end(rid, failures[0] if failures else None)
            if outcome is not None:
                self.queue_outcomes([outcome])

        return ended

    def _end(self, rid: str, failure: FailedRequest | None) -> RequestOutcome | None:
        """The outcome of `rid` (call with the lock held); None when it ended already or
        is not the engine's. A request the engine gave up that failed fails with the
        reason it was given up for."""
        held = self._held.pop(rid, None)
        if held is None:
            return None
        now = time.time()
        if failure is not None and held.given_up is not None:
            failure = held.given_up
        if failure is None and held.part == "recv":
            bad = self._mismatched_blocks(rid, held)
            if bad:
                failure = FailedRequest(
                    rid, FailureType.TRANSFER_FAILED, f"{bad} blocks failed verification"
                )
        if failure is not None:
            return RequestOutcome(
                request_id=rid,
                status="failed",
                reason=failure.reason,
                message=failure.message,
                peer_engine_id=held.peer_engine_id,
                ended_at=now,
            )
        nbytes = 0
        if held.part == "recv":
            nbytes = (
                sum(t[0].numel() * t.element_size() for t in self.kvs[0].values())
                * math.ceil(held.prompt_len / self.block_size)
                * self.tp_size
            )
            self.verified_bytes += nbytes
        return RequestOutcome(
            request_id=rid,
            status="done",
            verified_bytes=nbytes,
            peer_engine_id=held.peer_engine_id,
            ended_at=now,
        )

    def _fill(self, rid: str, block_ids: list[int]) -> None:
        for rank, kv in enumerate(self.kvs):
            for li, name in enumerate(self.layers):
                t = kv[name]
                for pos, b in enumerate(block_ids):
                    t[b].copy_(expected_block(rid, rank, li, pos, t[b]))

    def _mismatched_blocks(self, rid: str, held: _Held) -> int:
        """Blocks of decode request `rid` whose bytes differ from what the prefill wrote for
        its request `held.content_id`, over every rank and layer."""
        if rid not in self.scheduler.requests:
            return 0
        n = math.ceil(held.prompt_len / self.block_size)
        ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0][:n]
        bad = 0
        for rank, kv in enumerate(self.kvs):
            for li, name in enumerate(self.layers):
                t = kv[name]
                for pos, b in enumerate(ids):
                    expected = expected_block(held.content_id, rank, li, pos, t[b])
                    if not torch.equal(t[b], expected):
                        bad += 1
        return bad

    # --- the engine loop -----------------------------------------------------------------

    def step(self) -> bool:
        """One engine step (call with the lock held), as the engine core's batch queue
        takes one: schedule and execute a step while the queue has room, else hand the
        scheduler the oldest step's output. False when there was nothing to do."""
        sched = self.scheduler
        if sched.has_requests() or sched.connector.has_pending_push_work():
            out = sched.schedule()
            self._batches.appendleft((out, self._execute(out)))
            if len(self._batches) < self._depth:
                return True  # the next step is scheduled before this one's output is seen
        elif not self._batches:
            return False
        out, merged = self._batches.pop()
        self._update(out, merged)
        return True

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """What the model runners do with one scheduled step: the stand-in forward pass
        writes the prompt's KV of each request computed here, and every rank's connector
        is driven as vLLM's model runner drives it; the ranks' outputs combined."""
        sched = self.scheduler
        for new in out.scheduled_new_reqs:
            held = self._held.get(new.req_id)
            if held is not None and held.part != "recv":
                self._fill(new.req_id, list(new.block_ids[0]))
        self._reported_now = set()
        outputs = []
        for worker in self.workers:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            worker.wait_for_save()
            res = worker.get_transfer_results(out.finished_req_ids)
            errors = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            kv_output = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=errors,
            )
            outputs.append(offline.runner_output(out, kv_output, scheduler=sched))
        self._reported |= self._reported_now
        self._unseen[id(out)] = self._reported_now
        merged = self.aggregator.aggregate(outputs)
        if merged is None:
            raise RuntimeError("the ranks' outputs did not combine")
        return merged

    def _update(self, out: SchedulerOutput, merged: ModelRunnerOutput) -> None:
        """Hands the scheduler one executed step's output, and ends what it ended."""
        sched = self.scheduler
        ended: list[RequestOutcome] = []
        kvo = merged.kv_connector_output
        if self.connector == "nixl" and kvo is not None:
            # vLLM's own connector says nothing per rank: the combined output is the outcome.
            failed = set(kvo.failed_recving)
            for rid in [*(kvo.finished_sending or ()), *(kvo.finished_recving or ())]:
                failure = None
                if rid in failed:
                    failure = FailedRequest(rid, FailureType.TRANSFER_FAILED, "failed_recving")
                if (outcome := self._end(rid, failure)) is not None:
                    ended.append(outcome)
        engine_outputs = sched.update_from_output(out, merged)
        self._reported -= self._unseen.pop(id(out), set())
        for batch in engine_outputs.values():
            for o in batch.outputs:
                if o.finish_reason is None:
                    continue
                self._finished[o.request_id] = {
                    "reason": str(o.finish_reason),
                    "kv_transfer_params": o.kv_transfer_params,
                }
                while len(self._finished) > 10_000:
                    del self._finished[next(iter(self._finished))]
                held = self._held.get(o.request_id)
                if held is None:
                    continue
                if held.part == "plain":  # no KV moves: vLLM's answer is its end
                    if (outcome := self._end(o.request_id, None)) is not None:
                        ended.append(outcome)
                elif held.part == "send" and o.kv_transfer_params is None:
                    # vLLM ended the request without holding its blocks for a push (it
                    # was not computed to its end): no transfer will end it.
                    why = f"vLLM ended the request ({o.finish_reason}) before its KV was sent"
                    failure = FailedRequest(o.request_id, FailureType.SHUTDOWN, why)
                    if (outcome := self._end(o.request_id, failure)) is not None:
                        ended.append(outcome)
        if ended:
            self.queue_outcomes(ended)
        self.observe(kvo, engine_outputs)

    def observe(self, kv_output: KVConnectorOutput | None, engine_outputs: dict[int, Any]) -> None:
        """Called after every step with what the ranks told vLLM and what vLLM answered
        (for tests that watch vLLM's side of a request)."""

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self.lock:
                    busy = self.step()
            except Exception as exc:
                log.exception("engine step failed")
                self.step_error = f"{type(exc).__name__}: {exc}"
                busy = False
            if not busy:
                self._stop.wait(0.005)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvtopo_worker.vllm.engine",
        description="A prefill or decode vLLM engine (vLLM's scheduler, KVTopoConnector, "
        "real KV tensors and NIXL; the forward pass stood in for) that takes the emulated "
        "engine's command line and traffic. --block-bytes and --device are accepted and "
        "left to vLLM and NIXL; --progress-thread on|off sets KVTopoConnector's (vLLM's "
        "NixlPushConnector has no such setting: it runs NIXL's default, on). Prints one "
        "JSON line {engine_id, endpoint, role, incarnation, nixl_agent} when ready.",
    )
    add_engine_arguments(p)
    p.set_defaults(model_id="kvtopo-tiny-llama")
    p.add_argument(
        "--model-dir",
        default="",
        help="a model directory with a config.json (default: a tiny Llama-shaped one)",
    )
    p.add_argument("--failure-policy", choices=["fail", "recompute"], default="fail")
    p.add_argument(
        "--peer-token-file",
        default="",
        help="the token engines that pair lazily (no operator) share; lazy handshakes are "
        "on when it is given, unless --no-lazy-handshake",
    )
    p.add_argument("--no-lazy-handshake", action="store_true")
    p.add_argument(
        "--connector",
        choices=["kvtopo", "nixl"],
        default="kvtopo",
        help="KVTopoConnector, or vLLM's own NixlPushConnector (benchmarks: needs "
        "VLLM_TARGET_DEVICE=cpu and VLLM_NIXL_SIDE_CHANNEL_PORT in the environment)",
    )
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per KV block")
    p.add_argument(
        "--nixl-num-threads",
        type=int,
        default=None,
        metavar="N",
        help="the NIXL UCX backend's worker threads (NIXL's num_threads) of the connector's "
        "agents (default: the connector's: 0 for KVTopoConnector, 4 for vLLM's)",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="schedule synchronously (vLLM 0.33 schedules the next step before it sees "
        "the last one's output by default)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # stdout carries the ready line only: vLLM logs to stdout (VLLM_LOGGING_STREAM), so
    # everything written there from now on goes to stderr instead.
    sys.stdout.flush()
    ready_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    model_dir = args.model_dir or offline.shared_model_dir()
    if args.connector == "kvtopo":  # its transport reads them when its agents are made
        if args.progress_thread != "auto":
            os.environ["KVTOPO_NIXL_PROGRESS_THREAD"] = "1" if args.progress_thread == "on" else "0"
        if args.nixl_num_threads is not None:
            os.environ["KVTOPO_NIXL_NUM_THREADS"] = str(args.nixl_num_threads)
    elif args.progress_thread == "off":
        print(
            "kvtopo vllm engine: vLLM's NixlPushConnector has no progress-thread setting "
            "(it runs NIXL's default, on)",
            file=sys.stderr,
        )
        return 2
    try:
        engine = VllmEngine(
            role=args.role,
            engine_id=args.engine_id or uuid.uuid4().hex,
            model_dir=model_dir,
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            operator_key_file=args.operator_key_file,
            peer_token_file=args.peer_token_file or "",
            tp_size=args.tp,
            num_blocks=args.num_blocks,
            registration_timeout_s=args.registration_timeout,
            kv_lease_s=args.kv_lease,
            transfer_timeout_s=args.transfer_timeout,
            idle_ttl_s=args.idle_ttl,
            pod=(args.pod_namespace, args.pod_name, args.pod_uid),
            failure_policy=args.failure_policy,
            lazy_handshake=False if args.no_lazy_handshake else None,
            model_id=args.model_id,
            connector=args.connector,
            block_size=args.block_size,
            async_scheduling=not args.no_async_scheduling,
            nixl_num_threads=args.nixl_num_threads if args.connector == "nixl" else None,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvtopo vllm engine: {exc}", file=sys.stderr)
        return 2
    engine.start()
    ready: dict[str, Any] = {
        "engine_id": engine.engine_id,
        "endpoint": engine.endpoint,
        "role": engine.role,
        "incarnation": engine.incarnation,
        "nixl_agent": engine.nixl_agent_settings(),
    }
    engine.serve_until_signalled(ready, ready_out, args.drain_timeout)
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
