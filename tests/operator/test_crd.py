"""The generated KVTopology CRD, offline: the pydantic-to-structural-schema conversion, the
checked-in `crds/kvtopology.yaml` against the models, schema invariants the API server and CEL
cost estimation rely on, defaults agreeing with pydantic's, and the `examples/` folder."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from kvtopo_operator import crd
from kvtopo_operator.api import (
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    ROLE_LABEL,
    KVTopology,
    KVTopologySpec,
    KVTopologyStatus,
    dump,
)

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "crds" / "kvtopology.yaml"
EXAMPLES = REPO / "examples"


# --- helpers -----------------------------------------------------------------------------


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (path, mapping) in a nested schema, the root included."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}/{index}")


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node (not the CEL rules or defaults inside them)."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[*]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{*}}")


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: a missing property with a default
    gets it, then defaulting recurses into it."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def drop_empty(value: Any) -> Any:
    """Absent and empty lists/maps mean the same on the wire; compare without them."""
    if isinstance(value, dict):
        pruned = {k: drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [drop_empty(item) for item in value]
    return value


def convert(
    model: type[BaseModel], mode: Literal["validation", "serialization"] = "validation"
) -> dict[str, Any]:
    return crd.structural_schema(crd.model_json_schema(model, mode))


def example_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def kvtopologies() -> list[dict[str, Any]]:
    return [doc for doc in example_documents() if doc["kind"] == "KVTopology"]


def deployments() -> list[dict[str, Any]]:
    return [doc for doc in example_documents() if doc["kind"] == "Deployment"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector match, enough for the examples."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# --- the conversion on small models ------------------------------------------------------


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Inner(_M):
    """An inner object."""

    size: int = Field(default=3, ge=1, le=9)
    name: str = Field(default="", max_length=20)


class Outer(_M):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [{"message": "m", "rule": "self.first.size > 0"}]
        }
    )

    first: Inner = Field(description="The first one.")
    second: Inner = Field(default_factory=Inner)
    third: Inner = Field(default_factory=lambda: Inner(size=5))
    maybe: Inner | None = None
    must_be_given: Inner | None
    port: int | None = None
    count: int = Field(default=0, gt=-1, lt=100)
    mode: Literal["a", "bb"] = "a"
    only: Literal["fixed"] = "fixed"
    tags: list[str] = Field(default_factory=list, max_length=4)
    backends: list[str] = Field(
        default_factory=lambda: ["x"],
        max_length=2,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    counters: dict[str, int] = Field(default_factory=dict, max_length=5)
    anything: dict[str, Any] = Field(default_factory=dict)


@pytest.fixture(scope="module")
def outer() -> dict[str, Any]:
    return convert(Outer)


def test_refs_are_inlined_with_the_fields_own_keys_winning(outer: dict[str, Any]) -> None:
    assert not [p for p, node in walk(outer) if "$ref" in node or "$defs" in node]
    first = outer["properties"]["first"]
    assert first["type"] == "object"
    assert first["description"] == "The first one."  # the field's, not Inner's docstring
    assert outer["properties"]["second"]["description"] == "An inner object."
    assert first["properties"]["size"] == {
        "type": "integer",
        "default": 3,
        "minimum": 1,
        "maximum": 9,
    }


def test_optional_fields_become_their_type(outer: dict[str, Any]) -> None:
    assert not [p for p, node in walk(outer) if {"anyOf", "oneOf", "allOf"} & node.keys()]
    assert not [p for p, node in walk(outer) if node.get("type") == "null"]
    props = outer["properties"]
    assert props["port"] == {"type": "integer"}
    assert props["maybe"]["type"] == "object"
    assert "nullable" not in props["maybe"]
    assert props["maybe"]["properties"]["size"]["default"] == 3
    # Required and nullable: the only case that needs `nullable`.
    assert props["must_be_given"]["nullable"] is True
    assert "must_be_given" in outer["required"]
    assert "maybe" not in outer["required"]
    assert "port" not in outer["required"]


def test_titles_null_defaults_and_closed_object_markers_are_dropped(outer: dict[str, Any]) -> None:
    assert not [p for p, node in walk(outer) if "title" in node]
    assert not [p for p, node in walk(outer) if "default" in node and node["default"] is None]
    assert not [p for p, node in walk(outer) if node.get("additionalProperties") is False]


def test_real_defaults_are_kept_and_factories_evaluated(outer: dict[str, Any]) -> None:
    props = outer["properties"]
    assert props["second"]["default"] == {}  # a model: the server fills its own defaults
    assert props["third"]["default"] == {"size": 5}  # ... but not the factory's own choices
    assert props["backends"]["default"] == ["x"]
    assert props["mode"]["default"] == "a"
    assert props["count"]["default"] == 0
    assert "default" not in props["tags"]  # empty collections: absent means the same
    assert "default" not in props["counters"]
    assert "default" not in props["first"]


def test_bounds_enums_maps_and_markers_are_kept(outer: dict[str, Any]) -> None:
    props = outer["properties"]
    assert props["tags"] == {"type": "array", "maxItems": 4, "items": {"type": "string"}}
    assert props["mode"]["enum"] == ["a", "bb"]
    assert props["only"]["enum"] == ["fixed"]  # `const` has no place in a CRD
    assert props["counters"] == {
        "type": "object",
        "maxProperties": 5,
        "additionalProperties": {"type": "integer"},
    }
    assert props["anything"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert props["backends"]["x-kubernetes-list-type"] == "set"
    assert props["first"]["properties"]["name"]["maxLength"] == 20
    # JSON Schema 2020-12's numeric exclusive bounds, in OpenAPI 3.0's form.
    assert props["count"]["minimum"] == -1
    assert props["count"]["exclusiveMinimum"] is True
    assert props["count"]["maximum"] == 100
    assert props["count"]["exclusiveMaximum"] is True
    # CEL rules ride along, `rule` first.
    assert outer["x-kubernetes-validations"] == [{"rule": "self.first.size > 0", "message": "m"}]
    assert list(outer["x-kubernetes-validations"][0]) == ["rule", "message"]


def test_conversion_does_not_share_or_mutate_the_input() -> None:
    schema = crd.model_json_schema(Outer, "validation")
    before = copy.deepcopy(schema)
    first, second = crd.structural_schema(schema), crd.structural_schema(schema)
    assert schema == before
    first["x-kubernetes-validations"][0]["rule"] = "changed"
    assert second["x-kubernetes-validations"][0]["rule"] == "self.first.size > 0"


class Union(_M):
    value: int | str


class Node(_M):
    children: list[Node] = Field(default_factory=list, max_length=2)


@pytest.mark.parametrize(
    ("schema", "complaint"),
    [
        (Union.model_json_schema(), "anyOf"),
        (Node.model_json_schema(), "recursive $ref"),
        ({"type": "object", "patternProperties": {"^a": {"type": "string"}}}, "patternProperties"),
        ({"properties": {"a": {"type": "string"}}}, "needs a type"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "cannot resolve"),
        ({"type": "array", "items": [{"type": "string"}]}, "tuple-style"),
        ({"type": "null"}, "not structural"),
    ],
    ids=["union", "recursive", "unknown-keyword", "untyped", "dangling-ref", "tuple", "null"],
)
def test_what_a_structural_schema_cannot_hold_is_refused(
    schema: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(crd.UnsupportedSchemaError, match=re.escape(complaint)):
        crd.structural_schema(schema)


def test_a_one_element_allof_is_unwrapped() -> None:
    schema = {
        "$defs": {"D": {"type": "string", "maxLength": 4, "title": "D"}},
        "type": "object",
        "properties": {"d": {"allOf": [{"$ref": "#/$defs/D"}], "default": "ab"}},
    }
    assert crd.structural_schema(schema)["properties"]["d"] == {
        "type": "string",
        "default": "ab",
        "maxLength": 4,
    }


# --- the KVTopology CRD ------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return crd.crd_manifest()


@pytest.fixture(scope="module")
def openapi(manifest: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_crd_matches_the_models(manifest: dict[str, Any]) -> None:
    checked_in = yaml.safe_load(CHECKED_IN.read_text())
    assert checked_in == manifest, (
        "crds/kvtopology.yaml is stale; regenerate it and the chart's copy: make crds"
    )
    assert yaml.safe_load(crd.render_crd()) == manifest
    assert "&id" not in crd.render_crd()  # no YAML anchors: every subtree written out


def test_crd_names_scope_and_version(manifest: dict[str, Any]) -> None:
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == "kvtopologies.kvtopo.dev"
    assert spec["group"] == "kvtopo.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "KVTopology"
    assert spec["names"]["plural"] == "kvtopologies"
    assert spec["names"]["shortNames"] == ["kvt"]
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns(manifest: dict[str, Any], openapi: dict[str, Any]) -> None:
    columns = manifest["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [(c["name"], c["jsonPath"]) for c in columns] == [
        ("Mode", ".spec.transfer.mode"),
        ("Prefill", ".status.summary.prefill"),
        ("Decode", ".status.summary.decode"),
        ("Pairs", ".status.summary.pairs"),
        ("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        ("Age", ".metadata.creationTimestamp"),
    ]
    # Each column reads a field the schema declares (metadata is the API server's).
    for column in columns:
        path = re.sub(r"\[\?\(.*?\)\]", "[*]", column["jsonPath"]).lstrip(".")
        if path.startswith("metadata."):
            assert column["type"] == "date"
            continue
        node = openapi
        for part in path.split("."):
            many = part.endswith("[*]")
            node = node["properties"][part.removesuffix("[*]")]
            if many:
                node = node["items"]
        assert node["type"] == column["type"] == "string", column


def test_schema_is_structural_and_bounded(openapi: dict[str, Any]) -> None:
    nodes = list(schema_nodes(openapi))
    assert len(nodes) > 50
    forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const"}
    assert not [p for p, n in nodes if forbidden & n.keys()]
    assert not [
        p for p, n in nodes if n.get("type") not in {"object", "array", "string", "integer"}
    ]
    assert not [p for p, n in nodes if "default" in n and n["default"] is None]
    assert not [p for p, n in nodes if "additionalProperties" in n and "properties" in n]
    # CEL cost estimation refuses unbounded lists, maps and strings (apiVersion and kind are
    # the API server's, as in every CRD).
    unbounded = [
        p
        for p, n in nodes
        if p.startswith((".spec", ".status"))
        and (
            (n["type"] == "string" and "maxLength" not in n and "enum" not in n)
            or (n["type"] == "array" and "maxItems" not in n)
            or ("additionalProperties" in n and "maxProperties" not in n)
        )
    ]
    assert len(unbounded) == 0, unbounded
    assert {p for p, _ in nodes} >= {".spec.pairing.matchLabels[*]", ".status.engines[*].pod"}


def test_spec_requires_roles_and_carries_the_cel_rules(openapi: dict[str, Any]) -> None:
    assert openapi["required"] == ["spec"]
    spec = openapi["properties"]["spec"]
    assert spec["required"] == ["prefill", "decode"]
    assert set(spec["properties"]) == {
        "prefill",
        "decode",
        "controlPort",
        "transfer",
        "pairing",
        "handshake",
        "eviction",
        "readinessGate",
        "availability",
    }
    assert set(spec["properties"]["readinessGate"]["properties"]) == {"minConnectedPartners"}
    assert set(spec["properties"]["availability"]["properties"]) == {
        "minAvailablePrefill",
        "minAvailableDecode",
    }
    assert set(spec["properties"]["eviction"]["properties"]) == {"graceSeconds", "idleTTLSeconds"}
    [distinct] = spec["x-kubernetes-validations"]
    assert "self.prefill.selector" in distinct["rule"]
    assert distinct["fieldPath"] == ".decode.selector"
    selector = spec["properties"]["prefill"]["properties"]["selector"]
    assert "size(self.matchLabels) > 0" in selector["x-kubernetes-validations"][0]["rule"]
    requirement = selector["properties"]["matchExpressions"]["items"]
    assert [r["fieldPath"] for r in requirement["x-kubernetes-validations"]] == [
        ".values",
        ".values",
    ]
    pairing = spec["properties"]["pairing"]["properties"]["matchLabels"]
    assert pairing["x-kubernetes-list-type"] == "set"
    assert pairing["items"]["maxLength"] == 317
    assert "self.matches(" in pairing["items"]["x-kubernetes-validations"][0]["rule"]
    transfer = spec["properties"]["transfer"]["properties"]
    assert transfer["backends"]["x-kubernetes-list-type"] == "set"
    # Only what the workers implement: the enums keep the other names, CEL rules refuse them.
    assert transfer["mode"]["enum"] == ["push", "pull"]
    [push_only] = transfer["mode"]["x-kubernetes-validations"]
    assert push_only["rule"] == "self == 'push'"
    assert push_only["message"].startswith("pull is not implemented")
    backend = transfer["backends"]["items"]
    assert backend["enum"] == ["UCX", "GDS", "POSIX", "LIBFABRIC", "MOONCAKE"]
    [ucx_only] = backend["x-kubernetes-validations"]
    assert ucx_only["rule"] == "self == 'UCX'" and backend["maxLength"] == 16
    assert "' is not implemented: the workers" in ucx_only["messageExpression"]
    conditions = openapi["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    rules = [
        r for _, node in schema_nodes(openapi) for r in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 8
    assert all("message" in r or "messageExpression" in r for r in rules)


def test_schema_defaults_agree_with_pydantic(openapi: dict[str, Any]) -> None:
    minimal = {
        "prefill": {"selector": {"matchLabels": {ROLE_LABEL: "prefill"}}},
        "decode": {"selector": {"matchLabels": {ROLE_LABEL: "decode"}}},
    }
    spec_schema = openapi["properties"]["spec"]
    defaulted = apply_defaults(spec_schema, minimal)
    assert defaulted["controlPort"] == 8975
    assert defaulted["eviction"] == {"graceSeconds": 10, "idleTTLSeconds": 0}
    assert defaulted["transfer"] == {"mode": "push", "backends": ["UCX"]}
    assert defaulted["handshake"] == {
        "timeoutSeconds": 5,
        "maxConcurrent": 64,
        "progressDeadlineSeconds": 30,
    }
    assert drop_empty(defaulted) == drop_empty(dump(KVTopologySpec.model_validate(minimal)))
    status_schema = openapi["properties"]["status"]
    assert drop_empty(apply_defaults(status_schema, {})) == drop_empty(dump(KVTopologyStatus()))


def test_the_models_still_read_values_the_crd_now_refuses() -> None:
    # The rules refusing pull and other backends are the CRD's (CEL), as are the label
    # syntax and distinct-selector rules: an object stored before them (and kept through
    # updates by validation ratcheting) still reads, and is reconciled as it always was.
    spec = KVTopologySpec.model_validate(
        {
            "prefill": {"selector": {"matchLabels": {ROLE_LABEL: "prefill"}}},
            "decode": {"selector": {"matchLabels": {ROLE_LABEL: "decode"}}},
            "transfer": {"mode": "pull", "backends": ["GDS", "UCX"]},
        }
    )
    assert (spec.transfer.mode, spec.transfer.backends) == ("pull", ["GDS", "UCX"])


@pytest.mark.parametrize(
    ("key", "valid"),
    [
        ("app", True),
        ("a", True),
        ("app.kubernetes.io/version", True),
        ("kvtopo.dev/role", True),
        ("A_b-c.9", True),
        ("x" * 63, True),
        ("x" * 64, False),
        ("", False),
        ("-app", False),
        ("app-", False),
        ("a b", False),
        ("example.com/", False),
        ("/app", False),
        ("a/b/c", False),
        ("Example.com/app", False),
        ("-example.com/app", False),
    ],
)
def test_label_key_pattern(key: str, valid: bool) -> None:
    assert bool(re.fullmatch(LABEL_KEY_RE, key)) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("", True),
        ("v1", True),
        ("a.b_c-d", True),
        ("x" * 63, True),
        ("x" * 64, False),
        ("-v1", False),
        ("v1.", False),
        ("a b", False),
        ("a/b", False),
    ],
)
def test_label_value_pattern(value: str, valid: bool) -> None:
    assert bool(re.fullmatch(LABEL_VALUE_RE, value)) is valid


# --- examples ----------------------------------------------------------------------------


def test_examples_folder_holds_the_documented_files() -> None:
    names = {path.name for path in EXAMPLES.iterdir()}
    assert {
        "kvtopology.yaml",
        "prefill-deployment.yaml",
        "decode-deployment.yaml",
        "README.md",
    } <= names
    assert len(kvtopologies()) >= 1
    assert {d["metadata"]["name"] for d in deployments()} == {"llama-prefill", "llama-decode"}


@pytest.mark.parametrize("doc", kvtopologies(), ids=lambda d: d["metadata"]["name"])
def test_every_example_kvtopology_validates_against_the_models(
    doc: dict[str, Any], openapi: dict[str, Any]
) -> None:
    model = KVTopology.model_validate(doc)
    assert model.api_version == "kvtopo.dev/v1alpha1"
    # What the API server stores (the example plus schema defaults) reads back the same.
    stored = apply_defaults(openapi["properties"]["spec"], doc["spec"])
    assert KVTopologySpec.model_validate(stored) == model.spec
    assert drop_empty(stored) == drop_empty(dump(model.spec))


def test_llama_pd_example() -> None:
    [topology] = [d for d in kvtopologies() if d["metadata"]["name"] == "llama-pd"]
    spec = KVTopologySpec.model_validate(topology["spec"])
    assert spec.pairing.match_labels == ["app.kubernetes.io/version"]
    assert spec.eviction.grace_seconds == 10
    assert spec.prefill.selector.match_labels == {"app": "llama", ROLE_LABEL: "prefill"}
    assert spec.decode.selector.match_labels == {"app": "llama", ROLE_LABEL: "decode"}
    assert "namespace" not in topology["metadata"]  # applied into the caller's namespace


@pytest.mark.parametrize("deployment", deployments(), ids=lambda d: d["metadata"]["name"])
def test_example_deployments_are_selected_by_their_role(deployment: dict[str, Any]) -> None:
    [topology] = [d for d in kvtopologies() if d["metadata"]["name"] == "llama-pd"]
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    role = labels[ROLE_LABEL]
    assert role in {"prefill", "decode"}
    assert labels["app"] == "llama"
    assert labels["app.kubernetes.io/version"] == "v1"
    assert selects(deployment["spec"]["selector"], labels)
    other = "decode" if role == "prefill" else "prefill"
    assert selects(topology["spec"][role]["selector"], labels)
    assert not selects(topology["spec"][other]["selector"], labels)
    pod = template["spec"]
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/kvtopo/worker:0.1.0"
    command = container["command"] + container["args"]
    assert command[:3] == ["kvtopo-worker", "--role", role]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    # Bound to the pod IP at the control port, with both credentials, told its pod.
    assert flags["--host"] == "$(POD_IP)" and flags["--port"] == "8975"
    assert {"name": "kvtopo-control", "containerPort": 8975, "protocol": "TCP"} in container[
        "ports"
    ]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {
        "POD_IP": "status.podIP",
        "KVTOPO_POD_NAMESPACE": "metadata.namespace",
        "KVTOPO_POD_NAME": "metadata.name",
        "KVTOPO_POD_UID": "metadata.uid",
    }
    # The operator's public key (the chart's ConfigMap) and no Secret: the pod holds nothing
    # that could sign a call or open another engine.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert all("secret" not in v for v in pod["volumes"]), pod["volumes"]
    maps = {v["name"]: v["configMap"]["name"] for v in pod["volumes"]}
    [volume] = [name for name, m in maps.items() if m == "kvtopo-operator-key"]
    assert flags["--operator-key-file"] == f"{mounts[volume]}/operator.pem"
    assert "--token-file" not in flags and "--peer-token-file" not in flags
    # Generic for real clusters: nothing of the local kwok drill.
    assert "nodeSelector" not in pod
    assert "tolerations" not in pod
