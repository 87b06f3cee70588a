"""vLLM's real v1 `Scheduler`, built offline and driven without a model runner.

Owns what the vLLM-scheduler engine (`kvtopo_worker.vllm.engine`) and the connector's tests
share: a tiny local Llama-shaped model directory (`config.json` only: no weights, no
tokenizer, no network; `HF_HUB_OFFLINE=1` is set on import), a `VllmConfig` built from it
with a KV transfer config, a `KVCacheConfig` with one full-attention group planned by vLLM's
own planner (so tensors and strides are what an engine hands its workers), the `Scheduler`
(which builds its KV connector itself from the config, role SCHEDULER), requests, per-layer
KV tensors allocated as vLLM 0.33's model runner does, and the model-runner output of a
step (`runner_output`), which carries the connector's `KVConnectorOutput`.

A step of the engine loop is::

    out = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(
        out, runner_output(out, kv_connector_output, scheduler=scheduler)
    )

Written against vLLM 0.33.0; nothing here starts workers, processes, sockets or NIXL agents.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from pathlib import Path
from typing import Any, Literal

# Offline by construction: the model "directory" has a config.json only, and
# nothing must try the Hub (tokenizer, generation config, processor lookups).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "DEFAULT_TOKEN",
    "MODEL_CONFIG",
    "KVCacheShapeLayout",
    "free_block_count",
    "kv_cache_shape",
    "layer_names",
    "make_kv_cache_config",
    "make_kv_cache_spec",
    "make_kv_caches",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "runner_output",
    "write_model_dir",
]

# A Llama-shaped toy: head_size = 128 / 4 = 32, which is also a head size vLLM's
# CPU attention backend supports ([32, 64, 80, ...]), so the same model dir
# stays usable if a test ever builds CPU attention metadata. float32 keeps the
# CPU path free of half-precision warnings.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# Token the fake model runner "samples" by default: not BOS/EOS, inside the vocab.
DEFAULT_TOKEN = 7

# "flash": (2, num_blocks, block_size, num_kv_heads, head_size), the legacy
#   FlashAttention-style split-K/V layout (index 0 = K, 1 = V).
# "vllm": what vLLM 0.33's worker really hands connectors' register_kv_caches():
#   the logical per-layer view [B, H, N, C] of one shared int8 allocation, with K
#   and V packed in the content dim, i.e. (num_blocks, num_kv_heads, block_size,
#   2 * head_size) in the model dtype. vLLM's CPU backend (CPUAttentionBackend)
#   reads exactly that: kv_cache = [num_blocks, num_kv_heads, block_size,
#   2 * head_size] and it supports only the head-major KVCacheLayout.LBHNC.
KVCacheShapeLayout = Literal["flash", "vllm"]


def write_model_dir(path: str | os.PathLike[str]) -> str:
    """Write a tiny Llama-style ``config.json`` into *path* and return the path.

    ``ModelConfig(model=path, skip_tokenizer_init=True)`` accepts it offline: no
    weights and no tokenizer files are needed because nothing loads them.
    """
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2))
    return str(model_dir)


def shared_model_dir() -> str:
    """The tiny model's directory at one path per machine and model config (engines of one
    deployment must name the same model path: vLLM's own connector hashes it)."""
    import contextlib
    import hashlib
    import tempfile

    digest = hashlib.sha256(json.dumps(MODEL_CONFIG, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"kvtopo-tiny-llama-{digest}"
    if not (path / "config.json").exists():
        staging = Path(tempfile.mkdtemp(prefix="kvtopo-model-"))
        write_model_dir(staging)
        with contextlib.suppress(OSError):  # a racing engine's rename fails: its copy stays
            staging.rename(path)
    return str(path)


def make_vllm_config(
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    block_size: int = 16,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 512,
    tp_size: int = 1,
    *,
    max_model_len: int = 2048,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    kv_cache_layout: str = "LBHNC",
    dtype: str = "float32",
    async_scheduling: bool = False,
) -> VllmConfig:
    """Build a ``VllmConfig`` for *model_dir* entirely offline.

    *kv_transfer_config* is passed as ``KVTransferConfig(**kv_transfer_config)``
    (``None`` builds a scheduler without a connector). Give it an ``engine_id``
    when the test cares about it; vLLM otherwise fills in a random UUID.

    Notes on what vLLM needs here:

    * ``async_scheduling``: vLLM 0.33 defaults it on, which makes
      ``max_concurrent_batches`` 2 (the engine schedules step N+1 before it hands the
      scheduler step N's output) and defers block frees and async KV loads by a step;
      ``make_scheduler`` then builds vLLM's ``AsyncScheduler``, and the caller must drive
      it as the engine core's batch queue does (``kvtopo_worker.vllm.engine`` does). Off
      (the default here) it is the synchronous ``Scheduler``, stepped one output at a time.
    * ``tp_size > 1`` needs nothing special: ``ParallelConfig`` only records the
      world size and picks the "mp" executor backend by name; no process is
      spawned unless an executor is built, and the scheduler never builds one.
      ``ModelConfig.get_num_kv_heads`` then gives the per-rank KV head count.
    * ``cache_config.kv_cache_layout`` is normally resolved by the engine core
      (``resolve_kv_cache_layout``) from the workers' attention backends and the
      connector's preference. There are no workers here, so it is set directly;
      ``LBHNC`` is what NIXL asks for and the only layout the CPU backend reads.
    * ``num_gpu_blocks_override`` pins the KV planner to *num_blocks*.
    """
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        seed=0,
        max_model_len=max_model_len,
        generation_config="vllm",  # do not look for generation_config.json
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
    )
    cache_config.kv_cache_layout = kv_cache_layout
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=(
            KVTransferConfig(**kv_transfer_config) if kv_transfer_config is not None else None
        ),
    )


