"""The NIXL transport's block merging: which ids run together, and real WRITEs over UCX
(two agents in this process, DRAM to DRAM) that land every byte where it belongs, merged
or not."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvtopo_worker.protocol import CompatInfo
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
