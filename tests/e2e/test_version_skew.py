"""A newer CRD and a newer operator's status, read by this operator on a real API server.

The CRD installed may be newer than the operator (upgraded first, or rolled back after):
fields and values this operator does not know reach it from the API server. It must keep
reconciling, keep the status it does understand (counters, engines), and say plainly when a
spec is one it cannot act on (an `InvalidSpec` condition and Event), never skip the topology
with only a log line or start the status afresh.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvtopo.drill import manifests
from kvtopo_operator.crd import crd_manifest
from tests.cluster.kube import apply
from tests.e2e.env import Env, peers, ready_status

pytestmark = pytest.mark.nixl


def newer_crd() -> dict[str, Any]:
    """Today's CRD plus what a later version might add: a spec field, a status field, a
    transfer mode this operator has no path for (and no rule refusing it)."""
    crd = copy.deepcopy(crd_manifest())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    spec["properties"]["futureField"] = {"type": "string"}
    transfer = spec["properties"]["transfer"]
    transfer.pop("x-kubernetes-validations", None)
    mode = transfer["properties"]["mode"]
    mode.pop("x-kubernetes-validations", None)
    mode["enum"] = sorted({*mode.get("enum", ["push"]), "stream"})
    schema["properties"]["status"]["properties"]["futureCounter"] = {"type": "integer"}
    return crd


@pytest.fixture
def skewed(env: Env) -> Iterator[Env]:
    apply(env.cluster, newer_crd())
    env.cluster.kubectl(
        "wait", "--for=condition=Established", "crd/kvtopologies.kvtopo.dev", "--timeout=30s"
    )
    yield env
    # The next test's fixture applies crds/kvtopology.yaml again (today's CRD).


def patch_status(env: Env, status: dict[str, Any]) -> None:
    env.cluster.kubectl(
        "patch",
        "kvt",
        "llama",
        "-n",
        env.namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def test_fields_of_a_newer_crd_and_operator_are_ignored_not_fatal(skewed: Env) -> None:
    env = skewed
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    body = manifests.topology(
        "llama", app="llama", namespace=env.namespace, pair_on=("version",)
    )  # kvtopo's own tooling refuses unknown fields; a newer client wrote this one
    body["spec"]["futureField"] = "set by a newer client"
    apply(env.cluster, body)
    # What a newer operator left in the status: a field and a failure type unknown here.
    patch_status(
        env,
        {"futureCounter": 3, "failures": {"counts": {"transfer_failed": 7, "gpu_oom": 2}}},
    )
    env.start_operator()
    st = env.wait(
        "connected despite the unknown fields",
        lambda: (s := env.status()) and ready_status(s) == "True" and s,
    )
    assert st["failures"]["counts"] == {"transfer_failed": 7, "gpu_oom": 2}, "kept, not reset"
    assert st["futureCounter"] == 3  # the operator's merge patch leaves it alone
    p0, d0 = env.workers["p0"], env.workers["d0"]
    assert peers(p0) == {d0.engine_id} and peers(d0) == {p0.engine_id}
    assert "ignoring fields this operator does not know: .spec.futureField" in (
        env.operator_tail(200)
    )


def test_a_spec_this_operator_cannot_read_is_an_invalid_spec_condition(skewed: Env) -> None:
    env = skewed
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology(transfer={"mode": "push"})
    env.start_operator()
    env.wait("connected", lambda: ready_status(env.status()) == "True")
    counts_before = env.status().get("failures", {})
    env.cluster.kubectl(
        "patch",
        "kvt",
        "llama",
        "-n",
        env.namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"transfer": {"mode": "stream"}}}),
    )
    st = env.wait(
        "InvalidSpec reported",
        lambda: (
            (s := env.status())
            and any(
                c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == "InvalidSpec"
                for c in s.get("conditions", [])
            )
            and s
        ),
    )
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert "spec.transfer.mode" in conditions["Degraded"]["message"], conditions["Degraded"]
    assert st["engines"], "the engines are kept, not forgotten"
    assert st.get("failures", {}) == counts_before

    def invalid_spec_event() -> str:
        # Events are posted off the reconcile path: shortly after the status says so.
        return env.cluster.kubectl(
            "get", "events", "-n", env.namespace, "--field-selector", "reason=InvalidSpec"
        ).stdout

    events = env.wait("the InvalidSpec Event", lambda: invalid_spec_event() or "")
    assert "spec.transfer.mode" in events, events
    # Nothing was undone meanwhile: the pair stays connected while the spec is unreadable.
    p0, d0 = env.workers["p0"], env.workers["d0"]
    assert peers(p0) == {d0.engine_id}