def layer_names(vllm_config: VllmConfig) -> list[str]:
    """Attention layer names as vLLM's Llama registers them (one per layer)."""
    num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_kv_cache_spec(vllm_config: VllmConfig) -> FullAttentionSpec:
    """The per-rank full-attention spec every layer of the toy model shares."""
    model_config = vllm_config.model_config
    return FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """A ``KVCacheConfig`` of *num_blocks* blocks: one full-attention group over
    every layer, tensors planned by vLLM (one shared backing allocation, one
    ``KVCacheTensor`` with per-layer/per-block strides for the resolved layout).

    Also resolves ``hash_block_size`` / ``cache_hit_alignment_tokens`` the way
    ``EngineCore`` does, and records ``vllm_config.cache_config.num_gpu_blocks``.
    """
    names = layer_names(vllm_config)
    spec = make_kv_cache_spec(vllm_config)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config,
        [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
        available_memory=spec.page_size_bytes * len(names) * num_blocks,
    )
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config.num_blocks
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return kv_cache_config


def make_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int,
    kv_cache_config: KVCacheConfig | None = None,
) -> Scheduler:
    """Construct the real v1 ``Scheduler`` (``AsyncScheduler`` where the config schedules
    asynchronously) over *num_blocks* KV blocks.

    The scheduler creates its own KV connector (role SCHEDULER) from
    ``vllm_config.kv_transfer_config``; reach it as ``scheduler.connector`` and
    the cache config as ``scheduler.kv_cache_config``. Note the block pool keeps
    one block as vLLM's null block, so at most ``num_blocks - 1`` are ever free.
    """
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    cls = Scheduler
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = AsyncScheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )


