"""The benchmarks still run and check what they claim, at a tiny size (the figures are
`make bench`'s business, not the tests'): a push case over real NIXL with every byte
verified, its table, and the registry's interleaved churn measurement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtopo_bench import push, registry


def test_a_case_s_ratios_are_of_the_best_figures_before_rounding() -> None:
    # Throughputs whose rounded quotient differs from the quotient of the rounded figures:
    # the report's ratio is the former (issue 32: no test compares rounded figures).
    raw = {
        "progress_thread=off,in_flight=1,merge=off": 0.0574,
        "progress_thread=on,in_flight=1,merge=off": 0.0581,
        "progress_thread=off,in_flight=1,merge=on": 0.2,
    }
    pushed = {
        "progress_thread=off,in_flight=4,merge=off": 0.1354,
        "progress_thread=on,in_flight=4,merge=on": 0.1001,
    }
    engine = {"progress_thread=off,in_flight=1,merge=off": 0.05}
    case = push.summarize(4096, 4, 64, 1, True, raw=raw, raw_engine=engine, push=pushed)
    assert case.raw_config == "progress_thread=on,in_flight=1,merge=off"
    assert case.push_config == "progress_thread=off,in_flight=4,merge=off"
    assert case.ratio_push_vs_raw == round(0.1354 / 0.0581, 3) == 2.33
    assert round(case.push_gbps / case.raw_nixl_gbps, 3) == 2.328  # what rounding first gives
    assert case.ratio_push_vs_raw_merged == round(0.1354 / 0.2, 3)
    assert case.ratio_push_vs_raw_with_engine == round(0.1354 / 0.05, 3)
    assert case.push_per_block_gbps == 0.135 and case.raw_merged_gbps == 0.2


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
    assert case.ratio_push_vs_raw > 0 and case.ratio_push_vs_raw_with_engine > 0
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
        for size, ready, rollout in (("16x64", 0.4, 3.0), ("32x1000", 1.4, 30.0))
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
    # The handshake waves' targets at 64 x 2000: p50 and p99, the rollout's ratio.
    sizes[1]["rollout_converge_s"] = 30.0
    big = {
        "size": "64x2000",
        "ready_to_connected_p50_s": 1.2,
        "ready_to_connected_p99_s": 1.9,
        "rollout_vs_control_plane_only": 1.25,
        "grace_s": 1,
    }
    (tmp_path / "operator.json").write_text(json.dumps({"sizes": [*sizes, big]}))
    table, ok = summarize(tmp_path)
    assert not ok and "| ready -> connected p50, 64x2000 | 1.20 s | <= 1 s | **missed** |" in table
    assert "| ready -> connected p99, 64x2000 | 1.90 s | <= 2 s | met |" in table
    assert "| rollout / control plane only, 64x2000 | 1.25 | <= 1.3 | met |" in table


def _vllm_run(i: int, variant: str, p50_small: float, large_bps: float, **extra: Any) -> dict:
    def phase(p50: float, bps: float, nbytes: int, in_flight: int) -> dict[str, Any]:
        return {
            "p50_ms": p50,
            "p99_ms": p50 * 2,
            "kv_bytes_per_s": bps,
            "cpu_s_per_gb": 4.0,
            "cpu_s": {"prefill": 1.0, "decode": 2.0},
            "bytes_per_request": nbytes,
            "in_flight": in_flight,
            "failed": 0,
        }

    agent = {"progress_thread": variant != "kvtopo", "num_threads": 4 if variant == "nixl" else 0}
    return {
        "run": i,
        "round": 1,
        "variant": variant,
        "connector": "nixl" if variant == "nixl" else "kvtopo",
        "nixl_agent": {"prefill": agent, "decode": agent},
        "first_request_s": 0.4 if variant == "nixl" else 0.07,
        "small": phase(p50_small, 512 * 1024 / p50_small * 1000, 512 * 1024, 1),
        "large": phase(100.0, large_bps, 8 << 20, 4),
        **extra,
    }


def test_the_vllm_report_interleaves_the_variants_and_names_each_ratio() -> None:
    from kvtopo_bench import vllm

    assert [v.name for v in vllm.VARIANTS] == [
        "nixl",
        "kvtopo",
        "kvtopo_progress_thread",
        "kvtopo_no_operator",
    ]
    order = [n for _, n in vllm.run_order(["a", "b"], 4)]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    runs = [
        _vllm_run(1, "nixl", 120.0, 30e6, replaced_prefill_s=None),
        _vllm_run(2, "kvtopo", 61.0, 40e6, replaced_prefill_s=0.1),
        _vllm_run(3, "kvtopo", 59.0, 50e6),
        _vllm_run(4, "nixl", 130.0, 20e6),
    ]
    agg = vllm.aggregate(runs, ["nixl", "kvtopo"])
    nixl, kvtopo = agg["variants"]
    assert kvtopo["small"]["p50_ms"] == 60.0 and nixl["large"]["kv_bytes_per_s"] == 25e6
    assert kvtopo["replaced_measured"] == 1 and kvtopo["replaced_prefill_s"] == 0.1
    assert nixl["replaced_measured"] == 1 and nixl["replaced_prefill_s"] is None
    ratios = agg["ratios"]["kvtopo"]
    # Each ratio is the variant's median over nixl's, of the medians as measured.
    assert abs(ratios["p50_ratio_small"] - 60.0 / 125.0) < 1e-9
    assert abs(ratios["kv_bytes_per_s_ratio_large"] - 45e6 / 25e6) < 1e-9
    assert ratios["cpu_s_per_gb_ratio_large"] == 1.0
    report = {
        "rounds": 2,
        "order": [r["variant"] for r in runs],
        "replaced_limit_s": 60.0,
        "small": {"bytes": 512 * 1024, "in_flight": 1},
        "large": {"bytes": 8 << 20, "in_flight": 4},
        **agg,
        "runs": runs,
    }
    table = vllm.format_table(report)
    lines = table.splitlines()
    assert lines[0] == "| | nixl | kvtopo |"
    assert (
        "| NIXL agents (prefill and decode) | progress thread on, 4 UCX threads "
        "| progress thread off, 0 UCX threads |" in table
    )
    assert "| prefill replaced -> a request succeeds | none in 60 s | 0.10 s |" in table
    assert "| large (8 MiB x 4 in flight): p50 | 100.0 ms | 100.0 ms |" in table
    assert "| large: KV MB/s | 25.0 | 45.0 |" in table
    assert "interleaved (2 rounds, order nixl kvtopo kvtopo nixl)" in table
    assert "kv_bytes_per_s_ratio_large = verified KV bytes a second at 8 MiB x 4" in table
    assert "kvtopo / nixl: p50_ratio_small 0.48," in table
    assert sum(line.startswith("| 3 | kvtopo |") for line in lines) == 1


def test_the_summary_reads_the_interleaved_vllm_report(tmp_path: Path) -> None:
    from kvtopo_bench import vllm
    from kvtopo_bench.summary import _vllm

    runs = [
        _vllm_run(1, "nixl", 120.0, 30e6, replaced_prefill_s=None),
        _vllm_run(2, "kvtopo", 60.0, 20e6, replaced_prefill_s=0.1),
        _vllm_run(3, "kvtopo", 60.0, 20e6),
        _vllm_run(4, "nixl", 120.0, 30e6),
    ]
    report = {
        "replaced_limit_s": 60.0,
        "large": {"bytes": 8 << 20, "in_flight": 4},
        **vllm.aggregate(runs, ["nixl", "kvtopo"]),
    }
    rows = _vllm(report)
    assert rows[0] == (
        "KV bytes/s, KVTopoConnector (kvtopo) / NixlPushConnector, 8 MiB x 4 in flight",
        "0.67",
        ">= 0.95",
        "**missed**",
    )
    assert (
        "prefill replaced -> a request succeeds, vllm nixl",
        "none in 60 s",
        "(quoted)",
        "-",
    ) in rows
    assert sum(r[0].startswith("first request, vllm kvtopo") for r in rows) == 1


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


def test_the_wire_benchmark_alternates_the_clients_and_every_call_is_answered(
    tmp_path: Path,
) -> None:
    from kvtopo_bench import wirecalls

    out = tmp_path / "wire.json"
    report = wirecalls.run(out, quick=True, log=lambda _: None, calls=300)
    assert [r["client"] for r in report["runs"]] == ["aiohttp", "wire", "wire", "aiohttp"]
    for r in report["runs"]:
        # Each run's server counted exactly its calls (run() raises otherwise); keep-alive
        # reuses connections: far fewer of them than calls.
        assert 1 <= r["server_connections"] < 300
        assert r["client_cpu_us"] > 0 and r["wall_us"] > 0
    assert set(report["ratios"]) == {
        "client_cpu_us_wire_vs_aiohttp",
        "server_cpu_us_wire_vs_aiohttp",
        "wall_us_wire_vs_aiohttp",
    }
    assert json.loads(out.read_text())["runs"] == report["runs"]
