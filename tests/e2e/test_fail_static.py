"""The operator is fail-static: when it stops, is replaced, loses its lease or cannot reach
the API server, nothing it controls changes (docs/install.md, "While the operator is down").

Real API server (tier a), real `kvtopo-worker` processes, the operator as its own process(es).
Every gate change of the namespace's pods is recorded by a watch (`GateWatch`); a gate of a
connected engine that turns False is a drop, and there must be none. Each fault is made with
SIGTERM (the stop path runs: a `helm upgrade`, a node drain) and with SIGKILL (it does not).

On 7314fe4 a SIGTERM (or a lease lost to a stall or a pause) made every gated pod
`False/NotSelected` within a fraction of a second: `Reconciler.cancel_all` read "my loops
stop" as "the topology was deleted" and un-gated every pod.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest

from kvtopo.drill.gates import GateWatch
from kvtopo_operator.kube import ClusterApi
from tests.e2e.env import GRACE, Env, peers
from tests.e2e.replicas import Replica, lease_holder, start_replica
from tests.e2e.test_gate import gate

pytestmark = pytest.mark.nixl

# A short lease, so a lost one is lost within seconds (client-go's ratios).
LEASE_S, RENEW_S, RETRY_S = 4, 2.5, 0.5
SIGNALS = [signal.SIGTERM, signal.SIGKILL]
ENGINES = ("p0", "d0", "d1")


def connected(env: Env) -> None:
    """Gated engines p0, d0, d1 (one prefill, two decodes) and their topology."""
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1})


def all_gates_true(env: Env, names: tuple[str, ...] = ENGINES) -> None:
    for pod in names:
        env.wait(f"{pod}'s gate True", lambda pod=pod: gate(env, pod).get("status") == "True")
    env.wait("every pair connected", lambda: env.status().get("summary", {}).get("pairs") == "2/2")


def held(env: Env, names: tuple[str, ...] = ENGINES) -> dict[str, set[str]]:
    return {n: peers(env.workers[n]) for n in names}


def unchanged_for(env: Env, watch: GateWatch, before: dict[str, set[str]], seconds: float) -> None:
    """Nothing the operator controls changes for `seconds`: every worker holds the peers it
    held and every gate stays True. (An absence has no event to wait on: the real state is
    polled for the whole time.)"""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert held(env, tuple(before)) == before, "a peer was added or evicted"
        assert not watch.drops(), f"gates dropped: {watch.drops()}"
        time.sleep(0.25)


def new_decode_connected(env: Env, name: str) -> None:
    """A new decode is connected and its gate True: an operator is acting again."""
    env.pod(name, "decode", env.worker("decode"), kv_gate=True)
    env.wait(f"{name}'s gate True", lambda: gate(env, name).get("status") == "True", timeout=60)


def no_drops(watch: GateWatch) -> None:
    drops = watch.drops()
    assert not drops, "gates of connected engines dropped:\n" + "\n".join(
        f"  {after.pod}: True -> False ({after.reason}: {after.message})" for _, after in drops
    )
    for pod in ENGINES:
        assert watch.gates().get(pod) == "True", watch.history(pod)


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_an_operator_that_stops_and_starts_again_changes_no_gate_or_peer(
    env: Env, sig: signal.Signals
) -> None:
    connected(env)
    env.start_operator()
    all_gates_true(env)
    before = held(env)
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        assert env.operator is not None
        env.operator.send_signal(sig)
        env.operator.wait(30)
        # Down: nothing changes, through a gone engine's grace and beyond.
        unchanged_for(env, watch, before, GRACE + 2)
        env.start_operator()
        new_decode_connected(env, "d2")
        no_drops(watch)


def replicas(env: Env) -> tuple[Replica, Replica]:
    """Two replicas; returns (leader, standby) once one holds the Lease and both serve."""
    a = start_replica(
        env.cluster,
        env.namespace,
        env.tmp,
        env.token_file,
        "op-a",
        lease_s=LEASE_S,
        renew_s=RENEW_S,
        retry_s=RETRY_S,
    )
    env.wait("op-a holds the Lease", lambda: lease_holder(env.cluster, env.namespace) == "op-a")
    b = start_replica(
        env.cluster,
        env.namespace,
        env.tmp,
        env.token_file,
        "op-b",
        lease_s=LEASE_S,
        renew_s=RENEW_S,
        retry_s=RETRY_S,
    )
    env.replicas = [a, b]  # stopped by the fixture
    env.wait("both replicas serving, op-a leading", lambda: (a.leading(), b.leading()) == (1, 0))
    return a, b


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_leader_replaced_by_its_standby_changes_no_gate_or_peer(
    env: Env, sig: signal.Signals
) -> None:
    """What a Deployment's rolling update (`helm upgrade`) does: the leader is stopped while
    a warm standby runs; the standby takes over and acts, and no gate or peer changed."""
    connected(env)
    leader, standby = replicas(env)
    all_gates_true(env)
    before = held(env)
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        leader.proc.send_signal(sig)
        leader.proc.wait(30)
        env.wait(
            "the standby leads",
            lambda: standby.leading() == 1.0,
            timeout=LEASE_S + 10,
        )
        unchanged_for(env, watch, before, 2)
        new_decode_connected(env, "d2")
        no_drops(watch)
    text = leader.log.read_text(errors="replace")
    assert "Traceback" not in text, leader.tail(60)


def test_a_leader_paused_past_its_lease_writes_nothing_when_it_resumes(env: Env) -> None:
    """A leader frozen (SIGSTOP) past its lease while the standby takes over and acts (an
    engine goes and is evicted) writes nothing once it runs again: every write is fenced on
    a lease renewed within its renew deadline."""
    connected(env)
    leader, standby = replicas(env)
    all_gates_true(env)
    writes = leader.writes()
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        leader.proc.send_signal(signal.SIGSTOP)
        try:
            env.wait("the standby leads", lambda: standby.leading() == 1.0, timeout=LEASE_S + 10)
            gone = env.workers["d1"].engine_id
            env.delete_pod("d1")
            env.wait(
                "d1 evicted by the new leader",
                lambda: gone not in peers(env.workers["p0"]),
                timeout=GRACE + 15,
            )
        finally:
            leader.proc.send_signal(signal.SIGCONT)
        env.wait("the old leader knows it does not lead", lambda: leader.leading() == 0.0)
        before = held(env, ("p0", "d0"))
        unchanged_for(env, watch, before, 2)
        assert leader.writes() == writes, leader.tail(60)
        new_decode_connected(env, "d2")
        drops = watch.drops(pods={"p0", "d0", "d2"})
        assert not drops, drops


def test_an_api_server_stalled_past_the_renew_deadline_changes_no_gate_or_peer(env: Env) -> None:
    """kube-apiserver frozen (SIGSTOP) for twice the renew deadline: the leader loses its
    lease and writes nothing; once the API server runs again it leads again and acts,
    and no gate or peer changed."""
    connected(env)
    leader, _ = replicas(env)
    all_gates_true(env)
    before = held(env)
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        env.cluster.pause_component("kube-apiserver", 2 * RENEW_S)
        unchanged_for(env, watch, before, 2)
        new_decode_connected(env, "d2")
        no_drops(watch)
    assert "stopped leading" in leader.log.read_text(errors="replace") + "".join(
        r.log.read_text(errors="replace") for r in env.replicas
    )


SKEW_S = 90
SKEW_GRACE = 10


def test_a_replica_whose_clock_is_90s_ahead_leads_as_any_other_and_misleads_no_timer(
    env: Env,
) -> None:
    """Replica op-a's wall clock is 90 s ahead (faketime). On 7314fe4 it signed with its
    own clock: every worker answered 401 (a 60 s window), every engine went Failed and
    every gate False, and no message said "clock"; and a `Draining since` it wrote in its
    time made the next leader wait 90 s more before evicting. Now it signs against each
    worker's clock (the challenge carries it), writes the API server's time, and a time
    from the future lengthens no timer."""
    env.pod("p0", "prefill", env.worker("prefill"), kv_gate=True)
    env.pod("d0", "decode", env.worker("decode"), kv_gate=True)
    env.pod("d1", "decode", env.worker("decode"), kv_gate=True)
    env.topology(readinessGate={"minConnectedPartners": 1}, eviction={"graceSeconds": SKEW_GRACE})
    ahead = start_replica(
        env.cluster,
        env.namespace,
        env.tmp,
        env.token_file,
        "op-a",
        lease_s=LEASE_S,
        renew_s=RENEW_S,
        retry_s=RETRY_S,
        clock_ahead_s=SKEW_S,
    )
    env.replicas.append(ahead)
    env.wait("op-a holds the Lease", lambda: lease_holder(env.cluster, env.namespace) == "op-a")
    true = start_replica(
        env.cluster,
        env.namespace,
        env.tmp,
        env.token_file,
        "op-b",
        lease_s=LEASE_S,
        renew_s=RENEW_S,
        retry_s=RETRY_S,
    )
    env.replicas.append(true)
    all_gates_true(env)  # 7314fe4: never (every call 401)
    assert "clock skew" in ahead.log.read_text(errors="replace"), ahead.tail()
    with GateWatch(ClusterApi(env.cluster.kubeconfig), env.namespace) as watch:
        gone = env.workers["d1"].engine_id
        deleted = time.time()
        env.delete_pod("d1")
        line = env.wait(
            "op-a writes d1 Draining",
            lambda: next(
                (e for e in env.status().get("engines", []) if e["state"] == "Draining"), None
            ),
        )
        since = datetime.fromisoformat(line["since"].replace("Z", "+00:00")).timestamp()
        assert abs(since - deleted) < 5, f"since {line['since']}: {since - deleted:+.1f} s"
        ahead.proc.send_signal(signal.SIGKILL)
        ahead.proc.wait(10)
        env.wait("op-b leads", lambda: true.leading() == 1.0, timeout=LEASE_S + 10)
        env.wait(
            "d1 evicted within its grace (and the take-over), not 90 s later",
            lambda: gone not in peers(env.workers["p0"]),
            timeout=SKEW_GRACE + LEASE_S + 10,
        )
        took = time.time() - deleted
        assert took < SKEW_GRACE + LEASE_S + 10, took
        assert not watch.drops(pods={"p0", "d0"}), watch.drops()