def kv_cache_shape(
    vllm_config: VllmConfig, num_blocks: int, layout: KVCacheShapeLayout = "flash"
) -> tuple[int, ...]:
    """Per-layer KV cache tensor shape for *num_blocks* blocks (see
    :data:`KVCacheShapeLayout` for the two layouts)."""
    spec = make_kv_cache_spec(vllm_config)
    if layout == "flash":
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    if layout == "vllm":
        return (
            num_blocks,
            spec.num_kv_heads,
            spec.block_size,
            spec.head_size + spec.head_size_v,
        )
    raise ValueError(f"unknown KV cache layout {layout!r}")


def make_kv_caches(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    num_blocks: int,
    layout: KVCacheShapeLayout = "flash",
) -> dict[str, torch.Tensor]:
    """Zero-filled CPU KV cache tensors, one per layer of *kv_cache_config*.

    ``layout="flash"`` gives an independent ``(2, num_blocks, block_size,
    num_kv_heads, head_size)`` tensor per layer. ``layout="vllm"`` allocates the
    way vLLM 0.33's model runner does (``vllm.v1.worker.utils.allocate_kv_cache``:
    one int8 backing buffer, a strided ``[B, H, N, C]`` view per layer, resolved
    ``kv_cache_layout``), which is what a worker-side connector's
    ``register_kv_caches`` receives in a real engine.
    """
    if num_blocks != kv_cache_config.num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} but kv_cache_config has {kv_cache_config.num_blocks}"
        )
    names = [n for group in kv_cache_config.kv_cache_groups for n in group.layer_names]
    if layout == "flash":
        shape = kv_cache_shape(vllm_config, num_blocks, "flash")
        dtype = vllm_config.model_config.dtype
        return {name: torch.zeros(shape, dtype=dtype) for name in names}
    if layout == "vllm":
        # Imported lazily: the worker utils pull in more of vLLM than the
        # scheduler path needs.
        from vllm.v1.worker.utils import allocate_kv_cache

        resolved = KVCacheLayout[
            kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or "LBHNC"
        ]
        caches: dict[str, torch.Tensor] = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), resolved
        )
        return caches
    raise ValueError(f"unknown KV cache layout {layout!r}")


# NONE_HASH is process-global in vLLM; (re)seed it only when the algorithm changes.
_none_hash_state: dict[str, str] = {}


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    *,
    block_size: int = 16,
    prompt_token_ids: list[int] | None = None,
    hash_algo: str = "sha256",
    prompt_of: str | None = None,
) -> Request:
    """A ``Request`` with *prompt_len* prompt tokens and greedy, EOS-ignoring
    sampling capped at *max_tokens*.

    *kv_transfer_params* travels the way the engine passes it
    (``SamplingParams.extra_args["kv_transfer_params"]``) and is deep-copied:
    connectors mutate it (NIXL flips ``do_remote_prefill`` to False, push mode
    seeds ``remote_block_ids``), and the caller's dict stays untouched.

    Prompt tokens default to a run derived from *request_id* (or *prompt_of*:
    the request whose prompt this one repeats), so different ids do not share a
    prefix-cache prefix. The block hasher mirrors ``EngineCore``
    (*block_size* must be the scheduler's hash block size: the cache block size
    for this harness's single group).
    """
    hash_fn = get_hash_fn_by_name(hash_algo)
    if _none_hash_state.get("algo") != hash_algo:
        init_none_hash(hash_fn)
        _none_hash_state["algo"] = hash_algo

    if prompt_token_ids is None:
        vocab = MODEL_CONFIG["vocab_size"]
        base = zlib.crc32((prompt_of or request_id).encode())
        # Skip the low ids (BOS/EOS and friends).
        prompt_token_ids = [10 + (base + i) % (vocab - 10) for i in range(prompt_len)]
    elif len(prompt_token_ids) != prompt_len:
        raise ValueError("prompt_token_ids does not have prompt_len tokens")

    extra_args = (
        {"kv_transfer_params": copy.deepcopy(kv_transfer_params)}
        if kv_transfer_params is not None
        else None
    )
    sampling_params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args=extra_args,
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
    )


