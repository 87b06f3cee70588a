"""The NIXL transport's block merging: which ids run together, and real WRITEs over UCX
(two agents in this process, DRAM to DRAM) that land every byte where it belongs, merged
or not."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from kvtopo_worker.protocol import CompatInfo, KVSegment
from kvtopo_worker.transport import NixlTransport, TransportError, block_runs


def test_block_runs_find_the_stretches_that_count_up_together() -> None:
    assert block_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]
    assert block_runs([4, 5, 9, 10, 11], [0, 1, 2, 3, 4]) == [(4, 0, 2), (9, 2, 3)]
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    # Same first/last span, not in order: not one run.
    assert block_runs([0, 2, 1, 3], [0, 2, 1, 3]) == [(0, 0, 1), (2, 2, 1), (1, 1, 1), (3, 3, 1)]
    assert block_runs([], []) == []
    assert block_runs([3], [8]) == [(3, 8, 1)]


def _wait(
    sender: NixlTransport, receiver: NixlTransport, posted: tuple[object, str]
) -> list[tuple[str, bytes]]:
    """Drives the WRITE to its end; the notifications the receiver got meanwhile."""
    handle, state = posted
    notes: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 10
    while state == "PROC":
        state = sender.poll(handle)
        notes += receiver.get_notifs()
        assert time.monotonic() < deadline, "WRITE did not finish within 10 s"
    assert state == "DONE"
    sender.release(handle)
    return notes


@pytest.mark.parametrize("merge", [True, False])
def test_writes_land_every_byte_merged_or_not(merge: bool) -> None:
    torch = pytest.importorskip("torch")
    blocks, block_len = 16, 256
    src = NixlTransport("kvtopo-test-src", progress_thread=False, merge_blocks=merge)
    dst = NixlTransport("kvtopo-test-dst", progress_thread=False)
    try:
        kv_src = torch.arange(blocks * block_len, dtype=torch.int64).remainder(251)
        kv_src = kv_src.to(torch.uint8).reshape(blocks, block_len)
        kv_dst = torch.zeros((blocks, block_len), dtype=torch.uint8)
        src.register_kv_cache(kv_src)
        dst.register_kv_cache(kv_dst)
        compat = CompatInfo(block_len=block_len)
        dst_meta = dst.describe(engine_id="dst", role="decode", compat=compat)
        name = src.add_remote_peer(dst_meta)
        assert src.add_remote_peer(dst_meta) == name  # idempotent
        dst.add_remote_peer(src.describe(engine_id="src", role="prefill", compat=compat))
        # A run of four, a lone block, and a run of two that is misaligned on the far side.
        local = [0, 1, 2, 3, 7, 10, 11]
        remote = [4, 5, 6, 7, 0, 13, 14]
        notes = _wait(src, dst, src.write_blocks(name, local, remote, b"done"))
        for lid, rid in zip(local, remote, strict=True):
            assert torch.equal(kv_dst[rid], kv_src[lid]), (lid, rid)
        untouched = sorted(set(range(blocks)) - set(remote))
        assert int(kv_dst[untouched].sum()) == 0
        deadline = time.monotonic() + 10
        while not notes and time.monotonic() < deadline:
            notes = dst.get_notifs()
        assert [n for _, n in notes] == [b"done"]
    finally:
        src.close()
        dst.close()


def test_a_peer_region_outside_its_registered_memory_or_another_agents_blob_is_refused() -> None:
    torch = pytest.importorskip("torch")
    blocks, block_len = 8, 256
    local = NixlTransport("kvtopo-test-local", progress_thread=False)
    peer = NixlTransport("kvtopo-test-peer", progress_thread=False)
    try:
        local.register_kv_cache(torch.zeros((blocks, block_len), dtype=torch.uint8))
        peer.register_kv_cache(torch.zeros((blocks, block_len), dtype=torch.uint8))
        compat = CompatInfo(block_len=block_len)
        true_meta = peer.describe(engine_id="peer", role="decode", compat=compat)
        # Claims: more blocks than registered, a region moved past the registration, and
        # the right blob under another agent's name.
        lies = [
            (msgspec.structs.replace(true_meta, num_blocks=blocks + 1), "not_found"),
            (msgspec.structs.replace(true_meta, kv_addr=true_meta.kv_addr + 4096), "not_found"),
            (msgspec.structs.replace(true_meta, agent_name="kvtopo-someone"), "identity"),
        ]
        for meta, kind in lies:
            with pytest.raises(TransportError) as err:
                local.add_remote_peer(meta)
            assert err.value.kind == kind, err.value
            assert local.remote_names() == []
        # The truth is still accepted afterwards (nothing half-added stayed behind).
        assert local.add_remote_peer(true_meta) == "kvtopo-test-peer"
    finally:
        local.close()
        peer.close()


def _layer_segments(layers: list[Any]) -> list[KVSegment]:
    """vLLM's per-layer KV layout (2, num_blocks, ...): each layer's K and V halves are a
    segment whose block i lies at half + i * (bytes of one block of one half)."""
    segs: list[KVSegment] = []
    for t in layers:
        half = t.stride(0) * t.element_size()
        per_block = t.stride(1) * t.element_size()
        base = t.data_ptr()
        segs += [KVSegment(a, per_block, per_block) for a in (base, base + half)]
    return segs


def test_a_kv_cache_cut_into_per_layer_segments_is_written_block_by_block() -> None:
    """A block of a per-layer KV cache is its part of every layer's K and V: a WRITE of
    blocks moves exactly those parts, into the peer's blocks of the same numbers given."""
    torch = pytest.importorskip("torch")
    blocks, layers, shape = 12, 3, (16, 2, 8)  # block_size, kv heads, head size
    src = NixlTransport("kvtopo-test-seg-src", progress_thread=False)
    dst = NixlTransport("kvtopo-test-seg-dst", progress_thread=False)
    try:
        gen = torch.Generator().manual_seed(7)
        kv_src = [torch.randn((2, blocks, *shape), generator=gen) for _ in range(layers)]
        kv_dst = [torch.zeros((2, blocks, *shape)) for _ in range(layers)]
        src.register_kv_segments(kv_src, _layer_segments(kv_src), blocks)
        dst.register_kv_segments(kv_dst, _layer_segments(kv_dst), blocks)
        per_block = 2 * layers * 16 * 2 * 8 * 4
        assert src.block_len == dst.block_len == per_block
        compat = CompatInfo(block_len=per_block, kv_layout="test:layers")
        dst_meta = dst.describe(engine_id="dst", role="decode", compat=compat)
        assert len(dst_meta.kv_segments) == 2 * layers
        # The metadata crosses the wire and is checked like any peer's.
        from kvtopo_worker.protocol import decode_metadata, encode_metadata

        wire = decode_metadata(encode_metadata(dst_meta), dst_meta.compat_hash)
        name = src.add_remote_peer(wire)
        local, remote = [0, 1, 5, 11], [3, 4, 0, 9]
        _wait(src, dst, src.write_blocks(name, local, remote, b"segments"))
        for layer in range(layers):
            for lid, rid in zip(local, remote, strict=True):
                assert torch.equal(kv_dst[layer][:, rid], kv_src[layer][:, lid]), (layer, lid)
            untouched = sorted(set(range(blocks)) - set(remote))
            assert float(kv_dst[layer][:, untouched].abs().sum()) == 0.0
        # A one-piece peer cannot take these blocks: refused before any WRITE.
        plain = NixlTransport("kvtopo-test-seg-plain", progress_thread=False)
        try:
            plain.register_kv_cache(torch.zeros((blocks, per_block), dtype=torch.uint8))
            with pytest.raises(TransportError, match="segments"):
                src.add_remote_peer(plain.describe(engine_id="p", role="decode", compat=compat))
        finally:
            plain.close()
    finally:
        src.close()
        dst.close()


