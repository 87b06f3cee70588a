"""`kvtopo bench wire`: what one operator call to a worker costs, per HTTP client.

Owns one measurement: `PATCH /v1/peers` calls, `CONCURRENCY` out at once, each to one of
`ENDPOINTS` worker endpoints (a loopback address each, 127.0.1.x, one aiohttp server process
as the fake workers, answering a small JSON body), made by

- `aiohttp`: aiohttp's client as the operator used it until the eleventh session of
  2026-12-05 (one `ClientSession`, a `TCPConnector` with `limit=256` and keep-alive, a
  `ClientTimeout` per call, the body read whole);
- `wire`: `kvtopo_operator.wire.WirePool` as `WorkerClient` uses it now.

The contenders alternate A B B A in one run; each run reports the client's CPU time per call
(this process), the server's CPU time per call (its process, read from it before and after),
the wall time per call and the connections the server accepted. The report's `ratios` are
wire / aiohttp of the medians.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvtopo_operator.wire import WirePool
from kvtopo_worker.endpoints import parse_endpoint

ENDPOINTS = 200
CONCURRENCY = 64
CALLS = 6000
BODY = b'{"add": [], "evict": []}'
ANSWER = b'{"results": []}'


def _host(i: int) -> str:
    return f"127.0.1.{i + 1}"


async def _serve(n: int) -> None:
    """The fake workers: every endpoint on one runner; `/stats` says what they cost."""
    # The transports themselves, held: an id of a closed one could be reused by the next.
    transports: set[object] = set()
    calls = 0

    async def patch(request: web.Request) -> web.Response:
        nonlocal calls
        await request.read()
        calls += 1
        transports.add(request.transport)
        return web.Response(body=ANSWER, content_type="application/json")

    async def stats(request: web.Request) -> web.Response:
        t = os.times()
        return web.json_response(
            {"connections": len(transports), "calls": calls, "cpu_s": t.user + t.system}
        )

    app = web.Application()
    app.router.add_patch("/v1/peers", patch)
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # The first endpoint's port is any free one; the others share it (each its own address).
    port = 0
    for i in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_host(i), port))
        port = int(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
    print(f"ready {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    await runner.cleanup()


async def _stats(session: aiohttp.ClientSession, port: int) -> dict[str, Any]:
    async with session.get(f"http://{_host(0)}:{port}/stats") as r:
        out: dict[str, Any] = await r.json()
        return out


async def _one_run(kind: str, port: int, calls: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    targets = [rng.randrange(ENDPOINTS) for _ in range(calls)]
    gate = asyncio.Semaphore(CONCURRENCY)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as probe:
        before = await _stats(probe, port)
        t0, w0 = os.times(), time.monotonic()
        if kind == "aiohttp":
            connector = aiohttp.TCPConnector(limit=256, force_close=False, keepalive_timeout=60)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one(i: int) -> None:
                    async with (
                        gate,
                        session.patch(
                            f"http://{_host(i)}:{port}/v1/peers",
                            data=BODY,
                            headers=headers,
                            timeout=aiohttp.ClientTimeout(total=5),
                        ) as r,
                    ):
                        if r.status != 200 or await r.read() != ANSWER:
                            raise RuntimeError(f"unexpected answer {r.status}")

                await asyncio.gather(*(one(i) for i in targets))
        else:
            pool = WirePool(limit=256, keepalive_s=60)
            ends = [parse_endpoint(f"{_host(i)}:{port}") for i in range(ENDPOINTS)]

            async def one(i: int) -> None:
                async with gate:
                    a = await pool.request(ends[i], "PATCH", "/v1/peers", headers, BODY, 5, 1 << 20)
                if a.status != 200 or a.body != ANSWER:
                    raise RuntimeError(f"unexpected answer {a.status}")

            try:
                await asyncio.gather(*(one(i) for i in targets))
            finally:
                pool.close()
        t1, w1 = os.times(), time.monotonic()
        after = await _stats(probe, port)
    if after["calls"] - before["calls"] != calls:
        raise RuntimeError(f"the server counted {after['calls'] - before['calls']} calls")
    return {
        "client": kind,
        "client_cpu_us": round((t1.user + t1.system - t0.user - t0.system) / calls * 1e6, 1),
        "server_cpu_us": round((after["cpu_s"] - before["cpu_s"]) / calls * 1e6, 1),
        "wall_us": round((w1 - w0) / calls * 1e6, 1),
        "server_connections": after["connections"] - before["connections"],
    }


def run(
    json_path: Path | None,
    *,
    quick: bool,
    log: Callable[[str], None],
    calls: int | None = None,
) -> dict[str, Any]:
    """Both clients, A B B A (twice unless `quick`), `calls` calls a run; returns and writes
    the report."""
    calls = calls or (CALLS // 3 if quick else CALLS)
    order = ["aiohttp", "wire", "wire", "aiohttp"] * (1 if quick else 2)
    log(
        f"kvtopo bench wire: {calls} PATCH calls per run, {CONCURRENCY} out at once, "
        f"to {ENDPOINTS} endpoints"
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "kvtopo_bench.wirecalls", "--serve", str(ENDPOINTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        word, _, port = server.stdout.readline().strip().partition(" ")
        if word != "ready" or not port.isdigit():
            raise RuntimeError("the fake worker server did not start (is 127.0.1.x usable?)")
        runs = []
        for n, kind in enumerate(order):
            r = asyncio.run(_one_run(kind, int(port), calls, seed=n))
            log(f"  {json.dumps(r)}")
            runs.append(r)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def median(kind: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs if r["client"] == kind))

    keys = ("client_cpu_us", "server_cpu_us", "wall_us")
    medians = {k: {key: round(median(k, key), 1) for key in keys} for k in ("aiohttp", "wire")}
    report: dict[str, Any] = {
        "benchmark": "wire",
        "quick": quick,
        "calls_per_run": calls,
        "concurrency": CONCURRENCY,
        "endpoints": ENDPOINTS,
        "runs": runs,
        "medians": medians,
        "ratios": {
            f"{key}_wire_vs_aiohttp": round(medians["wire"][key] / medians["aiohttp"][key], 3)
            for key in keys
        },
    }
    log(f"  medians {json.dumps(medians)}")
    log(f"  ratios {json.dumps(report['ratios'])}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        asyncio.run(_serve(int(sys.argv[2])))
    else:
        print("usage: kvtopo bench wire [--json PATH] [--quick]", file=sys.stderr)
        sys.exit(2)
