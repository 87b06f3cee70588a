"""One worker cannot grow, blind or knock out its topology (issue 54, defects 2, 3 and 6).

Real API server (tier a), real `kvtopo-worker` processes beside one that lies
(`tests.e2e.hostile_worker`, its own process on its pod's IP), the operator as its own
process. On 7314fe4:
- a decode answering a 15 MB `health_reason`, new on every read, grew the operator by
  hundreds of MB (Event keys kept whole);
- a pod whose worker reports a connected prefill's engine id made both unusable: the
  decodes' gates went False and a new decode never connected;
- a worker reporting 1,500 made-up peers produced ~1,450 phantom engine lines that pushed
  the real engines out of the status, and spent the Event budget on them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvtopo.drill.gates import GateWatch
from kvtopo_operator.kube import ClusterApi
from tests.cluster.kube import create_engine_pod, get_json, loopback_pod_ip, mark_pod_ready
from tests.e2e.env import Env
from tests.e2e.harness import ROOT
from tests.e2e.test_gate import gate

pytestmark = pytest.mark.nixl


def hostile(env: Env, name: str, role: str, *args: str, kv_gate: bool = False) -> None:
    """An engine pod served by the lying worker (see `tests.e2e.hostile_worker`)."""
    ip = loopback_pod_ip()
    uid = create_engine_pod(env.cluster, env.namespace, name, role, {"version": "v1"})  # type: ignore[arg-type]
    log = (env.tmp / f"hostile-{name}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.e2e.hostile_worker",
            "--host",
            ip,
            "--port",
            "8975",
            "--pod-uid",
            uid,
            "--role",
            role,
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    env.others.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"listening", Path(log.name).read_text()
    mark_pod_ready(env.cluster, env.namespace, name, [ip], kv_gate=kv_gate)


# Under the operator's 8 MiB bound on a worker's answer (`wire.TooLarge` refuses larger ones
# unread): each answer is parsed, and the reason is clamped where it enters.
REASON_BYTES = 6_000_000


def hostile_reads(env: Env, name: str) -> int:
    """How many `/v1/state` answers the lying worker of pod `name` has given."""
    ip = get_json(env.cluster, "pod", name, "-n", env.namespace)["status"]["podIP"]
    with urllib.request.urlopen(f"http://{ip}:8975/debug/reads", timeout=5) as r:
        return int(json.load(r)["reads"])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def events(env: Env, reason: str) -> list[dict[str, object]]:
    got = get_json(env.cluster, "events", "-n", env.namespace)
    return [e for e in got.get("items") or [] if e.get("reason") == reason]


def test_a_worker_answering_huge_changing_reasons_does_not_grow_the_operator(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    p0 = env.workers["p0"]
    compat = str(p0.state()["compat_hash"])
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "1/1")
    assert env.operator is not None
    base = rss_mib(env.operator.pid)
    hostile(
        env,
        "d9",
        "decode",
        "--engine-id",
        "D9-hostile",
        "--compat-hash",
        compat,
        "--unhealthy-peer",
        p0.engine_id,
        "--reason-bytes",
        str(REASON_BYTES),
    )
    # Each unhealthy report is new (healthy on the reads between): the operator reads a 6 MB
    # reason on every other read and says a PeerUnhealthy Event each time the pair's report
    # turns unhealthy again (as often as its reads of the worker see it: the re-read age).
    reads = lambda: hostile_reads(env, "d9")  # noqa: E731
    env.wait(
        "16 reads of the hostile worker (8 with a 6 MB reason) and 3 PeerUnhealthy Events",
        lambda: reads() >= 16 and len(events(env, "PeerUnhealthy")) >= 3,
        timeout=120,
    )
    grown = rss_mib(env.operator.pid) - base
    print(
        f"operator RSS {base:.0f} MiB -> +{grown:.0f} MiB after {reads()} reads, half of them 6 MB"
    )
    assert grown < 60, f"the operator grew by {grown:.0f} MiB"
    assert all(len(str(e["message"])) <= 1024 for e in events(env, "PeerUnhealthy"))
    # The healthy pair is untouched.
    assert env.status()["summary"]["pairs"].startswith("1/")
    assert env.workers["d0"].engine_id in {p["engine_id"] for p in p0.state()["peers"]}


def test_a_pod_claiming_a_connected_prefill_s_engine_id_is_refused_and_the_prefill_kept(
    env: Env,
) -> None:
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1})
    env.start_operator()
    for pod in ("p0", "d0"):
        env.wait(f"{pod}'s gate True", lambda pod=pod: gate(env, pod).get("status") == "True")
    p0 = env.workers["p0"]
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        hostile(
            env,
            "px",
            "prefill",
            "--engine-id",
            p0.engine_id,
            "--compat-hash",
            str(p0.state()["compat_hash"]),
            kv_gate=True,
        )
        line = env.wait(
            "the newcomer refused",
            lambda: next(
                (
                    e
                    for e in env.status().get("engines", [])
                    if e["pod"] == "px" and e["state"] == "Failed"
                ),
                None,
            ),
        )
        assert "held by pod p0" in line["message"], line
        told = env.wait(
            "a DuplicateEngineId Event naming both pods",
            lambda: events(env, "DuplicateEngineId"),
        )
        assert "p0" in str(told[0]["message"]) and "px" in str(told[0]["message"])
        # The holder keeps its id: a new decode is connected to it, and no gate dropped.
        env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
        env.wait("d1's gate True", lambda: gate(env, "d1").get("status") == "True")
        assert p0.engine_id in {p["engine_id"] for p in env.workers["d1"].state()["peers"]}
        env.wait(
            "p0 Connected in the status",
            lambda: any(
                e["pod"] == "p0" and e["state"] == "Connected" for e in env.status()["engines"]
            ),
        )
        assert not watch.drops(), watch.drops()
        assert gate(env, "px").get("status") != "True"


def test_made_up_peers_are_neither_engine_lines_nor_events(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("p1", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "2/2")
    compat = str(env.workers["p0"].state()["compat_hash"])
    hostile(
        env,
        "d9",
        "decode",
        "--engine-id",
        "D9-ghost-maker",
        "--compat-hash",
        compat,
        "--invent-peers",
        "1500",
    )
    line = env.wait(
        "the lying decode refused",
        lambda: next(
            (
                e
                for e in env.status().get("engines", [])
                if e["pod"] == "d9" and e["state"] == "Failed"
            ),
            None,
        ),
    )
    assert "1500 peers no pod of the topology has" in line["message"], line
    st = env.status()
    assert {e["pod"] for e in st["engines"]} == {"p0", "p1", "d0", "d9"}, st["engines"][:5]
    assert st.get("enginesOmitted", 0) == 0
    assert not [e for e in events(env, "EngineEvicted") if "ghost" in str(e["message"])]
    obj = get_json(env.cluster, "kvt", "llama", "-n", env.namespace)
    assert len(str(obj)) < 20_000, len(str(obj))
    assert env.operator_tail(400).count("WARNING") < 20


def test_one_unreachable_decode_costs_the_summary_its_own_line_only(env: Env) -> None:
    """A decode no prefill can add (its metadata cannot be fetched): on 7314fe4 the summary
    said `PREFILL 0/2` (a prefill counted only when connected to every partner). Now each
    role counts its available engines, and `availability.minAvailableDecode` makes Ready a
    minimum, with Degraded naming the decode left out."""
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("p1", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    compat = str(env.workers["p0"].state()["compat_hash"])
    hostile(env, "d9", "decode", "--engine-id", "D9-unreachable", "--compat-hash", compat)
    env.topology(availability={"minAvailableDecode": 1})
    env.start_operator()
    st = env.wait(
        "the summary",
        lambda: (s := env.status()).get("summary", {}).get("decode") == "1/2" and s,
    )
    assert st["summary"]["prefill"] == "2/2", st["summary"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("True", "EnginesAvailable")
    assert conds["Degraded"]["status"] == "True" and "d9" in conds["Degraded"]["message"]
