"""`kvtopo-worker`: an emulated prefill or decode engine that moves real KV bytes over NIXL.

Owns the stand-in for an LLM engine: per TP rank (`--tp N`) a NIXL agent, a KV cache of
equal blocks (host memory through numpy; CUDA memory through torch with `--device cuda`) and
a `PushConnector`; a block allocator shared by the ranks; deterministic KV content derived
from the request id and the rank (so the receiver verifies every byte it was pushed, and a
WRITE into the wrong rank fails); the engine thread that drains every rank's
`get_finished()` and ends a request once every rank has (done only when all are); and the
traffic routes of `kvtopo_worker.traffic` (POST /v1/requests: a prefill fills and offers the
request's blocks, a decode allocates blocks and registers them with the prefill engine; GET
/v1/finished; POST and GET /v1/drain).

Draining is an engine state, as in a real engine told to stop (a pod's preStop hook, or
SIGTERM, which drains the same way before the process exits): no request is accepted after
it begins, and every request accepted before ends with an outcome that can be collected.

Used by tests, the drill and the benchmarks; a real engine embeds `push` and `agent` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtopo_worker.agent import ControlServer, LocalEngine
from kvtopo_worker.credentials import TokenError, TokenSource
from kvtopo_worker.metrics import WorkerMetrics
from kvtopo_worker.protocol import (
    CompatInfo,
    FailureType,
    PodIdentity,
    RequestOutcome,
    Role,
    SubmitRequest,
)
from kvtopo_worker.push import FailedRequest, PushConfig, PushConnector, new_connector
from kvtopo_worker.registry import EngineRegistry
from kvtopo_worker.signing import PublicKeys
from kvtopo_worker.traffic import EngineDraining, EngineTraffic, add_engine_arguments
from kvtopo_worker.transport import NixlTransport

log = logging.getLogger(__name__)

_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit constants, as signed int64
_STRIDE = 0x6A09E667F3BCC909


def _request_seed(request_id: str) -> int:
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class HostKV:
    """One rank's KV cache in host memory: a (num_blocks, block_len) uint8 numpy array,
    registered with NIXL as DRAM. What an emulated engine holds by default: numpy, not
    torch, so a worker starts in about a second and a fifth of the memory (torch's import
    alone took 4 s and 600 MB a process)."""

    def __init__(self, num_blocks: int, block_len: int) -> None:
        self.num_blocks, self.block_len = num_blocks, block_len
        self.array = np.zeros((num_blocks, block_len), dtype=np.uint8)
        self._words = self.array.view(np.int64)

    @property
    def registrable(self) -> Any:
        """What `NixlTransport.register_kv_cache` takes."""
        return self.array

    def rows(self, first: int, n: int) -> npt.NDArray[np.int64]:
        """Blocks first..first+n-1 as int64 words, a view: writes land in the cache."""
        return self._words[first : first + n]

    def store(self, first: int, words: npt.NDArray[np.int64]) -> None:
        """Writes words computed in `rows(first, n)` itself: already in place."""

    def zero(self, block_ids: list[int]) -> None:
        self.array[block_ids] = 0

    def written(self, block_ids: list[int]) -> int:
        """How many of `block_ids` hold a byte that is not zero."""
        return int(np.count_nonzero(self.array[block_ids].any(axis=1)))


class DeviceKV:
    """One rank's KV cache in GPU memory (`--device cuda[:N]`): a torch tensor, registered
    as VRAM. Content is computed on the host and copied (torch is imported only here)."""

    def __init__(self, num_blocks: int, block_len: int, device: str) -> None:
        import torch

        self._torch = torch
        self.num_blocks, self.block_len = num_blocks, block_len
        self.tensor = torch.zeros((num_blocks, block_len), dtype=torch.uint8, device=device)

    @property
    def registrable(self) -> Any:
        return self.tensor

    def rows(self, first: int, n: int) -> npt.NDArray[np.int64]:
        """A host copy of blocks first..first+n-1 as int64 words (write back with `store`)."""
        host = self.tensor[first : first + n].cpu().numpy()
        return np.ascontiguousarray(host).view(np.int64)

    def store(self, first: int, words: npt.NDArray[np.int64]) -> None:
        src = self._torch.from_numpy(np.ascontiguousarray(words).view(np.uint8))
        self.tensor[first : first + len(words)].copy_(src)

    def zero(self, block_ids: list[int]) -> None:
        index = self._torch.tensor(block_ids, device=self.tensor.device)
        self.tensor.index_fill_(0, index, 0)

    def written(self, block_ids: list[int]) -> int:
        index = self._torch.tensor(block_ids, device=self.tensor.device)
        return int(self.tensor.index_select(0, index).any(dim=1).sum())


RankKV = HostKV | DeviceKV


def rank_kv(num_blocks: int, block_len: int, device: str = "cpu") -> RankKV:
    """A rank's KV cache on `device` ("cpu", or "cuda[:N]")."""
    if num_blocks <= 0 or block_len <= 0 or block_len % 8:
        raise ValueError("a KV cache needs blocks, of a length that is a multiple of 8 bytes")
    if device == "cpu":
        return HostKV(num_blocks, block_len)
    if not device.startswith("cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], not {device!r}")
    return DeviceKV(num_blocks, block_len, device)