def runner_output(
    scheduler_output: SchedulerOutput,
    kv_connector_output: KVConnectorOutput | None = None,
    token: int = DEFAULT_TOKEN,
    *,
    scheduler: Scheduler | None = None,
) -> ModelRunnerOutput:
    """A fake ``ModelRunnerOutput`` for one executed step.

    Every request scheduled in *scheduler_output* gets an entry; it samples
    ``[token]`` when the step completes its prefill (or is a decode step) and
    ``[]`` for a non-final prefill chunk, as the GPU model runner does.
    *kv_connector_output* is attached unchanged, so its finished_sending /
    finished_recving / failed_recving / invalid_block_ids reach
    ``scheduler.update_from_output``. With nothing scheduled this is the
    "KV connector output only" step the engine runs while transfers are pending.

    Pass *scheduler* whenever chunked prefill may span steps: with it, the
    decision reads ``Request.is_prefill_chunk`` (set by ``schedule()``). Without
    it, new requests are judged from their prompt length; a cached request with
    no output tokens yet is ambiguous and raises.
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    new_reqs = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    cached_output_tokens = dict(zip(cached.req_ids, cached.num_output_tokens, strict=True))

    def samples(req_id: str) -> bool:
        if scheduler is not None:
            request = scheduler.requests.get(req_id)
            return request is not None and not request.is_prefill_chunk
        num_scheduled = scheduler_output.num_scheduled_tokens[req_id]
        if req_id in new_reqs:
            new = new_reqs[req_id]
            assert new.prompt_token_ids is not None
            return bool(new.num_computed_tokens + num_scheduled >= len(new.prompt_token_ids))
        if cached_output_tokens.get(req_id, 0) > 0 and req_id not in cached.resumed_req_ids:
            return True
        raise ValueError(
            f"cannot tell whether {req_id} finishes its prefill this step; pass scheduler=..."
        )

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token] if samples(r) else [] for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_connector_output,
    )


def free_block_count(scheduler: Scheduler) -> int:
    """Blocks currently free in the scheduler's block pool (null block excluded)."""
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def nixl_push_workers(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    scheduler: Scheduler,
    num_blocks: int,
) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
    """vLLM's own push connector (`NixlPushConnector`), worker side, one per TP rank in this
    process, with KV caches as the model runner allocates them, and the handshake metadata
    wired to the scheduler's connector as vLLM's engine core wires it. For side-by-side
    benchmarks on a machine without a GPU; the process must have been started with
    VLLM_TARGET_DEVICE=cpu and its own VLLM_NIXL_SIDE_CHANNEL_PORT. What it takes on such a
    machine (vLLM 0.33):

    - the CUDA-only `b12x` package, which the CPU attention backend's import reaches and
      which fails there with an AttributeError vLLM does not expect, is hidden;
    - the TP rank and size, which its worker reads from vLLM's distributed state, are given;
    - the CPU affinity its worker sets for the calling thread is restored.
    """
    import sys

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPushConnector, base_worker
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        raise RuntimeError("NixlPushConnector needs VLLM_TARGET_DEVICE=cpu on this machine")
    sys.modules.setdefault("b12x", None)  # type: ignore[arg-type]
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    affinity = os.sched_getaffinity(0)
    workers: list[Any] = []
    kvs: list[dict[str, torch.Tensor]] = []
    for rank in range(tp):
        base_worker.get_tensor_model_parallel_rank = lambda r=rank: r
        base_worker.get_tensor_model_parallel_world_size = lambda: tp
        worker = NixlPushConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        os.sched_setaffinity(0, affinity)
        kv = make_kv_caches(vllm_config, kv_cache_config, num_blocks, "vllm")
        worker.register_kv_caches(kv)
        workers.append(worker)
        kvs.append(kv)
    scheduler.connector.set_xfer_handshake_metadata_pp_aware(
        {(0, rank): w.get_handshake_metadata() for rank, w in enumerate(workers)}
    )
    return workers, kvs
