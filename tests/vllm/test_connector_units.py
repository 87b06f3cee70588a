"""KVTopoConnector's pieces that need no second process: how a KV cache is cut into
segments, what the settings accept, and what is refused with a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from kvtopo_worker.vllm import offline
from kvtopo_worker.vllm.connector import KVTopoConnector, kv_segments


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return offline.write_model_dir(tmp_path_factory.mktemp("model"))


def test_vllm_layer_views_of_one_buffer_are_one_segment_each() -> None:
    buf = torch.zeros(2 * 8 * 4 * 16, dtype=torch.float32)
    # Two layers, each (num_blocks=8, 4, 16), laid one after the other in one buffer.
    layers = {f"l{i}": buf[i * 512 : (i + 1) * 512].view(8, 4, 16) for i in range(2)}
    tensors, segs = kv_segments(layers, 8)
    assert len(tensors) == 2 and len(segs) == 2
    assert [s.length for s in segs] == [4 * 16 * 4] * 2
    assert segs[1].addr - segs[0].addr == 512 * 4


def test_a_split_kv_layout_is_two_segments_per_layer_and_a_scattered_block_is_refused() -> None:
    kv = {"a": torch.zeros(2, 8, 16, 2, 8), "b": torch.zeros(2, 8, 16, 2, 8)}
    _, segs = kv_segments(kv, 8)
    assert len(segs) == 4
    assert segs[1].addr - segs[0].addr == 8 * 16 * 2 * 8 * 4  # V follows K
    strided = {"a": torch.zeros(8, 16, 4)[:, :, :2]}  # a block's part is not contiguous
    with pytest.raises(ValueError, match="not contiguous"):
        kv_segments(strided, 8)
    with pytest.raises(ValueError, match="needs"):
        kv_segments({"a": torch.zeros(5, 3)}, 8)


def test_kv_both_needs_no_other_key_and_tp_ranks_must_share_a_process(
    model_dir: str, tmp_path: Path
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    token = tmp_path / "token"
    token.write_text("t\n")
    kvt = {
        "kv_connector": "KVTopoConnector",
        "kv_connector_module_path": "kvtopo_worker.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"token_file": str(token)},
    }
    config = offline.make_vllm_config(model_dir, kvt, num_blocks=16)
    # vLLM's own P/D configurations: kv_both alone, each request's part from its params.
    assert KVTopoConnector(config, KVConnectorRole.SCHEDULER, None)._s.role == "both"
    kvt["kv_connector_extra_config"] = {"token_file": str(token), "role": "router"}
    config = offline.make_vllm_config(model_dir, kvt, num_blocks=16)
    with pytest.raises(ValueError, match="kv_producer, kv_consumer or kv_both"):
        KVTopoConnector(config, KVConnectorRole.SCHEDULER, None)
    kvt["kv_connector_extra_config"] = {"token_file": str(token), "role": "decode"}
    config = offline.make_vllm_config(model_dir, kvt, num_blocks=16, tp_size=2)
    assert KVTopoConnector(config, KVConnectorRole.SCHEDULER, None).engine_id
    with pytest.raises(ValueError, match="all its ranks in one process"):
        KVTopoConnector(config, KVConnectorRole.WORKER, None, tp_rank=1)


@pytest.mark.parametrize(
    ("extra", "lazy"),
    [
        ({}, False),  # the operator pairs the engines: no peer token, no lazy handshakes
        ({"peer_token_file": "PEER"}, True),  # a peer token turns them on
        ({"peer_token_file": "PEER", "lazy_handshake": False}, False),
        ({"lazy_handshake": True}, True),  # asked for (the engine then needs the token)
    ],
)
def test_lazy_handshakes_are_on_where_the_engine_has_the_peer_token(
    model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any],
    lazy: bool,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    for name in ("KVTOPO_PEER_TOKEN_FILE", "KVTOPO_OPERATOR_KEY_FILE", "KVTOPO_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    peer = tmp_path / "peer-token"
    peer.write_text("p\n")
    config_extra = {"operator_key_file": str(tmp_path / "operator.pub")}
    config_extra.update({k: str(peer) if v == "PEER" else v for k, v in extra.items()})
    kvt = {
        "kv_connector": "KVTopoConnector",
        "kv_connector_module_path": "kvtopo_worker.vllm",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": config_extra,
    }
    config = offline.make_vllm_config(model_dir, kvt, num_blocks=16)
    settings = KVTopoConnector(config, KVConnectorRole.SCHEDULER, None)._s
    assert settings.lazy_handshake is lazy
    assert settings.operator_key_file == str(tmp_path / "operator.pub")
    assert settings.peer_token_file == (str(peer) if "peer_token_file" in extra else "")


def test_the_client_request_id_is_read_from_the_ids_vllms_openai_server_makes() -> None:
    from kvtopo_worker.vllm.connector import client_request_id

    router = "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:8000_0123456789abcdef"
    assert client_request_id(f"cmpl-{router}-0-1a2b3c4d") == router
    assert client_request_id("cmpl-x-12-deadbeef") == "x"
    assert client_request_id("chatcmpl-my-id-0123abcd") == "my-id"
    # Not of vLLM's forms: no alias (found by its own id only).
    for rid in ("req0", "cmpl-x-0", "cmpl-x-0-XYZ12345", "chatcmpl--0123abcd", "x-1a2b3c4d"):
        assert client_request_id(rid) == "", rid