def test_segments_that_do_not_add_up_or_leave_the_address_space_are_refused() -> None:
    from kvtopo_worker.protocol import MalformedMessage, decode_metadata, encode_metadata

    torch = pytest.importorskip("torch")
    t = NixlTransport("kvtopo-test-seg-bad", progress_thread=False)
    try:
        kv = [torch.zeros((2, 4, 64), dtype=torch.uint8)]
        t.register_kv_segments(kv, _layer_segments(kv), 4)
        meta = t.describe(engine_id="e", role="decode", compat=CompatInfo(block_len=128))
        segs = meta.kv_segments
        for bad in (
            [segs[0]],  # adds up to 64 bytes, block_len says 128
            [segs[0], KVSegment(segs[1].addr, 8, 64)],  # longer than its stride
            [segs[0], KVSegment((1 << 64) - 100, 64, 64)],  # past 64 bits
            [KVSegment(segs[0].addr + 1, 64, 64), segs[1]],  # kv_addr is not the first
        ):
            forged = msgspec.structs.replace(meta, kv_segments=bad)
            with pytest.raises(MalformedMessage):
                decode_metadata(encode_metadata(forged), forged.compat_hash)
        with pytest.raises(ValueError, match="leaves"):
            t2 = NixlTransport("kvtopo-test-seg-bad2", progress_thread=False)
            try:
                t2.register_kv_segments(kv, _layer_segments(kv), 5)
            finally:
                t2.close()
    finally:
        t.close()
