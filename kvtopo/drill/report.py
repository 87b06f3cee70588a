"""The drill's presentation: the report's table, the PNG timeline and the live progress view.

Owns how a drill's ledger and report are shown; computes nothing the report does not hold
(except per-second bins for the plot).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtopo.drill.ledger import Ledger

if TYPE_CHECKING:
    from kvtopo.drill.run import Drill


def render_table(report: dict[str, Any]) -> Any:
    """The report as a table with each figure's target."""
    from rich.table import Table

    table = Table(title="kvtopo drill", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target")
    conv = report["convergence_s"]
    rows = [
        ("rollouts", str(report["rollouts"]), f">= {report.get('rollouts_target', 3)}"),
        ("requests", str(report["requests_total"]), f">= {report.get('requests_target', 1000)}"),
        ("completed (verified)", str(report["completed"]), ""),
        ("failed", json.dumps(report["failed_by_reason"]) or "{}", "explained"),
        ("lost", str(report["lost"]), "0"),
        ("false failures", str(report["false_failures"]), "0"),
        ("duplicate failure reports", str(report["duplicate_failure_reports"]), "0"),
        ("corrupted (failed verification)", str(report["corrupted"]), "0"),
        ("outcome mismatch (prefill vs decode)", str(report["outcome_mismatch"]), "0"),
        ("KV blocks written after their request ended", str(report.get("late_writes", 0)), "0"),
        ("verified bytes", f"{report['verified_bytes']:,}", ""),
        ("convergence per rollout (s)", ", ".join(f"{c:.2f}" for c in conv) or "-", "p99 <= 5"),
        ("convergence p99, all new engines (s)", str(report["convergence_p99_s"]), "<= 5"),
        (
            "eviction max (s)",
            str(report["eviction_max_s"]),
            f"<= grace + 2 ({report.get('grace', '?')} + 2)",
        ),
        (
            "fault over -> converged (s; the rest of the rollout, which the gate holds)",
            ", ".join(f"{c:.2f}" for c in report["chaos_recovery_s"]) or "-",
            "",
        ),
        (
            f"engine serving -> pod Ready (kv-connected gate) p99 (s), {report['gated_engines']}"
            " engines",
            str(report["engine_up_to_gate_p99_s"]),
            "<= 1",
        ),
        ("stale peers at the end", str(report["stale_peers_at_end"]), "0"),
        (
            "gates of connected engines turned False",
            str(report.get("gate_drops_while_connected", 0)),
            "0",
        ),
    ]
    if report.get("abort_share_wanted"):
        rows.insert(
            3,
            (
                "aborted (at random stages, either side)",
                f"{report['aborted']} ({100 * report['aborted_share']:.1f}%)",
                ">= 10%",
            ),
        )
    if report.get("abort_stages"):
        stages = ", ".join(f"{k} {v}" for k, v in report["abort_stages"].items())
        rows.append(("where the aborts found their requests", stages, "every stage"))
    if report.get("leader_takeover_s"):
        rows.insert(
            -1,
            (
                "leader killed -> converged (s)",
                ", ".join(f"{c:.2f}" for c in report["leader_takeover_s"]),
                f"<= lease + 5 ({report.get('lease_s', '?')} + 5)",
            ),
        )
    if report.get("restart_recovery_s"):
        rows.insert(
            -1,
            (
                "engine restarted in its pod -> every pair connected (s)",
                ", ".join(f"{c:.2f}" for c in report["restart_recovery_s"]),
                "no manual action",
            ),
        )
    for r in rows:
        table.add_row(*r)
    return table


def render_plot(ledger: Ledger, report: dict[str, Any], path: Path) -> None:
    """The PNG timeline: completions, failures by reason and connected pairs per second,
    with the rollout, scale and chaos marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = ledger.t0
    ends = [r.ended_at - t0 for r in ledger.requests.values() if r.ended_at is not None]
    horizon = max([*ends, *(t - t0 for t in ledger.samples_t), 1.0])
    bins = int(horizon) + 1
    done = [0] * bins
    failed: dict[str, list[int]] = {}
    for r in ledger.requests.values():
        if r.ended_at is None or not r.decode_outcomes:
            continue
        b = int(r.ended_at - t0)
        o = r.decode_outcomes[0]
        if o["status"] == "done":
            done[b] += 1
        else:
            failed.setdefault(str(o.get("reason")), [0] * bins)[b] += 1
    fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True)
    axes[0].plot(range(bins), done, color="tab:green", label="completed (verified)")
    axes[0].set_ylabel("requests / s")
    axes[0].legend(loc="upper left")
    for reason, series in sorted(failed.items()):
        axes[1].bar(range(bins), series, label=reason)
    axes[1].set_ylabel("failures / s")
    if failed:
        axes[1].legend(loc="upper left")
    else:
        axes[1].text(0.5, 0.5, "no failures", transform=axes[1].transAxes, ha="center")
    axes[2].step(
        [t - t0 for t in ledger.samples_t],
        [len(p) for p in ledger.samples_pairs],
        where="post",
        color="tab:blue",
    )
    axes[2].set_ylabel("connected pairs")
    axes[2].set_xlabel("seconds since the drill started")
    colors = {"rollout": "tab:orange", "scale": "tab:purple", "chaos": "tab:red", "phase": "grey"}
    for m in ledger.marks:
        for ax in axes:
            ax.axvline(m.t - t0, color=colors.get(m.kind, "grey"), linestyle="--", linewidth=1)
        axes[0].annotate(
            m.label,
            (m.t - t0, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
        )
    fig.suptitle(
        f"kvtopo drill: {report['requests_total']} requests, lost {report['lost']}, "
        f"false failures {report['false_failures']}, "
        f"duplicates {report['duplicate_failure_reports']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress_view(drill: Drill) -> Any:
    """The live view: phase, current step, request counts, engines and pairs."""
    from rich.table import Table

    rep_done = sum(
        1
        for r in drill.ledger.requests.values()
        if r.decode_outcomes and r.decode_outcomes[0]["status"] == "done"
    )
    rep_failed = sum(
        1
        for r in drill.ledger.requests.values()
        if r.decode_outcomes and r.decode_outcomes[0]["status"] == "failed"
    )
    pairs = len(drill.ledger.samples_pairs[-1]) if drill.ledger.samples_pairs else 0
    engines = len(drill.fleet.serving()) if drill.fleet else 0
    t = Table.grid(padding=(0, 2))
    t.add_row("phase", drill.phase)
    t.add_row("current", drill.rollout_label)
    t.add_row(
        "requests done / failed / in flight",
        f"{rep_done} / {rep_failed} / {drill.ledger.in_flight()}",
    )
    t.add_row("serving engines / connected pairs", f"{engines} / {pairs}")
    t.add_row("elapsed", f"{time.monotonic() - drill.ledger.t0:.0f} s")
    return t
