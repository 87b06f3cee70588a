"""The harness drives vLLM's real scheduler with vLLM's own ``NixlPushConnector``
(scheduler side only) through a P/D handoff: a prefill (kv_producer) scheduler
holds a finished request's blocks until the worker reports ``finished_sending``,
and a decode (kv_consumer) scheduler parks a request in
``WAITING_FOR_REMOTE_KVS`` until ``finished_recving`` (or fails it on
``failed_recving``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvtopo_worker.vllm import offline as harness

NUM_BLOCKS = 64
BLOCK_SIZE = 16
PROMPT_LEN = 40  # 3 blocks: 16 + 16 + 8

PRODUCER = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "engine_id": "p-0"}
CONSUMER = {"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer", "engine_id": "d-0"}


def remote_prefill_params(remote_block_ids: list[list[int]]) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p-0",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_block_ids": remote_block_ids,
        "remote_request_id": "p1",
        "tp_size": 1,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return harness.write_model_dir(tmp_path_factory.mktemp("vllm") / "tiny-llama")


class Spy:
    """Records the scheduler's calls into its connector (and what they return)."""

    def __init__(self, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], Any]] = []
        connector = scheduler.connector
        assert connector is not None
        for name in (
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "request_finished",
            "request_finished_all_groups",
        ):
            monkeypatch.setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            result = method(*args)
            self.calls.append((name, args, result))
            return result

        return wrapper

    def named(self, name: str) -> list[tuple[tuple[Any, ...], Any]]:
        return [(args, result) for call, args, result in self.calls if call == name]


def step(
    scheduler: Scheduler, kv_connector_output: KVConnectorOutput | None = None
) -> tuple[dict[str, int], Any, list[EngineCoreOutput]]:
    """One engine step: schedule, fake-execute, update. Returns what was
    scheduled, the step's connector metadata, and the request outputs."""
    out = scheduler.schedule()
    engine_outputs = scheduler.update_from_output(
        out, harness.runner_output(out, kv_connector_output, scheduler=scheduler)
    )
    outputs = [o for eco in engine_outputs.values() for o in eco.outputs]
    return dict(out.num_scheduled_tokens), out.kv_connector_metadata, outputs


def assert_drained(scheduler: Scheduler) -> None:
    assert not scheduler.requests
    assert not scheduler.running
    assert len(scheduler.waiting) == 0
    assert harness.free_block_count(scheduler) == NUM_BLOCKS - 1  # one null block


