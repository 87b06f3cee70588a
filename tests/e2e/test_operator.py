"""The operator end to end on a real API server (tier a) with real `kvtopo-worker` processes
(the environment: `tests.e2e.env`)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvtopo import launch
from tests.e2e.env import GRACE, Env, peers, ready_status
from tests.worker.workers import WorkerProcess

pytestmark = pytest.mark.nixl


def test_pairs_connect_and_a_deleted_decode_is_evicted(env: Env) -> None:
    for i in range(2):
        env.pod(f"p{i}", "prefill", env.worker("prefill"))
    for i in range(3):
        env.pod(f"d{i}", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    st = env.wait(
        "Ready with 6/6 pairs",
        lambda: (
            (s := env.status())
            and ready_status(s) == "True"
            and s["summary"]["pairs"] == "6/6"
            and s
        ),
    )
    assert st["summary"] == {"prefill": "2/2", "decode": "3/3", "pairs": "6/6"}
    ids = {name: w.engine_id for name, w in env.workers.items()}
    decodes = {ids[f"d{i}"] for i in range(3)}
    prefills = {ids[f"p{i}"] for i in range(2)}
    for name, w in env.workers.items():
        assert peers(w) == (decodes if name.startswith("p") else prefills), name
    printed = env.cluster.kubectl("get", "kvt", "-n", env.namespace).stdout
    assert "6/6" in printed and "True" in printed
    described = env.cluster.kubectl("describe", "kvt", "llama", "-n", env.namespace).stdout
    assert "AllPairsConnected" in described

    gone = ids["d2"]
    t0 = time.monotonic()
    env.delete_pod("d2")
    env.wait(
        "d2 evicted from both prefill workers",
        lambda: all(gone not in peers(env.workers[p]) for p in ("p0", "p1")),
        timeout=GRACE + 10,
    )
    elapsed = time.monotonic() - t0
    assert elapsed <= GRACE + 1, f"eviction took {elapsed:.2f}s (grace {GRACE}s)"
    st = env.wait(
        "status shows d2 evicted",
        lambda: (
            (s := env.status())
            and any(e["engineId"] == gone and e["state"] == "Evicted" for e in s["engines"])
            and s
        ),
    )
    assert st["summary"]["pairs"] == "4/4"
    env.wait(
        "EngineEvicted event",
        lambda: (
            "EngineEvicted"
            in env.cluster.kubectl(
                "get",
                "events",
                "-n",
                env.namespace,
                "--field-selector",
                "involvedObject.name=llama",
            ).stdout
        ),
    )
    described = env.cluster.kubectl("describe", "kvt", "llama", "-n", env.namespace).stdout
    assert "Conditions:" in described and "Events:" in described
    assert "EngineEvicted" in described, described[-1500:]


def test_restarted_worker_is_a_new_engine(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    old, new = env.restart("d0", env.worker("decode"))  # a fresh engine id
    env.wait(
        "new engine connected, old one evicted",
        lambda: (
            peers(env.workers["p0"]) == {new.engine_id}
            and peers(new) == {env.workers["p0"].engine_id}
        ),
        timeout=GRACE + 20,
    )
    st = env.wait(
        "status converged", lambda: (s := env.status()) and ready_status(s) == "True" and s
    )
    states = {e["engineId"]: e["state"] for e in st["engines"]}
    assert states[new.engine_id] == "Connected"
    assert states.get(old.engine_id) in ("Evicted", "Draining", None)


def held_incarnation(holder: WorkerProcess, engine_id: str) -> str:
    """The incarnation of `engine_id` whose agents `holder` holds ("" when it holds none)."""
    return next(
        (p["incarnation"] for p in holder.state()["peers"] if p["engine_id"] == engine_id), ""
    )


def test_restart_under_the_same_engine_id_replaces_the_old_agent(env: Env) -> None:
    """A container restart of an engine that pins its engine id: same pod, same IP, same
    engine id, a new process (incarnation). Its peer must drop the dead agent and add the
    new one, with no manual action, and transfers must flow again."""
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode", "--engine-id", "decode-pinned"))
    # A grace far longer than the test: the old agent must go because the incarnation
    # changed, not because the engine was unreachable for a while.
    env.topology(eviction={"graceSeconds": 600})
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    p0 = env.workers["p0"]
    old_inc = env.workers["d0"].state()["incarnation"]
    assert held_incarnation(p0, "decode-pinned") == old_inc
    old_agents = next(p["agents"] for p in p0.state()["peers"])
    old, new = env.restart("d0", env.worker("decode", "--engine-id", "decode-pinned"))
    new_inc = new.state()["incarnation"]
    assert new.engine_id == old.engine_id == "decode-pinned" and new_inc != old_inc
    env.wait(
        "the prefill holds the new incarnation's agent",
        lambda: held_incarnation(p0, "decode-pinned") == new_inc,
        timeout=GRACE + 20,
    )
    new_agents = next(p["agents"] for p in p0.state()["peers"])
    assert set(new_agents.values()).isdisjoint(old_agents.values()), (old_agents, new_agents)
    env.wait("the new decode holds the prefill", lambda: peers(new) == {p0.engine_id})
    # KV moves to the new incarnation: a request is pushed, verified and completed.
    assert p0.submit("after-restart", new, 2) == 202
    assert new.submit("after-restart", p0, 2) == 202
    done = env.wait(
        "the request completes on the restarted engine",
        lambda: next((o for o in new.drain() if o["request_id"] == "after-restart"), None),
    )
    assert done["status"] == "done", done
    st = env.wait(
        "status converged", lambda: (s := env.status()) and ready_status(s) == "True" and s
    )
    assert {e["engineId"]: e["state"] for e in st["engines"]}["decode-pinned"] == "Connected"


def test_registration_failure_reaches_status_within_10s(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    d0 = env.workers["d0"]
    assert d0.submit("doomed-1", env.workers["p0"], 1) == 202  # fine: P knows it
    status, _ = d0.call(
        "POST",
        "/v1/requests",
        {"request_id": "doomed-2", "peer_engine_id": "no-such-engine", "num_blocks": 1},
    )
    assert status == 202
    t0 = time.monotonic()
    st = env.wait(
        "failure counted",
        lambda: (
            (s := env.status())
            and s.get("failures", {}).get("counts", {}).get("push_reg_notif_failed")
            and s
        ),
        timeout=10,
    )
    assert time.monotonic() - t0 <= 10
    assert st["failures"]["counts"]["push_reg_notif_failed"] == 1
    last = st["failures"]["last"]
    assert last["type"] == "push_reg_notif_failed" and last["requestId"] == "doomed-2"
    assert last["pod"] == "d0"


def test_incompatible_engines_are_reported_never_connected(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill", "--model-id", "llama-8b"))
    env.pod("d0", "decode", env.worker("decode", "--model-id", "llama-70b"))
    env.topology()
    env.start_operator()
    st = env.wait(
        "Incompatible",
        lambda: (
            (s := env.status())
            and any(e["state"] == "Incompatible" for e in s.get("engines", []))
            and s
        ),
    )
    assert {e["state"] for e in st["engines"]} == {"Incompatible"}
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Incompatible")
    assert peers(env.workers["p0"]) == set() and peers(env.workers["d0"]) == set()


def test_operator_killed_and_restarted_loses_nothing(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.pod("d1", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "2/2")
    d0 = env.workers["d0"]
    d0.call("POST", "/v1/requests", {"request_id": "x", "peer_engine_id": "nope", "num_blocks": 1})
    env.wait(
        "counted",
        lambda: (
            env.status().get("failures", {}).get("counts", {}).get("push_reg_notif_failed") == 1
        ),
    )
    env.kill_operator()
    # Churn while the operator is down: one decode goes, another arrives.
    gone = env.workers["d1"].engine_id
    env.delete_pod("d1")
    env.pod("d2", "decode", env.worker("decode"))
    env.start_operator()
    st = env.wait(
        "converged after restart",
        lambda: (
            (s := env.status())
            and ready_status(s) == "True"
            and s["summary"]["pairs"] == "2/2"
            and gone not in peers(env.workers["p0"])
            and s
        ),
        timeout=GRACE + 30,
    )
    assert st["failures"]["counts"]["push_reg_notif_failed"] == 1, "counters kept, not doubled"
    # No peer was connected twice: each worker added each peer once.
    p0 = env.workers["p0"]
    added = [
        line
        for line in _metrics(p0).splitlines()
        if line.startswith('kvtopo_worker_handshakes_total{result="added"}')
    ]
    assert added and float(added[0].split()[-1]) == 3.0  # d0, d1, d2: once each


def _metrics(w: WorkerProcess) -> str:
    import urllib.request

    return urllib.request.urlopen(w.url + "/metrics", timeout=5).read().decode()


def test_operator_help_mentions_scope() -> None:
    out = subprocess.run(
        launch.operator_command(["--help"]),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 0 and "--namespace" in out.stdout and "--worker-key-file" in out.stdout


def test_deleting_a_topology_leaves_its_engines_connected(env: Env) -> None:
    """The documented behaviour (docs/install.md, "Deleting a KVTopology"): the operator
    stops managing the engines and leaves their connections as they are; engines that go
    afterwards are no longer evicted by kvtopo (their workers' idle TTL is the backstop)."""
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.pod("d1", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "2/2")
    p0 = env.workers["p0"]
    env.cluster.kubectl("delete", "kvt", "llama", "-n", env.namespace, "--wait=true")
    gone = env.workers["d1"].engine_id
    env.delete_pod("d1")
    # The operator notices the deletion (its log) and from then on acts on nothing.
    env.wait(
        "the operator forgot the topology",
        lambda: f"{env.namespace}/llama: deleted" in env.operator_tail(200),
    )
    # Absence of an action has no event to wait on: poll the real state through the
    # deleted engine's grace and well beyond; it must stay held all along.
    held = {env.workers["d0"].engine_id, gone}
    deadline = time.monotonic() + GRACE + 4
    while time.monotonic() < deadline:
        assert peers(p0) == held, "nothing evicted, nothing added after the deletion"
        time.sleep(0.25)
