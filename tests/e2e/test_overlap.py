"""Two KVTopologies selecting the same engine pods, end to end on a real API server (tier a)
with real `kvtopo-worker` processes (the environment: `tests.e2e.env`).

A pod belongs to at most one topology: the oldest that selects it (creationTimestamp, ties
by name). The younger one reports `Conflict=True` naming the pods and their owner, records
one Warning Event, and never touches the pods; once the older one is deleted the younger
takes them over."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from typing import Any

import pytest

from tests.cluster.kube import get_json
from tests.e2e.env import GRACE, Env, peers, ready_status
from tests.worker.workers import WorkerProcess

pytestmark = pytest.mark.nixl

OLDER, YOUNGER = "llama", "alpha"  # the younger's name sorts first: only the age decides


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == ctype), {})


def metric_sum(w: WorkerProcess, name: str, label: str = "") -> float:
    """The sum of a worker's counter `name` over its label sets (0 when never counted)."""
    text = urllib.request.urlopen(w.url + "/metrics", timeout=5).read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#") and label in line
    )


def conflict_events(env: Env, name: str) -> list[dict[str, Any]]:
    out = env.cluster.kubectl(
        "get",
        "events",
        "-n",
        env.namespace,
        "--field-selector",
        f"involvedObject.name={name},reason=Conflict",
        "-o",
        "json",
    ).stdout
    return json.loads(out)["items"]  # type: ignore[no-any-return]


def test_overlapping_topologies_the_older_owns_the_pods_and_the_younger_takes_over(
    env: Env,
) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.pod("d1", "decode", env.worker("decode"))
    env.topology(OLDER)
    time.sleep(1.1)  # creationTimestamp has a resolution of one second
    env.topology(YOUNGER)  # the same selectors: app=llama, both roles
    created = {
        n: get_json(env.cluster, "kvt", n, "-n", env.namespace)["metadata"]["creationTimestamp"]
        for n in (OLDER, YOUNGER)
    }
    assert created[OLDER] < created[YOUNGER], created
    # Both loops start at once (kopf's initial listing): the claim must hold from the start.
    env.start_operator()

    env.wait(
        "the older topology connects every pair",
        lambda: (s := env.status(OLDER)) and ready_status(s) == "True" and s,
    )
    young = env.wait(
        "the younger topology reports the conflict",
        lambda: (
            (s := env.status(YOUNGER)) and condition(s, "Conflict").get("status") == "True" and s
        ),
    )
    c = condition(young, "Conflict")
    assert c["reason"] == "PodsClaimedElsewhere"
    assert "d0, d1, p0" in c["message"] and f"KVTopology {OLDER}" in c["message"], c
    assert young["summary"] == {"prefill": "0/0", "decode": "0/0", "pairs": "0/0"}
    assert young.get("engines", []) == []
    assert condition(env.status(OLDER), "Conflict")["status"] == "False"
    env.wait("the younger's Conflict Event", lambda: conflict_events(env, YOUNGER))
    event = conflict_events(env, YOUNGER)[0]
    assert event["type"] == "Warning" and "d0, d1, p0" in event["message"], event

    ids = {name: w.engine_id for name, w in env.workers.items()}
    held = {
        "p0": {ids["d0"], ids["d1"]},
        "d0": {ids["p0"]},
        "d1": {ids["p0"]},
    }
    assert {name: peers(w) for name, w in env.workers.items()} == held
    added = metric_sum(env.workers["p0"], "kvtopo_worker_handshakes_total", 'result="added"')
    assert added == 2.0

    printed = env.cluster.kubectl("get", "kvt", "-n", env.namespace).stdout
    described = env.cluster.kubectl("describe", "kvt", YOUNGER, "-n", env.namespace).stdout
    print(f"\n$ kubectl get kvt -n {env.namespace}\n{printed}")
    print(f"$ kubectl describe kvt {YOUNGER} -n {env.namespace}\n{described}")
    assert "PodsClaimedElsewhere" in described and "Conflict" in described

    # No fight: nothing evicted, nothing added, through several eviction grace periods (a
    # younger topology that counted the older one's engines as gone would evict them after
    # one grace, and the older one would add them back).
    deadline = time.monotonic() + 3 * GRACE + 1
    while time.monotonic() < deadline:
        assert {name: peers(w) for name, w in env.workers.items()} == held
        time.sleep(0.25)
    for name, w in env.workers.items():
        assert metric_sum(w, "kvtopo_worker_evictions_total") == 0.0, name
    assert metric_sum(env.workers["p0"], "kvtopo_worker_handshakes_total", "added") == 2.0
    assert len(conflict_events(env, YOUNGER)) == 1, "one Event, on the transition"
    assert conflict_events(env, OLDER) == []

    # The older one deleted: the younger takes the pods over (already connected as it wants
    # them, so it has no handshake to make and nothing to evict).
    env.cluster.kubectl("delete", "kvt", OLDER, "-n", env.namespace, "--wait=true")
    taken = env.wait(
        "the younger topology takes over",
        lambda: (
            (s := env.status(YOUNGER))
            and condition(s, "Conflict").get("status") == "False"
            and ready_status(s) == "True"
            and s["summary"]["pairs"] == "2/2"
            and s
        ),
        timeout=GRACE + 20,
    )
    assert condition(taken, "Conflict")["reason"] == "NoConflict"
    assert {e["pod"] for e in taken["engines"]} == {"p0", "d0", "d1"}
    assert {name: peers(w) for name, w in env.workers.items()} == held
    for name, w in env.workers.items():
        assert metric_sum(w, "kvtopo_worker_evictions_total") == 0.0, name
    assert metric_sum(env.workers["p0"], "kvtopo_worker_handshakes_total", "added") == 2.0
    print(
        f"$ kubectl get kvt -n {env.namespace}   # after deleting {OLDER}\n"
        + env.cluster.kubectl("get", "kvt", "-n", env.namespace).stdout
    )


