"""The benchmarks still run and check what they claim, at a tiny size (the figures are
`make bench`'s business, not the tests'): a push case over real NIXL with every byte
verified, its table, and the registry's interleaved churn measurement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtopo_bench import push, registry


def test_a_tiny_push_case_moves_and_verifies_every_byte() -> None:
    logged: list[str] = []
    case = push.run_case(4096, 4, 64, 1, logged.append, "cpu")
    assert case.verified and case.requests >= 64
    assert case.raw_nixl_gbps > 0 and case.push_gbps > 0 and case.raw_merged_gbps > 0
    assert case.raw_with_engine_gbps > 0
    # Every configuration ran: progress thread x in flight x merging, raw and push.
    assert len(case.push_all) == 2 * len(push.PUSH_WINDOWS) * 2
    assert len(case.raw_all) == 2 * len(push.WINDOWS) * 2
    assert case.raw_config.endswith("merge=off")  # the floor is the per-block anchor
    # The ratio is push over raw, of the figures before they were rounded to 3 decimals:
    # within what rounding each figure by half a unit allows (at the tiny throughputs of a
    # busy machine their quotient moves far more than the ratio's own rounding).
    half = 0.0005
    low = (case.push_gbps - half) / (case.raw_nixl_gbps + half)
    high = (case.push_gbps + half) / max(case.raw_nixl_gbps - half, 1e-9)
    assert low - half <= case.ratio_push_vs_raw <= high + half, vars(case)
    report: dict[str, Any] = {
        "cases": [vars(case)],
        "memcpy_gbps": 10.0,
        "gpu": {"skipped": "no CUDA device"},
    }
    table = push.format_table(report)
    assert "4 KiB x 4" in table and "GPU variant skipped" in table
    assert push.all_verified(report)
    report["gpu"] = {
        "device": "x",
        "memcpy_gbps": 1.0,
        "cases": [{**vars(case), "verified": False}],
    }
    assert not push.all_verified(report)


def test_the_churn_measurement_alternates_segments_and_churns() -> None:
    res = registry.writer_under_churn(0.8, 1000.0, segment_s=0.1)
    assert res.segments == 8
    assert res.rps_alone > 0 and res.rps_under_churn > 0
    assert 0 < res.churn_ratio < 2
    assert res.evictions_per_s > 300  # the churn thread really ran while it was on


def test_the_summary_checks_each_target_and_says_what_is_missing(tmp_path: Path) -> None:
    from kvtopo_bench.summary import summarize

    table, ok = summarize(tmp_path)
    assert not ok and table.count("**missing**") == 4
    case = {
        "block_bytes": 32768,
        "blocks_per_request": 64,
        "ratio_push_vs_raw": 0.93,
        "push_gbps": 7.0,
        "verified": True,
    }
    (tmp_path / "push.json").write_text(
        json.dumps({"cases": [case], "memcpy_gbps": 14.0, "gpu": {"skipped": "no CUDA device"}})
    )
    (tmp_path / "registry.json").write_text(
        json.dumps({"snapshot_p99_us": 0.8, "churn_ratio": 0.97})
    )
    sizes = [
        {
            "size": size,
            "ready_to_connected_p99_s": ready,
            "gone_to_evicted_p99_s": 1.2,
            "grace_s": 1,
            "rollout_converge_s": rollout,
            "operator_rss_mb": 170.0,
            "cpu_s_per_1k_events": 4.0,
        }
        for size, ready, rollout in (("16x64", 0.4, 3.0), ("32x1000", 2.5, 30.0))
    ]
    decided = {
        "size": "500x1500",
        "steady_round_s": 0.06,
        "steady_no_memo_round_s": 0.5,
        "one_replaced_round_s": 0.4,
    }
    (tmp_path / "operator.json").write_text(json.dumps({"sizes": sizes, "decision": decided}))
    vllm = {
        "replaced_limit_s": 60.0,
        "throughput_ratio": 1.2,
        "runs": [
            {"variant": "nixl", "first_request_s": 0.4, "replaced_prefill_s": None},
            {"variant": "kvtopo", "first_request_s": 0.07, "replaced_prefill_s": 0.1},
        ],
    }
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    table, ok = summarize(tmp_path)
    assert ok and "**missed**" not in table and "no CUDA device" in table
    assert "| prefill replaced -> a request succeeds, vllm nixl | none in 60 s |" in table
    assert "| decision per round, steady, 500x1500 | 0.060 s | <= 0.1 s | met |" in table
    vllm["throughput_ratio"] = 0.9
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    table, ok = summarize(tmp_path)
    assert not ok and "NixlPushConnector | 0.90 | >= 0.95 | **missed** |" in table
    vllm["throughput_ratio"] = 1.2
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    sizes[1]["rollout_converge_s"] = 31.0
    (tmp_path / "operator.json").write_text(json.dumps({"sizes": sizes}))
    table, ok = summarize(tmp_path)
    assert not ok and "| rollout converged, 32x1000 | 31.0 s | <= 30 s | **missed** |" in table


def test_the_vllm_table_puts_the_variants_side_by_side() -> None:
    from kvtopo_bench import vllm

    steady = {"p50_ms": 60.0, "p99_ms": 90.0, "bytes_per_s": 4_000_000, "failed": 0}
    report = {
        "replaced_limit_s": 60.0,
        "throughput_ratio": 1.5,
        "throughput_ratio_no_operator": 1.4,
        "runs": [
            {
                "variant": "nixl",
                "first_request_s": 0.4,
                "replaced_prefill_s": None,
                "steady": {**steady, "bytes_per_s": 2_000_000, "failed": 3},
            },
            {
                "variant": "kvtopo",
                "first_request_s": 0.07,
                "replaced_prefill_s": 0.1,
                "steady": steady,
            },
        ],
    }
    table = vllm.format_table(report)
    assert table.splitlines()[0] == "| | nixl | kvtopo |"
    assert "| prefill replaced -> a request succeeds | none in 60 s | 0.10 s |" in table
    assert "| steady KV bytes/s | 2,000,000 | 4,000,000 |" in table
    assert "| steady failed | 3 | 0 |" in table
    assert [v.name for v in vllm.VARIANTS] == ["nixl", "kvtopo", "kvtopo_no_operator"]


def test_the_decision_benchmark_measures_rounds_over_a_full_mesh() -> None:
    from kvtopo_bench import decision

    res = decision.measure(4, 12, rounds=2)
    assert res["size"] == "4x12" and res["pairs"] == 48
    for key in ("cold_round_s", "steady_round_s", "steady_no_memo_round_s", "one_replaced_round_s"):
        assert res[key] > 0, res


def test_the_isolation_benchmark_measures_a_pair_beside_each_attack() -> None:
    """Real workers and NIXL, tiny phases: each kind's quiet and hostile phases both carried
    the pair's requests (all done), and the attack really sent while it was on."""
    from kvtopo_bench import isolation

    report = isolation.run(None, quick=True, log=lambda line: None, phase_s=0.6)
    assert set(report["cases"]) == set(isolation.KINDS)
    for kind, case in report["cases"].items():
        assert case["quiet_requests"] > 0 and case["hostile_requests"] > 0, (kind, case)
        assert case["failed"] == 0, (kind, case)
        assert case["hostile_messages"] > 0, (kind, case)
        assert abs(case["delay_p99_ms"] - (case["hostile_p99_ms"] - case["quiet_p99_ms"])) < 0.05
