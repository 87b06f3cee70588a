"""The NIXL data path: the only module of kvtopo that imports nixl.

Owns one NIXL agent per engine rank: its registered KV cache (`num_blocks` equal blocks: a
numpy array in host memory, or a torch tensor, CPU or CUDA), the prepped local descriptor
list over those blocks, the remote agents it has added with their prepped descriptor lists,
notifications, and WRITE transfers. Straight-line NIXL usage: register, exchange metadata,
prep descriptors, transfer, poll against a deadline, release in reverse order.

Thread safety: NIXL does not promise it, so every call into the agent goes through one lock
(the explicit sync mode of design.md). The lock is the transport's own and is never held
together with the registry lock: callers snapshot the registry first, then call in here.

Block merging: a WRITE whose block ids run consecutively on both sides (a request's blocks
usually do) is posted as one descriptor per run instead of one per block, through an
ad-hoc descriptor list over the same registered memory; blocks that do not run together
use the prepped per-block lists. Off by default (the CPU numbers do not support it, see
`merge_blocks_default`); `merge_blocks=True` or KVTOPO_MERGE_BLOCKS=1 turns it on, and
`bench push` measures both.

Notifications are sealed (`seal`): each agent has a key pair, new with the process, whose
public half goes in its metadata; `add_remote_peer` derives the key shared with that peer's
agent, `send_notif` and a WRITE's completion seal with it, and `get_notifs` hands on only
what opens with the key of the agent NIXL names as its sender (what does not, from an agent
never added or a forger posing under a real agent's name, is dropped and counted). The keys
of agents removed recently are kept, so a late answer of an evicted process still counts.

A peer's block descriptors are built outside the lock (a peer may describe millions of
blocks; the WRITEs of other peers go on meanwhile), and a peer may describe no more blocks
than `max_peer_blocks` (by default 16 times ours, at least 65,536).

`KVTransport` is the interface `push` and `agent` use; unit tests inject a fake built through
the real constructors of those modules.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from kvtopo_worker.protocol import (
    CompatInfo,
    EngineMetadata,
    KVSegment,
    MemoryKind,
    PodIdentity,
    Role,
    compat_hash,
)
from kvtopo_worker.seal import NotifKey, PairKey, SealError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

XferState = Literal["DONE", "PROC", "ERR"]
FORMER_PAIRS_KEPT = 4096  # keys of removed agents whose late notifications still open
# NIXL transfer handles are opaque binding objects; fakes may use anything hashable.
XferHandle = Any


class TransportError(Exception):
    """A NIXL call failed; `kind` is 'not_found' (the agent is not, or no longer, added),
    'disconnected' (NIXL says the remote agent disconnected: its process died or the link
    broke, and every later call to it fails the same way until it is added anew),
    'identity' (metadata of another agent), 'invalid' (refused before NIXL was called: a
    block id out of range) or 'error' (any other NIXL failure)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class RemoteKV:
    """A remote agent as the transport addresses it: its blocks lie back to back from
    `base` on `device` (as its EngineMetadata says, and NIXL checked at prep time)."""

    agent_name: str
    num_blocks: int
    block_len: int
    base: int
    device: int
    mem_enum: Any = None  # NIXL's memory-kind value of the far blocks (for merged WRITEs)
    segments: int = 1  # descriptors per block (block b's are b * segments ...)


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) of the stretches where both id lists count up by
    one together; the lists are of equal length."""
    n = len(local_ids)
    if n and local_ids[-1] - local_ids[0] == n - 1 and remote_ids[-1] - remote_ids[0] == n - 1:
        l0, r0 = local_ids[0], remote_ids[0]
        if list(local_ids) == list(range(l0, l0 + n)) and list(remote_ids) == list(
            range(r0, r0 + n)
        ):
            return [(l0, r0, n)]
    runs: list[tuple[int, int, int]] = []
    for lid, rid in zip(local_ids, remote_ids, strict=True):
        if runs:
            ls, rs, length = runs[-1]
            if lid == ls + length and rid == rs + length:
                runs[-1] = (ls, rs, length + 1)
                continue
        runs.append((lid, rid, 1))
    return runs


def merge_blocks_default() -> bool:
    """Off unless KVTOPO_MERGE_BLOCKS=1: on CPU over UCX shared memory an ad-hoc descriptor
    list per WRITE cost more than the per-block descriptors it saved (`bench push`: raw
    NIXL 6.6 against 7.0 GB/s, push 5.6 against 5.7, 32 KiB blocks); unmeasured on GPU."""
    env = os.environ.get("KVTOPO_MERGE_BLOCKS", "")
    return env.strip().lower() in ("1", "true", "yes", "on")


Room = Callable[[str, int], int]


class KVTransport(Protocol):
    """What the push path needs from a transport (real NIXL or a unit-test fake)."""

    agent_name: str

    def send_notif(self, agent_name: str, payload: bytes) -> None: ...

    def get_notifs(self, room: Room | None = None) -> list[tuple[str, bytes]]:
        """The notifications received since the last call, opened (authenticated), each
        sender's in arrival order. `room(agent, n)`: of the `n` a sender has waiting, how
        many to take; the rest are dropped unopened (a flooder's excess costs nothing)."""
        ...

    def write_blocks(
        self,
        agent_name: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> tuple[XferHandle, XferState]: ...

    def poll(self, handle: XferHandle) -> XferState:
        """The WRITE's state; may raise TransportError('disconnected') when NIXL says its
        remote agent disconnected (the WRITE has then failed)."""
        ...

    def release(self, handle: XferHandle) -> bool: ...

    def remove_remote(self, agent_name: str) -> None: ...

    # Optional (looked up with getattr; transports without it are not probed):
    # `remote_known(agent_name) -> bool`, whether NIXL still holds the agent's metadata.


def progress_thread_default() -> bool:
    """Whether NIXL's progress thread should run, unless the user says otherwise.

    The thread busy-polls a whole core per agent even when idle; on a host with few cores
    per agent (measured on 2 cores: half the throughput, 5 CPU-s per 5 s idle) it is off and
    progress is driven by the polling calls. On hosts with >= 8 cores per worker it helps
    latency under load and costs little. KVTOPO_NIXL_PROGRESS_THREAD=0|1 overrides.
    """
    env = os.environ.get("KVTOPO_NIXL_PROGRESS_THREAD")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    return (os.cpu_count() or 1) >= 8


def nixl_num_threads_default() -> int:
    """The UCX backend's worker threads (NIXL's `num_threads`; 0, NIXL's default: none, the
    progress thread or the polling calls drive the one shared worker). vLLM's NixlConnector
    passes 4. KVTOPO_NIXL_NUM_THREADS=N overrides (side-by-side benchmarks)."""
    env = os.environ.get("KVTOPO_NIXL_NUM_THREADS", "").strip()
    return max(0, int(env)) if env else 0


def nixl_library_progress_thread_default() -> bool:
    """NIXL's own default for the progress thread (`nixl_agent_config`'s), which is what an
    engine that never sets it runs with (vLLM's NixlConnector)."""
    import inspect

    from nixl._api import nixl_agent_config

    default = inspect.signature(nixl_agent_config).parameters["enable_prog_thread"].default
    return bool(default)


def _quiet_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines to stdout; keep stdout for our own output."""
    nixl_log = logging.getLogger("nixl")
    if "NIXL_LOG_LEVEL" not in os.environ:
        nixl_log.setLevel(logging.WARNING)
    for handler in nixl_log.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _classify(exc: BaseException) -> str:
    name = type(exc).__name__
    if "NotFound" in name:
        return "not_found"
    if "Disconnect" in name:
        return "disconnected"
    return "error"


class NixlTransport:
    """One NIXL agent with one registered KV cache of equal blocks (one tensor, or a block's
    parts spread over segments of several tensors, as a vLLM KV cache per layer)."""

    def __init__(
        self,
        agent_name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool | None = None,
        num_threads: int | None = None,
        merge_blocks: bool | None = None,
        on_unauthenticated: Callable[[str, bool], None] | None = None,
        max_peer_blocks: int | None = None,
    ) -> None:
        """`on_unauthenticated(agent, known)` is called for every notification dropped
        because it did not open with that agent's key (`known`: an agent we hold or held,
        so a forgery or an altered message; else an agent never added, as when a peer
        greets before we added it), for the caller's metrics. `progress_thread` and
        `num_threads` (the UCX backend's worker threads) default to
        :func:`progress_thread_default` and :func:`nixl_num_threads_default`."""
        from nixl._api import nixl_agent, nixl_agent_config

        _quiet_nixl_logging()
        self.agent_name = agent_name
        self.progress_thread = (
            progress_thread_default() if progress_thread is None else progress_thread
        )
        self.num_threads = nixl_num_threads_default() if num_threads is None else num_threads
        cfg = nixl_agent_config(
            enable_prog_thread=self.progress_thread,
            enable_listen_thread=False,
            num_threads=self.num_threads,
            backends=list(backends),
        )
        self._lock = threading.Lock()
        self._agent: Any = nixl_agent(agent_name, cfg)
        self._reg_descs: Any = None
        self._local_dlist: int | None = None
        self._kv: list[object] = []  # what owns the registered memory (kept alive)
        self._segments: list[KVSegment] = []
        self._num_blocks = 0
        self._block_len = 0
        self._mem_type = "DRAM"
        self._remotes: dict[str, tuple[int, RemoteKV]] = {}
        self.notif_key = NotifKey()
        self._pairs: dict[str, PairKey] = {}
        self._former_pairs: OrderedDict[str, PairKey] = OrderedDict()
        self._on_unauthenticated = on_unauthenticated
        self.unauthenticated = 0
        self._max_peer_blocks = max_peer_blocks
        self._adding: set[str] = set()  # agents whose descriptors are being built
        self._closed = False
        self.merge_blocks = merge_blocks_default() if merge_blocks is None else merge_blocks
        self._base = 0
        self._device = 0
        self._mem_enum: Any = None
        self._dlist_type: Any = None

    # --- local memory --------------------------------------------------------------------

    def register_kv_cache(self, kv: torch.Tensor | npt.NDArray[np.uint8]) -> None:
        """Registers a contiguous (num_blocks, block_len) uint8 tensor or numpy array (host
        memory) as the KV cache."""
        if isinstance(kv, np.ndarray):
            if kv.ndim != 2 or kv.dtype != np.uint8 or not kv.flags.c_contiguous:
                raise ValueError("the KV cache must be a contiguous 2-D uint8 array")
            num_blocks, block_len = (int(n) for n in kv.shape)
            segment = KVSegment(int(kv.ctypes.data), block_len, block_len)
            self._register([kv], [(segment.addr, kv.nbytes)], "DRAM", 0, [segment], num_blocks)
            return
        if kv.dim() != 2 or not kv.is_contiguous():
            raise ValueError("the KV cache must be a contiguous 2-D (num_blocks, block_len) tensor")
        block_len = int(kv.shape[1]) * kv.element_size()
        segment = KVSegment(kv.data_ptr(), block_len, block_len)
        self.register_kv_segments([kv], [segment], int(kv.shape[0]))

    def register_kv_segments(
        self, tensors: Sequence[torch.Tensor], segments: Sequence[KVSegment], num_blocks: int
    ) -> None:
        """Registers the memory of `tensors` (all on one device) as a KV cache of
        `num_blocks` blocks, block i being its part in each of `segments` in order
        (`KVSegment`: block i's part at `addr + i * stride`). One descriptor per block and
        segment is prepped, block-major. The caller keeps `tensors` alive."""
        if not tensors or not segments or num_blocks <= 0:
            raise ValueError("a KV cache needs a tensor, a segment and a block")
        first = tensors[0]
        if any(t.device != first.device for t in tensors):
            raise ValueError("the KV tensors must all live on one device")
        # The memory behind the tensors, each allocation once (vLLM's layers are views of
        # one buffer): what NIXL registers, and what every segment must lie in.
        spans = sorted(
            {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
        )
        spans = [(lo, lo + n) for lo, n in spans]
        for seg in segments:
            last = seg.addr + (num_blocks - 1) * seg.stride + seg.length
            if seg.length <= 0 or seg.stride < seg.length:
                raise ValueError(f"KV segment {seg}: its length must be 1..stride")
            if not any(lo <= seg.addr and last <= hi for lo, hi in spans):
                raise ValueError(f"KV segment {seg} leaves the given tensors by block {num_blocks}")
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        dev = first.device.index or 0 if first.is_cuda else 0
        self._register(
            tensors, [(lo, hi - lo) for lo, hi in spans], mem_type, dev, segments, num_blocks
        )

    def _register(
        self,
        memory: Sequence[object],
        spans: Sequence[tuple[int, int]],
        mem_type: str,
        dev: int,
        segments: Sequence[KVSegment],
        num_blocks: int,
    ) -> None:
        """Registers the memory spans (address, bytes) and preps one descriptor per block
        and segment, block-major; keeps `memory` (what owns the spans) alive."""
        self._mem_type = mem_type
        segs = list(segments)
        with self._lock:
            regions = [(lo, n, dev, "") for lo, n in spans]
            self._reg_descs = self._agent.register_memory(regions, self._mem_type)
            parts = [
                (seg.addr + i * seg.stride, seg.length, dev)
                for i in range(num_blocks)
                for seg in segs
            ]
            descs = self._agent.get_xfer_descs(parts, self._mem_type)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs)
            self._base, self._device = segs[0].addr, dev
            self._mem_enum, self._dlist_type = descs.getType(), type(descs)
        self._kv, self._segments = list(memory), segs
        self._num_blocks, self._block_len = num_blocks, sum(s.length for s in segs)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def agent_metadata(self) -> bytes:
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def kv_region(self) -> tuple[int, int, MemoryKind]:
        """(address of block 0, device, memory kind) of our KV cache: what a peer needs, with
        `num_blocks` and `block_len`, to rebuild our block descriptors (EngineMetadata)."""
        return self._base, self._device, "VRAM" if self._mem_type == "VRAM" else "DRAM"

    def describe(
        self,
        *,
        engine_id: str,
        role: Role,
        compat: CompatInfo,
        tp_rank: int = 0,
        tp_size: int = 1,
        incarnation: str = "",
        pod: PodIdentity | None = None,
    ) -> EngineMetadata:
        """This rank's EngineMetadata (call after `register_kv_cache`); `incarnation` and
        `pod` say which process and pod the engine is."""
        kv_addr, kv_device, kv_mem = self.kv_region()
        return EngineMetadata(
            engine_id=engine_id,
            role=role,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata(),
            kv_addr=kv_addr,
            kv_device=kv_device,
            kv_mem=kv_mem,
            num_blocks=self._num_blocks,
            block_len=self._block_len,
            tp_rank=tp_rank,
            tp_size=tp_size,
            compat=compat,
            compat_hash=compat_hash(compat),
            incarnation=incarnation,
            pod=pod,
            kv_segments=self._segments if len(self._segments) > 1 else [],
            notif_key=self.notif_key.public,
        )

    @property
    def max_peer_blocks(self) -> int:
        """The most blocks (times segments) a peer's metadata may describe."""
        if self._max_peer_blocks is not None:
            return self._max_peer_blocks
        return max(16 * self._num_blocks * max(1, len(self._segments)), 1 << 16)

    def remote_num_blocks(self, agent_name: str) -> int | None:
        """How many KV blocks a peer agent's metadata described (None: not added)."""
        with self._lock:
            entry = self._remotes.get(agent_name)
        return entry[1].num_blocks if entry is not None else None

    # --- remote agents -------------------------------------------------------------------

    def add_remote_peer(self, meta: EngineMetadata) -> str:
        """Adds a peer rank's NIXL agent and preps descriptors over its KV blocks; returns
        the agent name. Idempotent for an agent already added.

        Nothing the peer sent is unpickled: the block descriptors are rebuilt here from the
        plain numbers of `meta`, and NIXL refuses them (not_found) unless they lie within
        memory the peer's agent registered. The agent name inside NIXL's blob must be the
        one `meta` names; on a mismatch a newly loaded agent is unloaded again and the call
        raises TransportError('identity').
        """
        segs = meta.segments()
        if meta.num_blocks * len(segs) > self.max_peer_blocks:
            raise TransportError(
                f"agent {meta.agent_name} describes {meta.num_blocks} blocks x {len(segs)} "
                f"segments; a peer of this engine may describe at most {self.max_peer_blocks}",
                "invalid",
            )
        if [s.length for s in segs] != [s.length for s in self._segments] and (
            len(segs) > 1 or len(self._segments) > 1
        ):
            raise TransportError(
                f"agent {meta.agent_name}'s KV blocks are cut into segments of "
                f"{[s.length for s in segs][:8]} bytes, ours into "
                f"{[s.length for s in self._segments][:8]}",
                "invalid",
            )
        try:
            pair = self.notif_key.pair(meta.notif_key, self.agent_name, meta.agent_name)
        except SealError as exc:
            raise TransportError(f"agent {meta.agent_name}: {exc}", "invalid") from None
        with self._lock:
            if meta.agent_name in self._adding:
                raise TransportError(f"agent {meta.agent_name} is being added already", "invalid")
            self._adding.add(meta.agent_name)
        try:
            return self._add_remote(meta, segs, pair)
        finally:
            with self._lock:
                self._adding.discard(meta.agent_name)

    def _add_remote(self, meta: EngineMetadata, segs: list[KVSegment], pair: PairKey) -> str:
        with self._lock:
            known = set(self._remotes)
            try:
                raw = self._agent.add_remote_agent(meta.agent_metadata)
            except Exception as exc:
                raise TransportError(f"adding remote agent failed: {exc}", _classify(exc)) from exc
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name != meta.agent_name:
                if name not in known:
                    self._unload(name)
                raise TransportError(
                    f"the NIXL metadata is agent {name!r}'s, the engine says {meta.agent_name!r}",
                    "identity",
                )
            if name in self._remotes:
                return name
        # The descriptors of the peer's blocks, built off the lock: the WRITEs and
        # notifications of other peers go on meanwhile.
        blocks = [
            (seg.addr + i * seg.stride, seg.length, meta.kv_device)
            for i in range(meta.num_blocks)
            for seg in segs
        ]
        with self._lock:
            try:
                descs = self._agent.get_xfer_descs(blocks, meta.kv_mem)
                dlist = self._agent.prep_xfer_dlist(name, descs)
            except Exception as exc:
                self._unload(name)
                kind = _classify(exc)
                why = " lies outside the memory its agent registered" if kind == "not_found" else ""
                raise TransportError(
                    f"the KV region of agent {name}{why}: {type(exc).__name__}: {exc}", kind
                ) from exc
            remote = RemoteKV(
                name,
                meta.num_blocks,
                meta.block_len,
                meta.kv_addr,
                meta.kv_device,
                descs.getType(),
                len(segs),
            )
            self._remotes[name] = (dlist, remote)
            self._pairs[name] = pair
            self._former_pairs.pop(name, None)
            return name

    def _unload(self, agent_name: str) -> None:
        """Removes an agent NIXL loaded that was never prepped (call with the lock held)."""
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:
            log.warning("unloading agent %s: %s", agent_name, exc)

    def remove_remote(self, agent_name: str) -> None:
        """Releases the peer's descriptor list and removes its agent (idempotent)."""
        with self._lock:
            entry = self._remotes.pop(agent_name, None)
            if entry is None:
                return
            pair = self._pairs.pop(agent_name, None)
            if pair is not None:  # a late answer of its process still opens
                self._former_pairs[agent_name] = pair
                if len(self._former_pairs) > FORMER_PAIRS_KEPT:
                    self._former_pairs.popitem(last=False)
            try:
                self._agent.release_dlist_handle(entry[0])
            finally:
                self._agent.remove_remote_agent(agent_name)

    # --- raw access for the benchmark's NIXL floor ---------------------------------------

    @property
    def raw_agent(self) -> Any:
        """The underlying nixl_agent (benchmarks measure raw NIXL on the same descriptors)."""
        return self._agent

    def prepped_dlists(self, agent_name: str) -> tuple[Any, Any]:
        """(local, remote) prepped descriptor lists over all blocks, for raw benchmarks."""
        with self._lock:
            return self._local_dlist, self._remotes[agent_name][0]

    def _layout(self, remote: RemoteKV) -> tuple[int, int] | None:
        """(base, device) of the peer's blocks when they are one piece each, as long as ours
        (runs of them can then be merged into one descriptor), else None."""
        if remote.segments != 1 or len(self._segments) != 1:
            return None
        return (remote.base, remote.device) if remote.block_len == self._block_len else None

    def raw_bases(self, agent_name: str) -> tuple[int, int, int, int, str, str]:
        """(local base, remote base, local device, remote device, local memory type,
        remote memory type) of the KV blocks, for raw benchmarks that merge descriptors."""
        with self._lock:
            remote = self._remotes[agent_name][1]
            layout = self._layout(remote)
        if layout is None:
            raise TransportError(f"the blocks of {agent_name} do not lie back to back")

        def name(mem: Any) -> str:
            return str(mem).rsplit(".", 1)[-1].removesuffix("_SEG")

        return (
            self._base,
            layout[0],
            self._device,
            layout[1],
            name(self._mem_enum),
            name(remote.mem_enum),
        )

    def remote_names(self) -> list[str]:
        with self._lock:
            return sorted(self._remotes)

    def remote_known(self, agent_name: str) -> bool:
        """Whether NIXL still holds the metadata of a remote agent we added
        (`check_remote_metadata`); False means NIXL has dropped it."""
        with self._lock:
            try:
                return bool(self._agent.check_remote_metadata(agent_name))
            except Exception as exc:
                log.debug("check_remote_metadata(%s) raised %s", agent_name, exc)
                return False

    # --- notifications and transfers -----------------------------------------------------

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        with self._lock:
            pair = self._pairs.get(agent_name)
            if agent_name not in self._remotes or pair is None:
                raise TransportError(f"agent {agent_name} is not (or no longer) added", "not_found")
            try:
                self._agent.send_notif(agent_name, pair.seal(payload))
            except Exception as exc:
                raise TransportError(f"send_notif to {agent_name}: {exc}", _classify(exc)) from exc

    def get_notifs(self, room: Room | None = None) -> list[tuple[str, bytes]]:
        with self._lock:
            notifs = self._agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for agent, received in notifs.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            with self._lock:
                pair = self._pairs.get(name) or self._former_pairs.get(name)
            msgs = received
            if room is not None and pair is not None:
                taken = room(name, len(received))
                if taken < len(received):
                    msgs = received[: max(0, taken)]
            for m in msgs:
                payload = pair.open(bytes(m)) if pair is not None else None
                if payload is None:
                    self.unauthenticated += 1
                    if self._on_unauthenticated is not None:
                        self._on_unauthenticated(name, pair is not None)
                    continue
                out.append((name, payload))
        return out

    def write_blocks(
        self,
        agent_name: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> tuple[XferHandle, XferState]:
        """Starts a WRITE of local blocks into the peer's blocks; returns the handle and the
        state the post left it in ("DONE" when the copy finished inside the post, as it
        often does over shared memory, else "PROC"). The caller releases the handle."""
        if len(local_block_ids) != len(remote_block_ids):
            raise ValueError("local and remote block lists differ in length")
        with self._lock:
            entry = self._remotes.get(agent_name)
            if entry is None:
                raise TransportError(f"agent {agent_name} is not (or no longer) added", "not_found")
            remote_dlist, remote = entry
            notif = self._pairs[agent_name].seal(notif)
            if not local_block_ids:
                raise TransportError("a WRITE needs at least one block", "invalid")
            if min(remote_block_ids) < 0 or max(remote_block_ids) >= remote.num_blocks:
                raise TransportError(
                    f"block id outside peer's {remote.num_blocks} blocks", "invalid"
                )
            if min(local_block_ids) < 0 or max(local_block_ids) >= self._num_blocks:
                raise TransportError(f"block id outside our {self._num_blocks} blocks", "invalid")
            layout = self._layout(remote) if self.merge_blocks else None
            runs = block_runs(local_block_ids, remote_block_ids) if layout is not None else None
            handle: XferHandle = None
            try:
                if layout is not None and runs is not None and len(runs) < len(local_block_ids):
                    far_base, far_device = layout
                    bl = self._block_len
                    local = self._dlist_type(
                        self._mem_enum,
                        [(self._base + ls * bl, n * bl, self._device) for ls, _, n in runs],
                    )
                    far = self._dlist_type(
                        remote.mem_enum,
                        [(far_base + rs * bl, n * bl, far_device) for _, rs, n in runs],
                    )
                    handle = self._agent.initialize_xfer("WRITE", local, far, agent_name, notif)
                else:
                    n = remote.segments
                    local_idx, remote_idx = list(local_block_ids), list(remote_block_ids)
                    if n > 1:  # the same segment count on both sides (add_remote_peer)
                        local_idx = [b * n + j for b in local_idx for j in range(n)]
                        remote_idx = [b * n + j for b in remote_idx for j in range(n)]
                    handle = self._agent.make_prepped_xfer(
                        "WRITE", self._local_dlist, local_idx, remote_dlist, remote_idx, notif
                    )
                state = self._agent.transfer(handle)
            except Exception as exc:
                if handle is not None:
                    self._agent.release_xfer_handle(handle)
                raise TransportError(f"WRITE to {agent_name}: {exc}", _classify(exc)) from exc
            if state == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransportError(f"WRITE to {agent_name} failed to post")
            return handle, ("DONE" if state == "DONE" else "PROC")

    def poll(self, handle: XferHandle) -> XferState:
        """The WRITE's state; raises TransportError('disconnected') when NIXL says the
        remote agent disconnected (any other error: "ERR")."""
        with self._lock:
            try:
                state: XferState = self._agent.check_xfer_state(handle)
            except Exception as exc:
                log.debug("check_xfer_state raised %s", exc)
                if _classify(exc) == "disconnected":
                    raise TransportError(f"WRITE failed: {exc}", "disconnected") from exc
                return "ERR"
            return state

    def release(self, handle: XferHandle) -> bool:
        """Releases a transfer handle; for a WRITE still running, NIXL aborts it. False when
        NIXL refused (the WRITE may still land; the caller keeps watching it)."""
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
                return True
            except Exception as exc:
                log.warning("release_xfer_handle(%s) failed: %s", handle, exc)
                return False

    def close(self) -> None:
        """Releases everything in reverse order of creation."""
        if self._closed:
            return
        self._closed = True
        for name in self.remote_names():
            try:
                self.remove_remote(name)
            except Exception as exc:
                log.warning("removing %s at close: %s", name, exc)
        with self._lock:
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
                self._local_dlist = None
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
                self._reg_descs = None