def test_prefill_producer_holds_blocks_until_finished_sending(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = harness.make_vllm_config(model_dir, PRODUCER, BLOCK_SIZE, NUM_BLOCKS)
    scheduler = harness.make_scheduler(config, NUM_BLOCKS)
    assert type(scheduler.connector).__name__ == "NixlPushConnector"
    spy = Spy(scheduler, monkeypatch)
    free_at_start = harness.free_block_count(scheduler)
    assert free_at_start == NUM_BLOCKS - 1

    request = harness.make_request("p1", PROMPT_LEN, 1, {"do_remote_decode": True})
    scheduler.add_request(request)

    # Step 1: the whole prompt runs; max_tokens=1 finishes the request at once.
    scheduled, meta, outputs = step(scheduler)
    assert scheduled == {"p1": PROMPT_LEN}
    # update_state_after_alloc ran inside schedule(), while still WAITING, with
    # the freshly allocated blocks and no external tokens.
    [(args, _)] = spy.named("update_state_after_alloc")
    assert args[0] is request and args[2] == 0
    assert [len(g) for g in args[1].get_block_ids()] == [3]
    assert meta.reqs_in_batch == {"p1"}

    [output] = outputs
    assert output.new_token_ids == [harness.DEFAULT_TOKEN]
    assert output.finish_reason == FinishReason.LENGTH
    params = output.kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p-0"
    assert params["remote_request_id"] == "p1"
    assert params["remote_num_tokens"] == PROMPT_LEN
    assert params["transfer_mode"] == "push"
    assert params["tp_size"] == 1
    # One list of block ids per KV cache group.
    (remote_blocks,) = params["remote_block_ids"]
    assert len(remote_blocks) == 3

    # The HMA path: request_finished_all_groups(request, tuple-of-lists-per-group)
    # returned delay_free=True, so the blocks stay allocated.
    assert not spy.named("request_finished")
    [(args, (delay_free, _))] = spy.named("request_finished_all_groups")
    assert args[1] == (remote_blocks,)
    assert delay_free is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "p1" in scheduler.requests
    assert harness.free_block_count(scheduler) == free_at_start - 3

    # Step 2: nothing to run; the metadata now tells P's workers what to push.
    scheduled, meta, outputs = step(scheduler)
    assert scheduled == {} and outputs == []
    assert set(meta.reqs_to_send) == {"p1"}
    assert meta.push_finished_blocks == {"p1": (remote_blocks,)}
    assert harness.free_block_count(scheduler) == free_at_start - 3

    # Step 3: the worker reports the WRITE done; the blocks go back to the pool.
    step(scheduler, KVConnectorOutput(finished_sending={"p1"}))
    assert_drained(scheduler)
    assert scheduler.connector is not None
    assert not scheduler.connector.has_pending_push_work()


def test_decode_consumer_waits_for_remote_kvs(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = harness.make_vllm_config(model_dir, CONSUMER, BLOCK_SIZE, NUM_BLOCKS)
    scheduler = harness.make_scheduler(config, NUM_BLOCKS)
    spy = Spy(scheduler, monkeypatch)

    params = remote_prefill_params([[1, 2, 3]])
    request = harness.make_request("d1", PROMPT_LEN, 3, params)
    scheduler.add_request(request)

    # Step 1: the connector claims the whole prompt asynchronously; blocks are
    # allocated, nothing runs, and the registration goes to D's workers.
    scheduled, meta, outputs = step(scheduler)
    assert scheduled == {} and outputs == []
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    [(_, matched)] = spy.named("get_num_new_matched_tokens")
    assert matched == (PROMPT_LEN, True)
    [(args, _)] = spy.named("update_state_after_alloc")
    assert args[2] == PROMPT_LEN
    (local_blocks,) = args[1].get_block_ids()
    assert len(local_blocks) == 3
    registration = meta.push_registrations["d1"]
    assert registration["local_block_ids"] == (local_blocks,)
    assert registration["remote_engine_id"] == "p-0"
    assert set(meta.reqs_to_recv) == {"d1"}
    assert harness.free_block_count(scheduler) == NUM_BLOCKS - 1 - 3
    # The connector mutated the request's copy of the params, not ours.
    assert params == remote_prefill_params([[1, 2, 3]])

    # It stays parked while nothing is reported.
    for _ in range(2):
        assert step(scheduler)[0] == {}
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    # The worker reports the KV landed (on an otherwise empty step) ...
    assert step(scheduler, KVConnectorOutput(finished_recving={"d1"}))[0] == {}
    # ... and the next schedule() runs it: only the last prompt token is
    # recomputed, to sample the first output token.
    scheduled, _, outputs = step(scheduler)
    assert scheduled == {"d1": 1}
    assert request.status == RequestStatus.RUNNING
    assert [o.new_token_ids for o in outputs] == [[harness.DEFAULT_TOKEN]]

    for _ in range(2):
        scheduled, _, outputs = step(scheduler)
        assert scheduled == {"d1": 1}
    [last] = outputs
    assert last.finish_reason == FinishReason.LENGTH
    assert last.kv_transfer_params is None
    assert list(request.output_token_ids) == [harness.DEFAULT_TOKEN] * 3
    [(_, finished)] = spy.named("request_finished_all_groups")
    assert finished == (False, None)
    assert_drained(scheduler)


def test_decode_failed_recving_fails_request(model_dir: str) -> None:
    # kv_load_failure_policy defaults to "fail".
    config = harness.make_vllm_config(model_dir, CONSUMER, BLOCK_SIZE, NUM_BLOCKS)
    scheduler = harness.make_scheduler(config, NUM_BLOCKS)
    request = harness.make_request("d1", PROMPT_LEN, 3, remote_prefill_params([[1, 2, 3]]))
    scheduler.add_request(request)
    step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    _, _, outputs = step(scheduler, KVConnectorOutput(failed_recving={"d1"}))
    [output] = outputs
    assert output.finish_reason == FinishReason.ERROR
    assert request.status == RequestStatus.FINISHED_ERROR
    # The failed load may still be writing: blocks stay held until the worker
    # also reports the request done receiving.
    assert harness.free_block_count(scheduler) == NUM_BLOCKS - 1 - 3
    step(scheduler, KVConnectorOutput(finished_recving={"d1"}))
    assert_drained(scheduler)


def test_chunked_prefill_samples_only_on_the_last_chunk(model_dir: str) -> None:
    config = harness.make_vllm_config(
        model_dir, None, BLOCK_SIZE, NUM_BLOCKS, max_num_batched_tokens=64
    )
    scheduler = harness.make_scheduler(config, NUM_BLOCKS)
    assert scheduler.connector is None
    scheduler.add_request(harness.make_request("c1", 100, 2))

    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"c1": 64}
    assert harness.runner_output(first).sampled_token_ids == [[]]
    scheduler.update_from_output(first, harness.runner_output(first, scheduler=scheduler))

    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"c1": 36}
    with pytest.raises(ValueError, match="scheduler="):
        harness.runner_output(second)  # a cached request mid-prefill is ambiguous
    model_output = harness.runner_output(second, scheduler=scheduler)
    assert model_output.sampled_token_ids == [[harness.DEFAULT_TOKEN]]
    scheduler.update_from_output(second, model_output)

    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"c1": 1}
    # A decode step is unambiguous without the scheduler.
    scheduler.update_from_output(third, harness.runner_output(third))
    assert_drained(scheduler)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensor_parallel_config_and_kv_caches(model_dir: str, tp_size: int) -> None:
    config = harness.make_vllm_config(model_dir, PRODUCER, BLOCK_SIZE, 32, tp_size=tp_size)
    scheduler = harness.make_scheduler(config, 32)
    kv_heads = 2 // tp_size  # the toy model has 2 KV heads in all
    head_size = harness.MODEL_CONFIG["head_dim"]
    names = harness.layer_names(config)
    assert names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert scheduler.kv_cache_config.kv_cache_groups[0].layer_names == names

    flash = harness.make_kv_caches(config, scheduler.kv_cache_config, 32)
    assert set(flash) == set(names)
    assert all(t.shape == (2, 32, BLOCK_SIZE, kv_heads, head_size) for t in flash.values())
    packed = harness.make_kv_caches(config, scheduler.kv_cache_config, 32, layout="vllm")
    assert all(t.shape == (32, kv_heads, BLOCK_SIZE, 2 * head_size) for t in packed.values())
    assert all(not t.any() for t in [*flash.values(), *packed.values()])

    request = harness.make_request("p1", PROMPT_LEN, 1, {"do_remote_decode": True})
    scheduler.add_request(request)
    [output] = step(scheduler)[2]
    assert output.kv_transfer_params is not None
    assert output.kv_transfer_params["tp_size"] == tp_size


def test_write_model_dir_is_offline_loadable(tmp_path: Path) -> None:
    model_dir = harness.write_model_dir(tmp_path / "m")
    config = harness.make_vllm_config(model_dir, None)
    assert config.model_config.get_head_size() == harness.MODEL_CONFIG["head_dim"]
    assert config.model_config.max_model_len == 2048
