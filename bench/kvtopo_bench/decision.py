"""The operator's decision cost per round, on its own: `kvtopo_operator.logic.evaluate` over
a topology of `prefill` x `decode` engines that are all connected (the steady state), as
the operator runs it every round, with no cluster and no workers.

Owns the micro-benchmark that `kvtopo bench operator` reports as `decision`: per round,
side by side in one run,

- `cold_round_s`: the first round (nothing remembered: the price of every pair);
- `steady_round_s`: a round in which nothing changed (the views are the objects the
  previous round saw, as the operator's gather keeps them), median of `rounds`;
- `steady_no_memo_round_s`: the same round with the memo of the previous round dropped
  (what every round cost before it);
- `one_replaced_round_s`: a round after one decode engine was replaced and every prefill
  connected to its successor (every prefill's view is new, derived from the last round's
  by the operator's calls: the memo patches each prefill's result for the two engines);
- `one_replaced_read_round_s`: the same round with every prefill's view read anew from its
  worker (no lineage: each prefill's result computed whole).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from kvtopo_operator.api import KVTopologySpec, KVTopologyStatus
from kvtopo_operator.logic import evaluate
from kvtopo_operator.model import Observed, PodView, RoundCache, WorkerView

SPEC = KVTopologySpec.model_validate(
    {
        "prefill": {"selector": {"matchLabels": {"app": "m", "kvtopo.dev/role": "prefill"}}},
        "decode": {"selector": {"matchLabels": {"app": "m", "kvtopo.dev/role": "decode"}}},
        "pairing": {"matchLabels": ["version"]},
    }
)
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _engine(role: str, i: int, peers: dict[str, str]) -> tuple[PodView, WorkerView]:
    name = f"{role[0]}{i}"
    pod = PodView(
        name=name,
        role=role,
        labels={"app": "m", "version": "v1", "kvtopo.dev/role": role},
        ready=True,
        deleting=False,
        endpoint=f"10.0.{i // 250}.{i % 250}:8975",
        uid=f"uid-{name}",
    )
    worker = WorkerView(
        engine_id=name.upper(),
        role=role,
        compat_hash="h",
        peers=frozenset(peers),
        incarnation=f"inc-{name}",
        pod_uid=pod.uid,
        peer_incarnations=peers,
    )
    return pod, worker


def fleet(prefill: int, decode: int) -> tuple[list[PodView], dict[str, WorkerView]]:
    """Every prefill connected with every decode."""
    p_inc = {f"P{i}": f"inc-p{i}" for i in range(prefill)}
    d_inc = {f"D{i}": f"inc-d{i}" for i in range(decode)}
    pods: list[PodView] = []
    workers: dict[str, WorkerView] = {}
    for role, n, peers in (("prefill", prefill, d_inc), ("decode", decode, p_inc)):
        for i in range(n):
            pod, worker = _engine(role, i, peers)
            pods.append(pod)
            workers[pod.name] = worker
    return pods, workers


def _round(obs: Observed, now: datetime) -> tuple[float, Any]:
    t = time.perf_counter()
    plan = evaluate(obs, now)
    return time.perf_counter() - t, plan


def measure(prefill: int = 500, decode: int = 1500, rounds: int = 5) -> dict[str, Any]:
    pods, workers = fleet(prefill, decode)
    obs = Observed(1, SPEC, tuple(pods), workers, KVTopologyStatus())
    cold, plan = _round(obs, T0)
    assert plan.pairs_connected == plan.pairs_expected == prefill * decode, "not a full mesh"
    steady, no_memo = [], []
    for r in range(rounds):
        now = T0 + timedelta(seconds=r + 1)
        obs = dataclasses.replace(obs, previous=plan.status, memory=plan.memory)
        took, plan = _round(obs, now)
        steady.append(took)
        # The same round without last round's memo, right after (the same machine moment).
        forgetful = dataclasses.replace(plan.memory, cache=RoundCache())
        took, _ = _round(dataclasses.replace(obs, memory=forgetful), now)
        no_memo.append(took)
    # One decode replaced (a new pod and engine), every prefill now holding it instead: the
    # prefills' views as the operator makes them from its calls' answers (derived from the
    # views the last round saw), and, side by side, as read anew from every worker.
    gone = f"d{decode - 1}"
    new_pod, new_worker = _engine("decode", decode, {f"P{i}": f"inc-p{i}" for i in range(prefill)})
    replaced = {n: w for n, w in workers.items() if n != gone}
    read = dict(replaced)
    replaced[new_pod.name] = read[new_pod.name] = new_worker
    for name, w in list(replaced.items()):
        if w.role == "prefill":
            replaced[name] = w.answered(
                {new_worker.engine_id: new_worker.incarnation}, {gone.upper(): "evicted"}
            )
            read[name] = dataclasses.replace(
                replaced[name], peer_incarnations=dict(replaced[name].peer_incarnations)
            )
    new_pods = (*(p for p in pods if p.name != gone), new_pod)
    obs = dataclasses.replace(
        obs, pods=new_pods, workers=replaced, previous=plan.status, memory=plan.memory
    )
    twin = RoundCache()  # the same memo, for the round that must not use up the other's
    twin.groups, twin.results = dict(plan.memory.cache.groups), dict(plan.memory.cache.results)
    as_read = dataclasses.replace(
        obs, workers=read, memory=dataclasses.replace(plan.memory, cache=twin)
    )
    now = T0 + timedelta(seconds=rounds + 1)
    one_replaced_read, _ = _round(as_read, now)
    one_replaced, plan = _round(obs, now)
    assert plan.pairs_connected == plan.pairs_expected
    # A compatibility rollout under way: a tenth more of each role, new engines of a new
    # hash, holding nothing yet (pairs across hashes are no pairs: one round once formatted
    # a message per such pair, 150,000 here).
    mixed = dict(replaced)
    mixed_pods = list(new_pods)
    for role, n, first in (
        ("prefill", max(1, prefill // 10), prefill),
        ("decode", max(1, decode // 10), decode),
    ):
        for i in range(first + 1, first + 1 + n):
            pod, worker = _engine(role, i, {})
            mixed_pods.append(pod)
            mixed[pod.name] = dataclasses.replace(worker, compat_hash="h2")
    obs = dataclasses.replace(
        obs, pods=tuple(mixed_pods), workers=mixed, previous=plan.status, memory=plan.memory
    )
    compat_rollout, plan = _round(obs, T0 + timedelta(seconds=rounds + 2))
    assert not any(e.state == "Incompatible" for e in plan.status.engines), "none is lonely"
    return {
        "size": f"{prefill}x{decode}",
        "pairs": prefill * decode,
        "cold_round_s": round(cold, 4),
        "steady_round_s": round(statistics.median(steady), 4),
        "steady_no_memo_round_s": round(statistics.median(no_memo), 4),
        "one_replaced_round_s": round(one_replaced, 4),
        "one_replaced_read_round_s": round(one_replaced_read, 4),
        "compat_rollout_round_s": round(compat_rollout, 4),
        "rounds": rounds,
    }
