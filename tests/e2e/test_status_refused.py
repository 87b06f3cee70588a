"""A KVTopology CRD without the status subresource (an old or hand-edited one: Helm never
upgrades CRDs): every status write is answered 404. On 7314fe4 the operator retried every
0.2 s forever, with no log line, Event or condition. Now it backs off, logs the refusal
once, and says what is wrong in a `StatusWriteRefused` Event; once the CRD is right again
the status is written. Real API server (tier a), real workers."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.cluster.kube import get_json
from tests.e2e.env import Env
from tests.e2e.harness import ROOT

pytestmark = pytest.mark.nixl
CRD = "kvtopologies.kvtopo.dev"


def refusals(env: Env) -> list[dict[str, Any]]:
    got = get_json(env.cluster, "events", "-n", env.namespace)
    return [e for e in got.get("items") or [] if e.get("reason") == "StatusWriteRefused"]


def test_a_crd_without_the_status_subresource_is_said_once_and_backed_off(env: Env) -> None:
    env.pod("p0", "prefill", env.worker("prefill"))
    env.pod("d0", "decode", env.worker("decode"))
    env.topology()
    env.start_operator()
    env.wait("connected", lambda: env.status().get("summary", {}).get("pairs") == "1/1")
    crd = get_json(env.cluster, "crd", CRD)
    for version in crd["spec"]["versions"]:
        version.pop("subresources", None)
    stripped = {"apiVersion": crd["apiVersion"], "kind": crd["kind"], "metadata": {"name": CRD}}
    stripped["spec"] = crd["spec"]
    path = env.tmp / "crd-without-status.json"
    path.write_text(json.dumps(stripped))
    try:
        env.cluster.kubectl("apply", "-f", str(path))
        env.pod("d1", "decode", env.worker("decode"))  # the status must change
        told = env.wait("a StatusWriteRefused Event", lambda: refusals(env), timeout=30)
        message = str(told[0]["message"])
        assert "status subresource" in message and "kvtopology.yaml" in message, message
        # Backed off: a few tries in the next seconds, not one every 0.2 s; said once.
        time.sleep(4)  # the absence of retries is measured over a span of time
        lines = [
            line
            for line in env.operator_tail(400).splitlines()
            if "the status write failed" in line and "WARNING" in line
        ]
        assert len(lines) == 1, lines
        assert len(refusals(env)) == 1
    finally:
        env.cluster.kubectl("apply", "-f", str(ROOT / "crds" / "kvtopology.yaml"))
    env.wait(
        "the status written again once the CRD is right",
        lambda: env.status().get("summary", {}).get("pairs") == "2/2",
        timeout=60,
    )
