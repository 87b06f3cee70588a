"""The emulated engine's KV memory and content: what a decode verifies every pushed byte
against, in host memory without torch."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from kvtopo_worker.emulated import HostKV, KVContent, rank_kv

BLOCK = 4096


def reference_word(request_id: str, k: int, w: int) -> int:
    """Word w of block k of a request, by Python integers wrapped to int64 by hand."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little", signed=True)
    value = (w * 0x9E3779B97F4A7C15 + seed + k * 0x6A09E667F3BCC909) % (1 << 64)
    return value - (1 << 64) if value >= 1 << 63 else value


def test_filled_blocks_hold_the_formula_and_verify() -> None:
    kv, content = HostKV(16, BLOCK), KVContent(BLOCK)
    blocks = [3, 4, 5, 9, 1]  # a run, then blocks out of order
    content.fill(kv, blocks, "req-a")
    words = kv.array.view("<i8")
    for k, block in enumerate(blocks):
        for w in (0, 1, BLOCK // 8 - 1):
            assert int(words[block, w]) == reference_word("req-a", k, w)
    assert content.mismatched_blocks(kv, blocks, "req-a") == []
    # Another request's content, or the same blocks in another order, is not this one's.
    assert content.mismatched_blocks(kv, blocks, "req-b") == [0, 1, 2, 3, 4]
    assert content.mismatched_blocks(kv, [4, 3, 5, 9, 1], "req-a") == [0, 1]


def test_one_wrong_byte_names_its_block() -> None:
    kv, content = HostKV(8, BLOCK), KVContent(BLOCK)
    blocks = [0, 1, 2, 3]
    content.fill(kv, blocks, "req")
    kv.array[2, BLOCK - 1] ^= 1
    assert content.mismatched_blocks(kv, blocks, "req") == [2]


def test_zeroed_blocks_count_as_unwritten() -> None:
    kv, content = HostKV(8, BLOCK), KVContent(BLOCK)
    content.fill(kv, [1, 2, 6], "req")
    assert kv.written([0, 1, 2, 6, 7]) == 3
    kv.zero([1, 6])
    assert kv.written([0, 1, 2, 6, 7]) == 1
    kv.array[7, 100] = 1  # one byte is enough
    assert kv.written([7]) == 1


def test_a_cache_needs_whole_words_and_a_known_device() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        rank_kv(4, 12)
    with pytest.raises(ValueError, match="cpu or cuda"):
        rank_kv(4, 64, "tpu")
    assert isinstance(rank_kv(4, 64), HostKV)


def test_the_emulated_engine_does_not_import_torch() -> None:
    # torch's import took 4 s and 600 MB of every emulated engine's process (issue 32: the
    # drills wait on engine starts).
    code = "import sys, kvtopo_worker.emulated; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