class KVContent:
    """Deterministic KV bytes: word w of the k-th block of request R is
    w * MULT + seed(R) + k * STRIDE (int64, wrapping), so every byte depends on the request,
    the block's position in it and the byte's offset.

    Fill and check work on runs of adjacent blocks, in chunks that stay in the CPU cache,
    in place in host memory, so each costs one pass over the KV bytes (the data path is what
    is being measured, not this emulation)."""

    CHUNK_BYTES = 1 << 20

    def __init__(self, block_len: int) -> None:
        if block_len % 8:
            raise ValueError("block_len must be a multiple of 8 bytes")
        self.block_len = block_len
        self._rows = max(1, self.CHUNK_BYTES // block_len)
        with np.errstate(over="ignore"):
            self._ramp = (np.arange(block_len // 8, dtype=np.int64) * np.int64(_MULT))[None, :]
        self._scratch = np.empty((self._rows, block_len // 8), dtype=np.int64)

    def _runs(self, block_ids: list[int]) -> list[tuple[int, int, int]]:
        """(position in request, first block, count) for chunks of adjacent block ids."""
        runs: list[tuple[int, int, int]] = []
        pos = 0
        while pos < len(block_ids):
            n = 1
            while (
                pos + n < len(block_ids)
                and n < self._rows
                and block_ids[pos + n] == block_ids[pos] + n
            ):
                n += 1
            runs.append((pos, block_ids[pos], n))
            pos += n
        return runs

    def _offsets(self, request_id: str, pos: int, n: int) -> npt.NDArray[np.int64]:
        with np.errstate(over="ignore"):
            k = np.arange(pos, pos + n, dtype=np.int64) * np.int64(_STRIDE)
            return (k + np.int64(_request_seed(request_id)))[:, None]

    def fill(self, kv: RankKV, block_ids: list[int], request_id: str) -> None:
        """Writes request `request_id`'s content into `block_ids` of the cache."""
        for pos, first, n in self._runs(block_ids):
            out = kv.rows(first, n)
            np.add(self._ramp, self._offsets(request_id, pos, n), out=out)
            kv.store(first, out)

    def mismatched_blocks(self, kv: RankKV, block_ids: list[int], request_id: str) -> list[int]:
        """Positions (within the request) of blocks whose bytes are not what R's must be."""
        bad: list[int] = []
        for pos, first, n in self._runs(block_ids):
            expected = self._scratch[:n]
            np.add(self._ramp, self._offsets(request_id, pos, n), out=expected)
            actual = kv.rows(first, n)
            if not np.array_equal(actual, expected):
                rows = (actual == expected).all(axis=1)
                bad.extend(pos + int(i) for i in np.flatnonzero(~rows))
        return bad


@dataclass
class _Request:
    request_id: str
    peer_engine_id: str
    block_ids: list[int]


class EmulatedEngine(EngineTraffic):
    """One engine rank with a real NIXL agent, a KV cache and the control API."""

    def __init__(
        self,
        *,
        role: Role,
        engine_id: str | None = None,
        num_blocks: int = 256,
        block_len: int = 64 * 1024,
        model_id: str = "emulated",
        device: str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        operator_keys: PublicKeys,
        client_token: TokenSource | None = None,
        push_config: PushConfig | None = None,
        idle_ttl_s: float = 0.0,
        progress_thread: bool | None = None,
        handshake_timeout_s: float = 5.0,
        tp_size: int = 1,
        pod: PodIdentity | None = None,
        failing_after: int = 3,
    ) -> None:
        if not 1 <= tp_size <= 64:
            raise ValueError(f"tp_size must be 1..64, not {tp_size}")
        super().__init__()
        self.role: Role = role
        self.engine_id = engine_id or uuid.uuid4().hex
        # This process: new on every start, also under a pinned engine id. The agent names
        # carry it, so a restarted engine's agents never collide with its old ones.
        self.incarnation = uuid.uuid4().hex
        self.pod = pod
        self.tp_size = tp_size
        self.device = device
        self.metrics = WorkerMetrics()
        self.registry = EngineRegistry(
            remove_agent=self._remove_agent, idle_ttl_s=idle_ttl_s, failing_after=failing_after
        )
        self.content = KVContent(block_len)
        self._outcome_ready = threading.Event()  # set by every rank's connector
        compat = CompatInfo(block_len=block_len, model_id=model_id, dtype="uint8")
        # One NIXL agent, KV cache and connector per TP rank, as vLLM's TP workers have;
        # the ranks share the block ids of a request (and the registry of peers).
        self.transports: list[NixlTransport] = []
        self.kvs: list[RankKV] = []
        self.connectors: list[PushConnector] = []
        metas = []
        for rank in range(tp_size):
            transport = NixlTransport(
                f"kvtopo-{self.engine_id}-{self.incarnation[:12]}-r{rank}",
                progress_thread=progress_thread,
                on_unauthenticated=self.metrics.unauthenticated,
            )
            kv = rank_kv(num_blocks, block_len, device)
            connector = new_connector(
                engine_id=self.engine_id,
                role=role,
                transport=transport,
                registry=self.registry,
                metrics=self.metrics,
                config=push_config,
                tp_rank=rank,
                outcome_ready=self._outcome_ready,
            )
            connector.register_kv_caches(kv.registrable)
            metas.append(
                transport.describe(
                    engine_id=self.engine_id,
                    role=role,
                    compat=compat,
                    tp_rank=rank,
                    tp_size=tp_size,
                    incarnation=self.incarnation,
                    pod=pod,
                )
            )
            self.transports.append(transport)
            self.kvs.append(kv)
            self.connectors.append(connector)
        self.server = ControlServer(
            engine=LocalEngine(self.engine_id, role, metas[0], time.time(), ranks=metas),
            registry=self.registry,
            transport=self.transports,
            operator_keys=operator_keys,
            client_token=client_token,
            metrics=self.metrics,
            host=host,
            port=port,
            handshake_timeout_s=handshake_timeout_s,
            request_counts=self.request_counts,
        )
        self.add_routes(self.server.app)
        self._alloc_lock = self.admission  # also guards the block allocator
        self._free = deque(range(num_blocks))
        self._requests: dict[str, _Request] = {}
        # Per request, the ranks that ended it so far (None: done; else the failure).
        self._rank_ends: dict[str, dict[int, FailedRequest | None]] = {}
        self._ends_lock = threading.Lock()
        self._stop = threading.Event()
        self._engine_thread = threading.Thread(
            target=self._engine_loop, name="kvtopo-engine", daemon=True
        )
        self.verified_bytes = 0

    def _remove_agent(self, agent_name: str) -> None:
        """Registry teardown: the agent lives in the transport of the rank it pairs with
        (removing it from the others is a no-op)."""
        for transport in self.transports:
            transport.remove_remote(agent_name)

    def _rank_request_id(self, request_id: str, rank: int) -> str:
        """What rank `rank`'s KV content of a request derives from (each rank holds other
        bytes, so a WRITE into the wrong rank fails verification)."""
        return request_id if rank == 0 else f"{request_id}#tp{rank}"

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> None:
        for connector in self.connectors:
            connector.start()
        self._engine_thread.start()
        self.server.start()

    def stop(self) -> None:
        """Stops the engine; a request still held fails with reason `shutdown` (its outcome
        is queued, but nobody can collect it once the control server is gone: drain first)."""
        self._stop.set()
        self.cancel_drain_deadline()
        self._engine_thread.join(5)
        self.fail_held("the engine stopped before the request ended")
        self.server.stop()
        for connector in self.connectors:
            connector.stop()
        for transport in self.transports:
            transport.close()

    # --- draining --------------------------------------------------------------------------

    def held(self) -> int:
        """Requests accepted that have not ended yet."""
        with self._alloc_lock:
            return len(self._requests)

    def abandon_held(self, message: str) -> int:
        """Gives every request still held up with reason `shutdown` (the drain deadline):
        each rank ends its part as soon as no WRITE of it can land any more (a decode
        cancels its registrations and waits for the prefill's answer), so the peer engine
        reports the same outcome. Returns how many requests were held."""
        with self._alloc_lock:
            held = [req.request_id for req in self._requests.values()]
        for rid in held:
            for connector in self.connectors:
                connector.abandon(rid, FailureType.SHUTDOWN, message)
        return len(held)

    def settles_within(self) -> float:
        return max((c.settles_within() for c in self.connectors), default=0.0)

    def abort(self, request_id: str) -> bool:
        """Gives one request up with reason `aborted` on every rank (each rank ends its part
        once no WRITE of it can land); False when the request is not held."""
        with self._alloc_lock:
            if request_id not in self._requests:
                return False
        for connector in self.connectors:
            connector.abandon(request_id, FailureType.ABORTED, "aborted by the client")
        return True

    def fail_held(self, message: str) -> int:
        """Ends every request still held as failed with reason `shutdown` at once; returns
        how many. For an engine that stops for good (its memory is about to be released, so
        no WRITE can land in it any more)."""
        with self._alloc_lock:
            held = list(self._requests.values())
            self._requests.clear()
            for req in held:
                self._free.extend(req.block_ids)
        if not held:
            return 0
        now = time.time()
        outcomes = [
            RequestOutcome(
                request_id=req.request_id,
                status="failed",
                reason=FailureType.SHUTDOWN,
                message=message,
                peer_engine_id=req.peer_engine_id,
                ended_at=now,
            )
            for req in held
        ]
        for req in held:
            self.metrics.record_failure(
                FailureType.SHUTDOWN, {"request_id": req.request_id, "msg": message}
            )
        self.queue_outcomes(outcomes)
        return len(held)

    # --- requests ------------------------------------------------------------------------

    def submit(self, req: SubmitRequest) -> None:
        """Starts a request; raises ValueError when it cannot be taken (nothing is lost)."""
        if not 0 < req.num_blocks <= self.kvs[0].num_blocks:
            raise ValueError(f"num_blocks must be 1..{self.kvs[0].num_blocks}")
        with self._alloc_lock:
            if self.draining:
                raise EngineDraining("the engine is draining: it takes no new requests")
            if req.request_id in self._requests:
                raise ValueError(f"request {req.request_id} is already in flight")
            if len(self._free) < req.num_blocks:
                raise BlockingIOError(f"only {len(self._free)} free KV blocks")
            blocks = [self._free.popleft() for _ in range(req.num_blocks)]
            if self.role == "decode":
                self._guard_free_blocks(blocks)
            self._requests[req.request_id] = _Request(req.request_id, req.peer_engine_id, blocks)
        # Every rank takes its part, or (nothing taken yet) none does.
        if self.role == "prefill":
            for rank, kv in enumerate(self.kvs):
                self.content.fill(kv, blocks, self._rank_request_id(req.request_id, rank))
        taken = 0  # ranks that hold the request
        try:
            for connector in self.connectors:
                if self.role == "prefill":
                    connector.request_send(req.request_id, blocks, req.peer_engine_id)
                else:
                    connector.request_receive(req.request_id, req.peer_engine_id, blocks)
                taken += 1
        except Exception:
            if taken == 0:
                self._release(req.request_id)
                raise
            # Ranks below `taken` hold it: end it through them, failed (not lost).
            log.exception("rank %d refused request %s", taken, req.request_id)
            for r in range(taken, self.tp_size):
                failure = FailedRequest(
                    req.request_id, FailureType.TRANSFER_SETUP_FAILED, f"rank {r} refused it"
                )
                with self._ends_lock:
                    self._rank_ends.setdefault(req.request_id, {})[r] = failure
        self.accepted()

    def _release(self, request_id: str) -> _Request | None:
        with self._alloc_lock:
            req = self._requests.pop(request_id, None)
            if req is not None:
                if self.role == "decode":  # free blocks hold zeros: see _guard_free_blocks
                    for kv in self.kvs:
                        kv.zero(req.block_ids)
                self._free.extend(req.block_ids)
            return req

    def _guard_free_blocks(self, blocks: list[int]) -> None:
        """A decode's free blocks hold zeros (a released request's blocks are zeroed): one
        that does not when it is taken again was written while nobody held it, by a WRITE
        that landed after its request ended. Counted (`kvtopo_worker_late_writes`) and
        logged; the drill and the tests require 0. Call with the allocator lock held."""
        late = sum(kv.written(blocks) for kv in self.kvs)
        if late:
            self.late_writes += late
            self.metrics.late_writes_total.inc(late)
            log.error("%d free KV blocks were written after their request ended", late)

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            ended: list[tuple[str, int, FailedRequest | None]] = []
            for rank, connector in enumerate(self.connectors):
                fin = connector.get_finished()
                ended += [(rid, rank, None) for rid in fin.done_sending]
                ended += [(rid, rank, None) for rid in fin.done_receiving]
                ended += [(f.request_id, rank, f) for f in fin.failed]
            now = time.time()
            outcomes = [o for rid, rank, f in ended if (o := self._rank_ended(rid, rank, f, now))]
            if outcomes:
                self.queue_outcomes(outcomes)
            elif not ended:
                self.connectors[0].wait_finished(0.05)  # the ranks share the event

    def _rank_ended(
        self, request_id: str, rank: int, failure: FailedRequest | None, now: float
    ) -> RequestOutcome | None:
        """Records that one rank ended a request; once every rank has, the request's
        outcome (done only when every rank's part is done, and on a decode every rank's
        bytes verified), its blocks handed back. None while ranks are still running it, or
        when it ended already (failed at shutdown)."""
        with self._ends_lock:
            ends = self._rank_ends.setdefault(request_id, {})
            ends[rank] = failure
            if len(ends) < self.tp_size:
                return None
            del self._rank_ends[request_id]
        failures = [f for _, f in sorted(ends.items()) if f is not None]
        if not failures and self.role == "decode":
            return self._verify(request_id, now)
        req = self._release(request_id)
        if req is None:  # already ended (failed at shutdown)
            return None
        if not failures:
            return RequestOutcome(
                request_id=request_id,
                status="done",
                peer_engine_id=req.peer_engine_id,
                ended_at=now,
            )
        first = failures[0]
        return RequestOutcome(
            request_id=request_id,
            status="failed",
            reason=first.reason,
            message=first.message,
            peer_engine_id=req.peer_engine_id,
            ended_at=now,
        )

    def _verify(self, request_id: str, now: float) -> RequestOutcome | None:
        """The outcome of a pushed request, every byte of every rank checked; None when the
        request has ended already (failed at shutdown)."""
        with self._alloc_lock:
            req = self._requests.get(request_id)
        if req is None:
            return None
        bad = 0
        for rank, kv in enumerate(self.kvs):
            content_id = self._rank_request_id(request_id, rank)
            bad += len(self.content.mismatched_blocks(kv, req.block_ids, content_id))
        if self._release(request_id) is None:  # failed at shutdown meanwhile
            return None
        if bad:
            self.metrics.record_failure(
                FailureType.TRANSFER_FAILED,
                {"request_id": request_id, "msg": f"{bad} blocks hold the wrong bytes"},
            )
            return RequestOutcome(
                request_id=request_id,
                status="failed",
                reason=FailureType.TRANSFER_FAILED,
                message=f"{bad} blocks failed verification",
                peer_engine_id=req.peer_engine_id,
                ended_at=now,
            )
        nbytes = len(req.block_ids) * self.kvs[0].block_len * self.tp_size
        self.verified_bytes += nbytes
        return RequestOutcome(
            request_id=request_id,
            status="done",
            verified_bytes=nbytes,
            peer_engine_id=req.peer_engine_id,
            ended_at=now,
        )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtopo-worker",
        description="An emulated prefill or decode engine: a KV cache in host memory (numpy; "
        "torch with --device cuda), a real NIXL agent "
        "and the kvtopo control API. Prints one JSON line {engine_id, endpoint, role} on "
        "stdout when ready.",
    )
    add_engine_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if not args.operator_key_file:
        print(
            "kvtopo-worker: give --operator-key-file (or set KVTOPO_OPERATOR_KEY_FILE): the "
            "operator's public key, which the admin routes' calls must be signed for",
            file=sys.stderr,
        )
        return 2
    try:
        operator_keys = PublicKeys(path=args.operator_key_file)
        client_token = TokenSource(path=args.token_file) if args.token_file else None
    except TokenError as exc:
        print(f"kvtopo-worker: {exc}", file=sys.stderr)
        return 2
    progress = {"auto": None, "on": True, "off": False}[args.progress_thread]
    pod = None
    if args.pod_uid or args.pod_name or args.pod_namespace:
        if not (args.pod_uid and args.pod_name and args.pod_namespace):
            print(
                "kvtopo-worker: give all of --pod-namespace, --pod-name and --pod-uid (or none)",
                file=sys.stderr,
            )
            return 2
        pod = PodIdentity(namespace=args.pod_namespace, name=args.pod_name, uid=args.pod_uid)
    try:
        push_config = PushConfig(
            registration_timeout_s=args.registration_timeout,
            kv_lease_s=args.kv_lease,
            transfer_timeout_s=args.transfer_timeout,
        )
    except ValueError as exc:
        print(f"kvtopo-worker: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.tp <= 64:
        print(f"kvtopo-worker: --tp must be 1..64, not {args.tp}", file=sys.stderr)
        return 2
    if not 1 <= args.failing_after <= 1_000_000:
        print(
            f"kvtopo-worker: --failing-after must be 1..1000000, not {args.failing_after}",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.drain_timeout <= 3600:
        print(
            f"kvtopo-worker: --drain-timeout must be 0..3600 s, not {args.drain_timeout}",
            file=sys.stderr,
        )
        return 2
    engine = EmulatedEngine(
        role=args.role,
        engine_id=args.engine_id,
        num_blocks=args.num_blocks,
        block_len=args.block_bytes,
        model_id=args.model_id,
        device=args.device,
        host=args.host,
        port=args.port,
        operator_keys=operator_keys,
        client_token=client_token,
        push_config=push_config,
        idle_ttl_s=args.idle_ttl,
        progress_thread=progress,
        tp_size=args.tp,
        pod=pod,
        failing_after=args.failing_after,
    )
    try:
        engine.start()
    except RuntimeError as exc:
        print(f"kvtopo-worker: {exc}", file=sys.stderr)
        return 1
    ready = {
        "engine_id": engine.engine_id,
        "endpoint": engine.endpoint,
        "role": engine.role,
        "incarnation": engine.incarnation,
    }
    engine.serve_until_signalled(ready, sys.stdout, args.drain_timeout, engine._stop)
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
