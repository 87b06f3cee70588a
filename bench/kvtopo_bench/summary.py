"""`kvtopo bench summary`: one table of the figures that have targets, from the JSON reports.

Owns the targets of the benchmarks issue and their check against `bench/results/*.json`
(push, registry, operator, vllm): each row says the figure, the target and whether it is met.
`make bench` prints it last. A missing report is reported as such, not guessed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str, str]  # what, measured, target, verdict


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _push(report: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    variants = [("CPU", report.get("cases", []), report.get("memcpy_gbps", 0.0))]
    gpu = report.get("gpu") or {}
    if "cases" in gpu:
        variants.append(("GPU", gpu["cases"], gpu["memcpy_gbps"]))
    for name, cases, memcpy in variants:
        for c in cases:
            case = f"{c['block_bytes'] // 1024} KiB x {c['blocks_per_request']}"
            ratio = c["ratio_push_vs_raw"]
            share = c["push_gbps"] / memcpy if memcpy else 0.0
            if name == "CPU":
                rows.append(
                    (
                        f"push/raw NIXL, {name} {case}",
                        f"{ratio:.2f}",
                        ">= 0.9",
                        _verdict(ratio >= 0.9),
                    )
                )
            else:
                rows.append((f"push/raw NIXL, {name} {case}", f"{ratio:.2f}", "(quoted)", "-"))
            rows.append(
                (f"push/memcpy, {name} {case}", f"{share:.2f}", ">= 0.4", _verdict(share >= 0.4))
            )
            rows.append(
                (
                    f"every byte verified, {name} {case}",
                    str(c["verified"]).lower(),
                    "true",
                    _verdict(bool(c["verified"])),
                )
            )
    if "skipped" in gpu:
        rows.append(("push, GPU variant", "not run", "where a GPU is lent", gpu["skipped"]))
    return rows


def _registry(report: dict[str, Any]) -> list[Row]:
    snap, churn = report["snapshot_p99_us"], report["churn_ratio"]
    return [
        ("registry snapshot p99, 64 ranks", f"{snap:.2f} us", "<= 2 us", _verdict(snap <= 2)),
        ("registry writer churn ratio", f"{churn:.3f}", ">= 0.95", _verdict(churn >= 0.95)),
    ]


# The operator figures shown per size: JSON key, label, format.
_OPERATOR_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("ready_to_connected_p50_s", "ready -> connected p50", "{:.2f} s"),
    ("ready_to_connected_p99_s", "ready -> connected p99", "{:.2f} s"),
    ("gone_to_evicted_p99_s", "gone -> evicted p99", "{:.2f} s"),
    ("rollout_converge_s", "rollout converged", "{:.1f} s"),
    ("rollout_control_plane_only_s", "the same rollout, control plane only", "{:.1f} s"),
    ("rollout_vs_control_plane_only", "rollout / control plane only", "{:.2f}"),
    ("operator_rss_mb", "operator RSS", "{:.0f} MB"),
    ("cpu_s_per_1k_events", "operator CPU s / 1k pod events", "{:.2f}"),
)


def _operator_targets(size: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """The targets for one size (the operator-scale issue's, which tightened the benchmarks
    issue's, and the performance issue's handshake waves, which tightened both): JSON key ->
    (upper bound, as written)."""
    grace = size["grace_s"]
    return {
        "16x64": {
            "ready_to_connected_p99_s": (0.5, "<= 0.5 s"),
            "gone_to_evicted_p99_s": (grace + 1.0, f"<= {grace + 1} s"),
        },
        "32x1000": {
            "ready_to_connected_p99_s": (1.5, "<= 1.5 s"),
            "gone_to_evicted_p99_s": (3.0, "<= 3 s"),
            "rollout_converge_s": (30.0, "<= 30 s"),
            "rollout_vs_control_plane_only": (1.3, "<= 1.3"),
            "operator_rss_mb": (200.0, "<= 200 MB"),
        },
        "64x2000": {
            "ready_to_connected_p50_s": (1.0, "<= 1 s"),
            "ready_to_connected_p99_s": (2.0, "<= 2 s"),
            "rollout_converge_s": (60.0, "<= 60 s"),
            "rollout_vs_control_plane_only": (1.3, "<= 1.3"),
            "operator_rss_mb": (300.0, "<= 300 MB"),
        },
    }.get(size["size"], {})


def _operator(report: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    decided = report.get("decision")  # absent from a report of an older bench
    if decided is not None:
        size, steady = decided["size"], decided["steady_round_s"]
        rows.append(
            (
                f"decision per round, steady, {size}",
                f"{steady:.3f} s",
                "<= 0.1 s",
                _verdict(steady <= 0.1),
            )
        )
        for key, label in (
            ("steady_no_memo_round_s", "the same round, nothing remembered"),
            ("one_replaced_round_s", "decision per round, one decode replaced"),
            ("one_replaced_read_round_s", "the same round, every prefill's view read anew"),
        ):
            if key in decided:  # a report of an older bench lacks the last
                rows.append((f"{label}, {size}", f"{decided[key]:.3f} s", "-", "-"))
    for size in report["sizes"]:
        targets = _operator_targets(size)
        for key, label, fmt in _OPERATOR_FIGURES:
            if key not in size:  # a figure a report from an older bench does not have
                continue
            value = size[key]
            bound = targets.get(key)
            target, verdict = (
                ("-", "-") if bound is None else (bound[1], _verdict(value <= bound[0]))
            )
            rows.append((f"{label}, {size['size']}", fmt.format(value), target, verdict))
    return rows


def _vllm(report: dict[str, Any]) -> list[Row]:
    if "variants" in report:  # interleaved runs: each variant's medians, named ratios
        entries = report["variants"]
        ratios = report.get("ratios", {})
        # Connector to connector: kvtopo with vLLM's NIXL agent settings where it ran.
        name = "kvtopo_progress_thread" if "kvtopo_progress_thread" in ratios else "kvtopo"
        ratio = ratios.get(name, {}).get("kv_bytes_per_s_ratio_large")
        large = report.get("large", {})
        label = (
            f"KV bytes/s, KVTopoConnector ({name}) / NixlPushConnector, "
            f"{large.get('bytes', 0) >> 20} MiB x {large.get('in_flight', '?')} in flight"
        )
    else:  # a report of the earlier bench: one run per variant
        entries = report["runs"]
        ratio = report["throughput_ratio"]
        label = "KV throughput, KVTopoConnector / NixlPushConnector"
    rows: list[Row] = [
        (
            label,
            "none" if ratio is None else f"{ratio:.2f}",
            ">= 0.95",
            _verdict(ratio is not None and ratio >= 0.95),
        )
    ]
    limit = f"none in {report['replaced_limit_s']:.0f} s"
    for entry in entries:
        name = entry["variant"]
        first, replaced = entry["first_request_s"], entry["replaced_prefill_s"]
        said = "failed" if first is None else f"{first:.3f} s"
        rows.append((f"first request, vllm {name}", said, "(quoted)", "-"))
        if entry.get("replaced_measured", 1):
            rows.append(
                (
                    f"prefill replaced -> a request succeeds, vllm {name}",
                    limit if replaced is None else f"{replaced:.2f} s",
                    "(quoted)",
                    "-",
                )
            )
    return rows


SECTIONS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "push": _push,
    "registry": _registry,
    "operator": _operator,
    "vllm": _vllm,
}


def summarize(results: Path) -> tuple[str, bool]:
    """The table, and whether every target with a verdict is met (and every report found)."""
    rows: list[Row] = []
    ok = True
    for name, section in SECTIONS.items():
        path = results / f"{name}.json"
        if not path.exists():
            rows.append((f"{name} benchmark", "no report", str(path), "**missing**"))
            ok = False
            continue
        section_rows = section(json.loads(path.read_text()))
        ok &= not any(r[3] == "**missed**" for r in section_rows)
        rows += section_rows
    lines = ["| figure | measured | target | |", "|---|---|---|---|"]
    lines += [
        f"| {what} | {value} | {target} | {verdict} |" for what, value, target, verdict in rows
    ]
    return "\n".join(lines), ok
