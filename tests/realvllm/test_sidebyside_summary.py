"""The side-by-side benchmark's arithmetic (tests/realvllm/sidebyside.py): medians over a
variant's runs, failures summed, and ratios over vLLM's pull connector, on made-up runs (no
servers)."""

from __future__ import annotations

from typing import Any

from tests.realvllm import sidebyside


def run(variant: str, ttft_ms: float, cpu_ms: float, failed: int = 0) -> dict[str, Any]:
    phase = {
        "ttft_p50_ms": ttft_ms,
        "ttft_p99_ms": 2 * ttft_ms,
        "total_p50_ms": 3 * ttft_ms,
        "failed": failed,
        "cpu_ms_per_request": {"prefill": cpu_ms, "decode": cpu_ms / 2},
    }
    return {
        "variant": variant,
        "sequential": phase,
        "concurrent": phase,
        "idle_cpu_per_s": {"prefill": 0.5, "decode": 0.25},
    }


def test_medians_over_runs_failures_summed_and_ratios_over_the_pull_connector() -> None:
    runs = [
        run("nixl_pull", 100, 40),
        run("kvtopo", 50, 10, failed=1),
        run("kvtopo", 30, 30, failed=2),
        run("nixl_pull", 300, 60),
        run("kvtopo", 40, 20),
    ]
    out = sidebyside.summarize(runs)
    assert set(out) == {"nixl_pull", "kvtopo"}  # variants without runs are left out
    assert out["nixl_pull"]["sequential_ttft_p50_ms"] == 200.0
    assert out["kvtopo"]["sequential_ttft_p50_ms"] == 40.0
    assert out["kvtopo"]["concurrent_failed"] == 3
    assert out["kvtopo"]["concurrent_cpu_ms_per_request_decode"] == 10.0
    ratios = out["kvtopo"]["ratio_over_nixl_pull"]
    assert ratios["sequential_ttft_p50_ms"] == 0.2
    assert ratios["concurrent_cpu_ms_per_request_prefill"] == 0.4
    assert out["nixl_pull"]["ratio_over_nixl_pull"]["sequential_ttft_p99_ms"] == 1.0


def test_percentiles_pick_a_measured_value() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert sidebyside.pct(values, 0.5) == 3.0
    assert sidebyside.pct(values, 0.99) == 5.0
    assert sidebyside.pct(values, 0.0) == 1.0