def compact_etcd(env: Env) -> None:
    """Compacts etcd's history up to now (its JSON gateway on loopback), as etcd does every
    few minutes: a watch resuming from an older version then gets "410 Gone"."""
    url = env.cluster.layout.etcd_url

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            got: dict[str, Any] = json.loads(resp.read())
            return got

    revision = post("/v3/kv/range", {"key": "YQ=="})["header"]["revision"]
    post("/v3/kv/compaction", {"revision": revision, "physical": True})


def test_a_topology_deleted_while_the_watch_was_away_does_not_keep_its_pods(env: Env) -> None:
    """The older topology is deleted while the operator is frozen and the API server
    restarts (its watch then resumes from a version the new API server no longer has, and
    no DELETED comes); a younger one with the same selectors is created meanwhile. On
    7314fe4 the younger said `Conflict=True ... belong to an older KVTopology ... (owned by
    KVTopology llama)` until the next relist (60 s). Now a loop that finds its pods claimed
    asks the API server for the claimant, and takes the pods over within a few rounds."""
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology(OLDER)
    env.start_operator()
    env.wait("connected", lambda: env.status(OLDER).get("summary", {}).get("pairs") == "1/1")
    assert env.operator is not None
    env.topology(YOUNGER)
    env.operator.send_signal(signal.SIGSTOP)
    try:
        # The frozen operator's watches end with the old API server (what was sent before
        # is in its socket buffers); the deletion happens on the new one, and the history
        # is compacted, so the watch cannot resume: "410 Gone", a relist.
        env.cluster.restart_apiserver()
        env.wait(  # the restarted API server serves the custom resources again
            "the older topology served again",
            lambda: (
                env.cluster.kubectl(
                    "get", "kvt", OLDER, "-n", env.namespace, check=False
                ).returncode
                == 0
            ),
        )
        env.cluster.kubectl(
            "delete", "kvt", OLDER, "-n", env.namespace, "--wait=false", check=False
        )
        env.wait(
            "the older topology gone",
            lambda: (
                env.cluster.kubectl(
                    "get", "kvt", OLDER, "-n", env.namespace, check=False
                ).returncode
                != 0
            ),
        )
        compact_etcd(env)
    finally:
        env.operator.send_signal(signal.SIGCONT)
    st = env.wait(
        "the younger topology owns the pods",
        lambda: (
            (s := env.status(YOUNGER)).get("summary", {}).get("pairs") == "1/1"
            and condition(s, "Conflict").get("status") == "False"
            and s
        ),
        timeout=25,
    )
    assert {e["pod"] for e in st["engines"]} == {"p0", "d0"}
