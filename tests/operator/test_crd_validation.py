"""The KVTopology CRD against a real kube-apiserver (tier a): it is accepted (structural,
CEL cost within limits) and Established, the examples apply and round-trip through the
pydantic models, printer columns and server-side defaults work, boundary values are
accepted, and invalid specs are refused with a message naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.local_cluster import LocalCluster
from kvtopo_operator.api import (
    ROLE_LABEL,
    Condition,
    ConditionType,
    EngineState,
    EngineStatus,
    Failures,
    KVTopology,
    KVTopologySpec,
    KVTopologyStatus,
    LastFailure,
    Reason,
    Summary,
    dump,
)
from kvtopo_operator.crd import CRD_NAME
from tests.cluster.kube import condition, create_namespace, get_json

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

PREFILL = {"matchLabels": {"app": "llama", ROLE_LABEL: "prefill"}}
DECODE = {"matchLabels": {"app": "llama", ROLE_LABEL: "decode"}}
MINIMAL: dict[str, Any] = {"prefill": {"selector": PREFILL}, "decode": {"selector": DECODE}}


def spec(prefill: Any = PREFILL, decode: Any = DECODE, **fields: Any) -> dict[str, Any]:
    """A valid spec with the given selectors and top-level fields."""
    out: dict[str, Any] = {
        "prefill": {"selector": copy.deepcopy(prefill)},
        "decode": {"selector": copy.deepcopy(decode)},
    }
    out.update(copy.deepcopy(fields))
    return out


def without(key: str) -> dict[str, Any]:
    out = spec()
    del out[key]
    return out


def labels(**extra: str) -> dict[str, Any]:
    return {"matchLabels": {"app": "llama", ROLE_LABEL: "decode", **extra}}


def exprs(*requirements: dict[str, Any]) -> dict[str, Any]:
    return {"matchLabels": {"app": "llama"}, "matchExpressions": list(requirements)}


def kvtopology(namespace: str, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "kvtopo.dev/v1alpha1",
        "kind": "KVTopology",
        "metadata": {"name": name, "namespace": namespace},
    }
    if body is not None:
        obj["spec"] = body
    return obj


LONG_PREFIX = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 253: the most allowed
assert len(LONG_PREFIX) == 253


@pytest.fixture(scope="module")
def kvt_crd(cluster_a: LocalCluster) -> str:
    """The checked-in CRD, applied as users do, Established and served."""
    cluster_a.kubectl("apply", "-f", str(REPO / "crds"))
    cluster_a.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    wait_until(
        lambda: cluster_a.kubectl("get", "kvt", "-A", check=False).returncode == 0,
        30,
        "kvtopologies to be served",
    )
    return CRD_NAME


@pytest.fixture(scope="module")
def namespace(cluster_a: LocalCluster, kvt_crd: str) -> str:
    return create_namespace(cluster_a, "kvt-crd", wait_for_sa=False)


def create(cluster: LocalCluster, obj: dict[str, Any], *, dry_run: bool = True) -> tuple[int, str]:
    args = ["create", "--validate=strict", "-f", "-"]
    if dry_run:
        args.append("--dry-run=server")
    done = cluster.kubectl(*args, input=json.dumps(obj), check=False)
    return done.returncode, done.stderr


def test_crd_is_established_with_a_structural_schema(cluster_a: LocalCluster, kvt_crd: str) -> None:
    crd = get_json(cluster_a, "crd", kvt_crd)
    for kind in ("Established", "NamesAccepted"):
        found = condition(crd, kind)
        assert found is not None
        assert found["status"] == "True", found
    assert condition(crd, "NonStructuralSchema") is None
    assert crd["spec"]["names"]["shortNames"] == ["kvt"]


def test_examples_apply_and_round_trip(cluster_a: LocalCluster, namespace: str) -> None:
    applied = cluster_a.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES)).stdout
    assert "kvtopology.kvtopo.dev/llama-pd created" in applied
    assert "deployment.apps/llama-prefill created" in applied
    assert "deployment.apps/llama-decode created" in applied
    example = yaml.safe_load((EXAMPLES / "kvtopology.yaml").read_text())
    stored = get_json(cluster_a, "kvt", "llama-pd", "-n", namespace)
    model = KVTopology.model_validate(stored)
    assert model.spec == KVTopologySpec.model_validate(example["spec"])
    assert model.spec.pairing.match_labels == ["app.kubernetes.io/version"]
    # Applying again changes nothing: what the server stored is what the file says.
    again = cluster_a.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES)).stdout
    assert "kvtopology.kvtopo.dev/llama-pd unchanged" in again


def test_the_vllm_example_applies(cluster_a: LocalCluster, namespace: str) -> None:
    """examples/vllm (docs/vllm.md): a KVTopology and vLLM Deployments that load
    KVTopoConnector; the API server accepts all of it."""
    applied = cluster_a.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "vllm")).stdout
    assert "kvtopology.kvtopo.dev/qwen-pd created" in applied
    assert "deployment.apps/qwen-prefill created" in applied
    assert "deployment.apps/qwen-decode created" in applied


def test_examples_server_side_apply(cluster_a: LocalCluster, kvt_crd: str) -> None:
    ns = create_namespace(cluster_a, "kvt-crd-ssa", wait_for_sa=False)
    out = cluster_a.kubectl(
        "apply", "--server-side", "--field-manager=kvtopo-test", "-n", ns, "-f", str(EXAMPLES)
    ).stdout
    assert "kvtopology.kvtopo.dev/llama-pd serverside-applied" in out
    stored = get_json(cluster_a, "kvt", "llama-pd", "-n", ns)
    assert stored["spec"]["eviction"]["graceSeconds"] == 10
    assert KVTopology.model_validate(stored).spec.transfer.backends == ["UCX"]


def test_every_example_kvtopology_is_accepted(cluster_a: LocalCluster, namespace: str) -> None:
    docs = [
        doc
        for path in sorted(EXAMPLES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "KVTopology"
    ]
    assert docs
    for doc in docs:
        KVTopology.model_validate(doc)
        obj = copy.deepcopy(doc)
        obj["metadata"] = {"name": f"{doc['metadata']['name']}-copy", "namespace": namespace}
        rc, stderr = create(cluster_a, obj)
        assert rc == 0, stderr


def test_printer_columns_show_spec_and_status(cluster_a: LocalCluster, kvt_crd: str) -> None:
    ns = create_namespace(cluster_a, "kvt-crd-cols", wait_for_sa=False)
    rc, stderr = create(cluster_a, kvtopology(ns, "cols", spec()), dry_run=False)
    assert rc == 0, stderr
    lines = cluster_a.kubectl("get", "kvt", "-n", ns).stdout.splitlines()
    assert lines[0].split() == ["NAME", "MODE", "PREFILL", "DECODE", "PAIRS", "READY", "AGE"]
    assert lines[1].split()[:2] == ["cols", "push"]

    now = "2026-01-02T03:04:05Z"
    status = KVTopologyStatus(
        observed_generation=1,
        conditions=[
            Condition(
                type=ConditionType.READY,
                status="True",
                reason=Reason.ALL_PAIRS_CONNECTED,
                message="8/8 pairs connected",
                last_transition_time=now,
                observed_generation=1,
            ),
            Condition(
                type=ConditionType.DEGRADED,
                status="False",
                reason=Reason.HEALTHY,
                last_transition_time=now,
                observed_generation=1,
            ),
        ],
        summary=Summary(prefill="2/2", decode="4/4", pairs="8/8"),
        engines=[
            EngineStatus(
                pod="llama-prefill-0",
                role="prefill",
                engine_id="e-1",
                endpoint="10.0.0.1:8975",
                state=EngineState.CONNECTED,
                peers=4,
                since=now,
                failures_seen={"handshake_failed": 1},
            )
        ],
        failures=Failures(
            counts={"handshake_failed": 1},
            last=LastFailure(time=now, type="handshake_failed", pod="llama-decode-1"),
        ),
    )
    cluster_a.kubectl(
        "patch",
        "kvt",
        "cols",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": dump(status)}),
    )
    row = cluster_a.kubectl("get", "kvt", "cols", "-n", ns, "--no-headers").stdout.split()
    assert row[:6] == ["cols", "push", "2/2", "4/4", "8/8", "True"]
    # Nothing of the status was pruned or changed on the way through the schema.
    stored = get_json(cluster_a, "kvt", "cols", "-n", ns)
    assert KVTopologyStatus.model_validate(stored["status"]) == status


def test_server_applies_the_schema_defaults(cluster_a: LocalCluster, namespace: str) -> None:
    rc, stderr = create(cluster_a, kvtopology(namespace, "minimal", MINIMAL), dry_run=False)
    assert rc == 0, stderr
    stored = get_json(cluster_a, "kvt", "minimal", "-n", namespace)["spec"]
    assert stored["controlPort"] == 8975
    assert stored["eviction"] == {"graceSeconds": 10, "idleTTLSeconds": 0}
    assert stored["transfer"] == {"mode": "push", "backends": ["UCX"]}
    assert stored["handshake"] == {
        "timeoutSeconds": 5,
        "maxConcurrent": 64,
        "progressDeadlineSeconds": 30,
    }
    # The server's defaults are pydantic's.
    assert KVTopologySpec.model_validate(stored) == KVTopologySpec.model_validate(MINIMAL)
    expected = dump(KVTopologySpec.model_validate(MINIMAL))
    for key in ("controlPort", "transfer", "handshake", "eviction"):
        assert stored[key] == expected[key]


VALID: list[tuple[str, dict[str, Any]]] = [
    ("port-1", spec(controlPort=1)),
    ("port-65535", spec(controlPort=65535)),
    ("grace-0", spec(eviction={"graceSeconds": 0})),
    ("grace-3600-ttl-86400", spec(eviction={"graceSeconds": 3600, "idleTTLSeconds": 86400})),
    ("handshake-bounds", spec(handshake={"timeoutSeconds": 60, "maxConcurrent": 1024})),
    ("handshake-minimums", spec(handshake={"timeoutSeconds": 1, "maxConcurrent": 1})),
    ("push-over-ucx", spec(transfer={"mode": "push", "backends": ["UCX"]})),
    ("empty-label-value", spec(decode=labels(tier=""))),
    ("longest-label-value", spec(decode=labels(tier="v" * 63))),
    ("longest-label-key", spec(decode=labels(**{f"{LONG_PREFIX}/{'n' * 63}": "x"}))),
    ("one-char-key", spec(decode=labels(a="b"))),
    (
        "selectors-differing-in-expressions",
        spec(
            prefill=exprs({"key": "tier", "operator": "In", "values": ["p"]}),
            decode=exprs({"key": "tier", "operator": "NotIn", "values": ["p"]}),
        ),
    ),
    (
        "exists-and-doesnotexist",
        spec(
            prefill=exprs({"key": ROLE_LABEL, "operator": "Exists"}),
            decode=exprs({"key": ROLE_LABEL, "operator": "DoesNotExist"}),
        ),
    ),
    (
        "eight-pairing-keys",
        spec(pairing={"matchLabels": [f"k{i}" for i in range(7)] + [f"{LONG_PREFIX}/n"]}),
    ),
    ("empty-pairing", spec(pairing={"matchLabels": []})),
]


@pytest.mark.parametrize(("body"), [body for _, body in VALID], ids=[name for name, _ in VALID])
def test_boundary_specs_are_accepted(
    cluster_a: LocalCluster, namespace: str, body: dict[str, Any]
) -> None:
    KVTopologySpec.model_validate(body)
    rc, stderr = create(cluster_a, kvtopology(namespace, "edge", body))
    assert rc == 0, stderr


INVALID: list[tuple[str, dict[str, Any] | None, str, str]] = [
    # (id, spec, field path fragment, message fragment)
    ("no-spec", None, "spec: Required value", "Required value"),
    ("no-prefill", without("prefill"), "spec.prefill", "Required value"),
    ("no-decode", without("decode"), "spec.decode", "Required value"),
    (
        "no-selector",
        {"prefill": {}, "decode": {"selector": DECODE}},
        "spec.prefill.selector",
        "Required value",
    ),
    ("empty-prefill-selector", spec(prefill={}), "spec.prefill.selector", "must not be empty"),
    (
        "empty-decode-selector-lists",
        spec(decode={"matchLabels": {}, "matchExpressions": []}),
        "spec.decode.selector",
        "must not be empty",
    ),
    ("identical-selectors", spec(decode=PREFILL), "spec.decode.selector", "must differ"),
    (
        "identical-selectors-absent-vs-empty",
        spec(decode={**PREFILL, "matchExpressions": []}),
        "spec.decode.selector",
        "must differ",
    ),
    (
        "identical-expression-selectors",
        spec(
            prefill=exprs({"key": "tier", "operator": "In", "values": ["a", "b"]}),
            decode=exprs({"key": "tier", "operator": "In", "values": ["a", "b"]}),
        ),
        "spec.decode.selector",
        "must differ",
    ),
    (
        "in-without-values",
        spec(prefill=exprs({"key": "tier", "operator": "In"})),
        "spec.prefill.selector.matchExpressions[0].values",
        "values must not be empty when operator is In",
    ),
    (
        "notin-with-empty-values",
        spec(decode=exprs({"key": "tier", "operator": "NotIn", "values": []})),
        "spec.decode.selector.matchExpressions[0].values",
        "values must not be empty when operator is NotIn",
    ),
    (
        "exists-with-values",
        spec(decode=exprs({"key": "tier", "operator": "Exists", "values": ["x"]})),
        "spec.decode.selector.matchExpressions[0].values",
        "values must be empty when operator is Exists",
    ),
    (
        "doesnotexist-with-values",
        spec(
            prefill=exprs(
                {"key": "x", "operator": "Exists"},
                {"key": "tier", "operator": "DoesNotExist", "values": ["x"]},
            )
        ),
        "spec.prefill.selector.matchExpressions[1].values",
        "values must be empty when operator is DoesNotExist",
    ),
    (
        "unknown-operator",
        spec(prefill=exprs({"key": "tier", "operator": "Equals", "values": ["x"]})),
        "spec.prefill.selector.matchExpressions[0].operator",
        'Unsupported value: "Equals"',
    ),
    (
        "expression-key-invalid",
        spec(prefill=exprs({"key": "bad key", "operator": "Exists"})),
        "spec.prefill.selector.matchExpressions[0].key",
        "must be a valid label key",
    ),
    (
        "expression-key-empty",
        spec(prefill=exprs({"key": "", "operator": "Exists"})),
        "spec.prefill.selector.matchExpressions[0].key",
        "at least 1 chars long",
    ),
    (
        "expression-value-invalid",
        spec(decode=exprs({"key": "tier", "operator": "In", "values": ["ok", "-bad"]})),
        "spec.decode.selector.matchExpressions[0].values[1]",
        "must be a valid label value",
    ),
    (
        "too-many-expressions",
        spec(decode=exprs(*[{"key": f"k{i}", "operator": "Exists"} for i in range(17)])),
        "spec.decode.selector.matchExpressions",
        "must have at most 16 items",
    ),
    (
        "label-key-invalid",
        spec(prefill={"matchLabels": {"bad key": "x"}}),
        "spec.prefill.selector.matchLabels",
        'invalid label key "bad key"',
    ),
    (
        "label-key-prefix-too-long",
        spec(decode=labels(**{f"{LONG_PREFIX}x/name": "x"})),
        "spec.decode.selector.matchLabels",
        "invalid label key",
    ),
    (
        "label-key-name-too-long",
        spec(decode=labels(**{"n" * 64: "x"})),
        "spec.decode.selector.matchLabels",
        "invalid label key",
    ),
    (
        "label-key-uppercase-prefix",
        spec(decode=labels(**{"Example.com/tier": "x"})),
        "spec.decode.selector.matchLabels",
        'invalid label key "Example.com/tier"',
    ),
    (
        "label-value-invalid",
        spec(prefill={"matchLabels": {"app": "llama 3"}}),
        "spec.prefill.selector.matchLabels[app]",
        "must be a valid label value",
    ),
    (
        "label-value-too-long",
        spec(decode=labels(tier="v" * 64)),
        "spec.decode.selector.matchLabels",
        "may not be more than 63 bytes",
    ),
    (
        "too-many-labels",
        spec(prefill={"matchLabels": {f"k{i}": "v" for i in range(33)}}),
        "spec.prefill.selector.matchLabels",
        "must have at most 32 items",
    ),
    ("port-zero", spec(controlPort=0), "spec.controlPort", "greater than or equal to 1"),
    ("port-too-big", spec(controlPort=65536), "spec.controlPort", "less than or equal to 65535"),
    ("port-not-a-number", spec(controlPort="http"), "spec.controlPort", "must be of type integer"),
    (
        "unknown-mode",
        spec(transfer={"mode": "stream"}),
        "spec.transfer.mode",
        'Unsupported value: "stream"',
    ),
    ("no-backends", spec(transfer={"backends": []}), "spec.transfer.backends", "at least 1 items"),
    (
        "duplicate-backends",
        spec(transfer={"backends": ["UCX", "UCX"]}),
        "spec.transfer.backends[1]",
        'Duplicate value: "UCX"',
    ),
    # Values the API names but the workers do not implement: refused by a CEL rule that
    # says so (the enum keeps them, so the rule, not "Unsupported value", answers).
    (
        "pull-mode",
        spec(transfer={"mode": "pull"}),
        "spec.transfer.mode",
        "pull is not implemented: push (the prefill writes KV blocks into the decode's "
        "memory) is the only transfer mode",
    ),
    (
        "unimplemented-backend",
        spec(transfer={"backends": ["GDS"]}),
        "spec.transfer.backends[0]",
        "backend GDS is not implemented: the workers create their NIXL agents with UCX",
    ),
    (
        "unimplemented-backend-after-ucx",
        spec(transfer={"backends": ["UCX", "LIBFABRIC"]}),
        "spec.transfer.backends[1]",
        "backend LIBFABRIC is not implemented",
    ),
    (
        "unknown-backend",
        spec(transfer={"backends": ["RDMA"]}),
        "spec.transfer.backends[0]",
        'Unsupported value: "RDMA"',
    ),
    (
        "too-many-backends",
        spec(transfer={"backends": ["UCX", "GDS", "POSIX", "LIBFABRIC", "MOONCAKE"]}),
        "spec.transfer.backends",
        "must have at most 4 items",
    ),
    (
        "pairing-key-invalid",
        spec(pairing={"matchLabels": ["app.kubernetes.io/"]}),
        "spec.pairing.matchLabels[0]",
        "must be a valid label key",
    ),
    (
        "pairing-key-name-too-long",
        spec(pairing={"matchLabels": ["app", "x" * 64]}),
        "spec.pairing.matchLabels[1]",
        "must be a valid label key",
    ),
    (
        "pairing-key-empty",
        spec(pairing={"matchLabels": [""]}),
        "spec.pairing.matchLabels[0]",
        "at least 1 chars long",
    ),
    (
        "pairing-key-duplicate",
        spec(pairing={"matchLabels": ["app.kubernetes.io/version", "app.kubernetes.io/version"]}),
        "spec.pairing.matchLabels[1]",
        'Duplicate value: "app.kubernetes.io/version"',
    ),
    (
        "too-many-pairing-keys",
        spec(pairing={"matchLabels": [f"k{i}" for i in range(9)]}),
        "spec.pairing.matchLabels",
        "must have at most 8 items",
    ),
    (
        "handshake-timeout-zero",
        spec(handshake={"timeoutSeconds": 0}),
        "spec.handshake.timeoutSeconds",
        "greater than or equal to 1",
    ),
    (
        "handshake-timeout-too-long",
        spec(handshake={"timeoutSeconds": 61}),
        "spec.handshake.timeoutSeconds",
        "less than or equal to 60",
    ),
    (
        "handshake-concurrency-zero",
        spec(handshake={"maxConcurrent": 0}),
        "spec.handshake.maxConcurrent",
        "greater than or equal to 1",
    ),
    (
        "handshake-concurrency-too-high",
        spec(handshake={"maxConcurrent": 1025}),
        "spec.handshake.maxConcurrent",
        "less than or equal to 1024",
    ),
    (
        "grace-negative",
        spec(eviction={"graceSeconds": -1}),
        "spec.eviction.graceSeconds",
        "greater than or equal to 0",
    ),
    (
        "grace-too-long",
        spec(eviction={"graceSeconds": 3601}),
        "spec.eviction.graceSeconds",
        "less than or equal to 3600",
    ),
    (
        "ttl-negative",
        spec(eviction={"idleTTLSeconds": -1}),
        "spec.eviction.idleTTLSeconds",
        "greater than or equal to 0",
    ),
    (
        "ttl-too-long",
        spec(eviction={"idleTTLSeconds": 86401}),
        "spec.eviction.idleTTLSeconds",
        "less than or equal to 86400",
    ),
    ("unknown-field", spec(replicas=3), 'unknown field "spec.replicas"', "strict decoding error"),
    (
        "unknown-nested-field",
        spec(eviction={"ttl": 5}),
        'unknown field "spec.eviction.ttl"',
        "strict decoding error",
    ),
    (
        "snake-case-field",
        spec(control_port=8975),
        'unknown field "spec.control_port"',
        "strict decoding error",
    ),
]


def test_invalid_cases_are_many_and_distinct() -> None:
    assert len(INVALID) >= 25
    assert len({name for name, *_ in INVALID}) == len(INVALID)
    assert len({json.dumps(body, sort_keys=True) for _, body, *_ in INVALID}) == len(INVALID)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_spec_is_refused_naming_the_field(
    cluster_a: LocalCluster, namespace: str, body: dict[str, Any] | None, field: str, message: str
) -> None:
    rc, stderr = create(cluster_a, kvtopology(namespace, "bad", body))
    assert rc != 0
    assert field in stderr, stderr
    assert message in stderr, stderr
