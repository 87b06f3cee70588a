"""KVTopoConnector behind vLLM's own P/D router (`vllm-router` 0.1.17), on vLLM's real
scheduler and real NIXL (the two-process engines of `test_connector`).

The router does not hand the decode the prefill's `kv_transfer_params`: it builds them (seen
on the wire, and with real servers in `tests/realvllm`): it keeps `do_remote_prefill`,
`do_remote_decode`, `remote_engine_id`, `remote_host`, `remote_port` and `tp_size`, sets
`remote_request_id` to its own request id (the X-Request-ID it sent both engines) and drops
the rest (`remote_block_ids`, `kvtopo_incarnation`). vLLM's OpenAI server names the prefill's
request `cmpl-<X-Request-ID>-<prompt index>-<8 random hex>`: the prefill finds the request by
the router's id while exactly one of its requests carries it, and writes it only into a
registration of the same prompt.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from kvtopo.realvllm.servers import ROUTER_KEEPS
from tests.vllm.test_connector import (
    Engines,
    events,
    failed_once,
    prefill_params,
    verified,
)

pytest.importorskip("vllm")
pytestmark = pytest.mark.nixl


def router_params(params: dict[str, Any], router_id: str) -> dict[str, Any]:
    """The decode's `kv_transfer_params` as vllm-router 0.1.17 builds them from the
    prefill's answer."""
    return {**{k: params[k] for k in ROUTER_KEEPS}, "remote_request_id": router_id}


def router_id() -> str:
    """An id of the router's form (its prefill and decode addresses and a uuid)."""
    return "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_" + secrets.token_hex(16)


def vllm_id(client_id: str, index: int = 0) -> str:
    """The id vLLM's OpenAI server gives a completion request the client sent `client_id`
    as its X-Request-ID."""
    return f"cmpl-{client_id}-{index}-{secrets.token_hex(4)}"


def test_behind_vllms_router_the_decode_receives_the_prefills_kv(engines: Engines) -> None:
    """The pair connected by the operator (`tests/realvllm` runs the router itself in front
    of real servers that pair lazily)."""
    prefill, decode = engines.pair("router")
    decode.connect(prefill)
    prefill.connect(decode)
    lengths = [4, 89, 143]
    ids = [router_id() for _ in lengths]
    rids = [vllm_id(x) for x in ids]
    for rid, n in zip(rids, lengths, strict=True):
        prefill.add(rid, n, 1, {"do_remote_decode": True})
    for i, (x, rid, n) in enumerate(zip(ids, rids, lengths, strict=True)):
        params = router_params(prefill_params(prefill, rid), x)
        decode.add(f"d{i}", n, 3, params, prompt_of=rid, content_id=rid)
    got = decode.wait([f"d{i}" for i in range(len(lengths))])
    for i in range(len(lengths)):
        assert verified(got[f"d{i}"]) > 0, got[f"d{i}"]
        assert len(events(got[f"d{i}"], "finished_recving")) == 1, got[f"d{i}"]
        assert events(got[f"d{i}"], "finished")[0]["reason"] == "length", got[f"d{i}"]
    sent = prefill.wait(rids)
    for rid in rids:
        assert len(events(sent[rid], "finished_sending")) == 1, sent[rid]
    assert prefill.state()["free_blocks"] == prefill.free_blocks
    assert decode.state()["free_blocks"] == decode.free_blocks


def test_behind_the_router_an_id_two_requests_carry_or_another_prompt_gets_no_kv(
    engines: Engines,
) -> None:
    # The prefill holds the requests' KV long enough for a third engine to start (a busy
    # machine takes tens of seconds), the decode gives up a refused registration fast.
    prefill, decode = engines.pair(
        "router-hostile", prefill={"kv_lease": 600}, registration_timeout=5
    )
    decode.connect(prefill)
    prefill.connect(decode)
    # Two prompts of one completion request carry the same client id: it names neither.
    shared = router_id()
    twins = [vllm_id(shared, 0), vllm_id(shared, 1)]
    # A request of 48 tokens, and a decode registering another prompt of 48 under its id.
    other = router_id()
    rid = vllm_id(other)
    for r in [*twins, rid]:
        prefill.add(r, 48, 1, {"do_remote_decode": True})
    params = {r: prefill_params(prefill, r) for r in [*twins, rid]}

    decode.add("d-twin", 48, 3, router_params(params[twins[0]], shared), prompt_of=twins[0])
    decode.add("d-wrong", 48, 3, router_params(params[rid], other), prompt_of="someone-else")
    got = decode.wait(["d-twin", "d-wrong"])
    twin = failed_once(got["d-twin"])
    assert "several requests" in twin["message"], twin
    wrong = failed_once(got["d-wrong"])
    assert "prompt" in wrong["message"], wrong

    # The same decode named by the same id again (a client or router reusing it): that
    # request fails once, and the engine serves on.
    decode.add("d-again", 48, 3, router_params(params[rid], other), prompt_of=rid)
    again = failed_once(decode.wait(["d-again"])["d-again"])
    assert "already submitted" in again["message"], again

    # The refused registration cost the request nothing: its own decode still gets it.
    decode2 = engines.start("decode", "d-router-hostile-2")
    decode2.connect(prefill)
    prefill.connect(decode2)
    decode2.add("d-right", 48, 3, router_params(params[rid], other), prompt_of=rid, content_id=rid)
    right = decode2.wait(["d-right"])["d-right"]
    assert verified(right) > 0, right
    assert len(events(prefill.wait([rid])[rid], "finished_sending")) == 1
    decode.add("d-plain", 32, 2, {})
    assert events(decode.wait(["d-plain"])["d-plain"], "finished")[0]["reason"] == "length"
