"""The KVTopology CustomResourceDefinition, generated from the pydantic models in `api`.

Owns the conversion of a pydantic JSON schema into a Kubernetes *structural* schema
(:func:`structural_schema`: `$ref`s inlined, `anyOf [X, null]` folded into X, titles and null
defaults dropped, bounds, real defaults and `x-kubernetes-*` markers kept), the JSON schema
generator that also emits the defaults pydantic's `default_factory`s make
(:class:`CRDJsonSchema`), the printer columns, and the CRD manifest itself
(:func:`crd_manifest`, :func:`render_crd`), which is checked in as `crds/kvtopology.yaml`
(regenerate it and the chart's copy with ``make crds``). Pure: no I/O
besides that ``__main__``, nothing of kubernetes or kopf.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any, Final, Literal

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from kvtopo_operator.api import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAME,
    VERSION,
    KVTopologySpec,
    KVTopologyStatus,
)

CRD_NAME: Final = f"{PLURAL}.{GROUP}"
SINGULAR: Final = KIND.lower()

PRINTER_COLUMNS: Final[tuple[dict[str, str], ...]] = (
    {"name": "Mode", "type": "string", "jsonPath": ".spec.transfer.mode"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.summary.prefill"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.summary.decode"},
    {"name": "Pairs", "type": "string", "jsonPath": ".status.summary.pairs"},
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

DESCRIPTION: Final = (
    "KVTopology keeps the KV-cache transfer topology of a prefill/decode disaggregated LLM "
    "deployment correct: it selects the prefill and decode engine pods, and the operator "
    "drives NIXL handshakes between paired engines and evicts gone ones."
)

# Keys a structural schema may carry as they are (x-kubernetes-* pass too).
_KEPT: Final = frozenset(
    {
        "type",
        "format",
        "description",
        "enum",
        "default",
        "minimum",
        "maximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "nullable",
        "required",
    }
)
# Documentation-only JSON Schema keys a CRD has no use for.
_DROPPED: Final = frozenset(
    {"title", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema"}
)
# The order keys are written in, so the YAML reads top-down (unlisted keys go last).
_ORDER: Final = (
    "type",
    "description",
    "format",
    "enum",
    "default",
    "nullable",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "properties",
    "items",
    "additionalProperties",
)


class UnsupportedSchemaError(ValueError):
    """The JSON schema uses a construct a Kubernetes structural schema cannot express."""


class CRDJsonSchema(GenerateJsonSchema):
    """Pydantic's generator, plus the defaults that argument-less `default_factory`s make.

    A factory making a model writes only the fields that differ from the model's own
    defaults (usually ``default: {}``): the API server then fills in the rest itself. One
    making an empty list or mapping gets no default (absent and empty mean the same, and
    stored objects stay free of noise); any other value is written out as is.
    """

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=self.by_alias, exclude_defaults=True)
        if isinstance(value, list | tuple | dict | set | frozenset) and not value:
            return NoDefault
        return value


def model_json_schema(
    model: type[BaseModel], mode: Literal["validation", "serialization"]
) -> dict[str, Any]:
    """The model's wire-form (camelCase) JSON schema, as pydantic makes it, with defaults."""
    return model.model_json_schema(by_alias=True, mode=mode, schema_generator=CRDJsonSchema)


def structural_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Convert a pydantic JSON schema into a Kubernetes structural schema.

    `$ref`s into `$defs` are inlined (their sibling keys, e.g. a field's description or
    default, win over the definition's); `anyOf`/`oneOf` of one type and `null` becomes that
    type (`nullable: true` only where the field is required, otherwise it is simply left
    out of `required`); a one-element `allOf` is unwrapped; `title` and `default: null` are
    dropped, as is `additionalProperties: false` (the API server prunes unknown fields);
    `additionalProperties: true` becomes `x-kubernetes-preserve-unknown-fields`; `const`
    becomes a one-value `enum`; numeric `exclusiveMinimum`/`exclusiveMaximum` (JSON Schema
    2020-12) become OpenAPI 3.0's `minimum` + `exclusiveMinimum: true`. Everything else a
    CRD allows is kept: bounds, patterns, enums, real defaults, descriptions, the
    `additionalProperties` schemas of maps and every `x-kubernetes-*` key.

    Raises :class:`UnsupportedSchemaError` on what a structural schema cannot hold (real
    unions, recursive references, unknown keywords, a node without a type).
    """
    defs: Mapping[str, Any] = schema.get("$defs", {})
    top = {key: value for key, value in schema.items() if key != "$defs"}
    converted, _ = _convert(top, defs, frozenset(), "")
    return converted


def _convert(
    node: Mapping[str, Any], defs: Mapping[str, Any], resolving: frozenset[str], path: str
) -> tuple[dict[str, Any], bool]:
    """The structural form of `node`, and whether `node` admitted null."""
    where = path or "<root>"
    if "$ref" in node:
        ref = node["$ref"]
        prefix = "#/$defs/"
        if not isinstance(ref, str) or not ref.startswith(prefix) or ref[len(prefix) :] not in defs:
            raise UnsupportedSchemaError(f"{where}: cannot resolve $ref {ref!r}")
        name = ref[len(prefix) :]
        if name in resolving:
            raise UnsupportedSchemaError(f"{where}: recursive $ref {ref!r} cannot be inlined")
        merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs, resolving | {name}, path)
    if "allOf" in node:
        parts = node["allOf"]
        if len(parts) != 1:
            raise UnsupportedSchemaError(f"{where}: allOf of {len(parts)} schemas")
        merged = {**parts[0], **{k: v for k, v in node.items() if k != "allOf"}}
        return _convert(merged, defs, resolving, path)
    for union in ("anyOf", "oneOf"):
        if union in node:
            branches = node[union]
            others = [branch for branch in branches if branch != {"type": "null"}]
            if len(others) != 1 or len(others) == len(branches):
                raise UnsupportedSchemaError(
                    f"{where}: {union} other than 'one type or null' is not structural"
                )
            merged = {**others[0], **{k: v for k, v in node.items() if k != union}}
            converted, _ = _convert(merged, defs, resolving, path)
            return converted, True
    if node.get("type") == "null" or (
        isinstance(node.get("type"), list) and len(node["type"]) != 1
    ):
        raise UnsupportedSchemaError(f"{where}: type {node['type']!r} is not structural")

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or (key == "default" and value is None):
            continue
        if key == "properties":
            required = set(node.get("required", ()))
            properties: dict[str, Any] = {}
            for name, sub in value.items():
                converted, nullable = _convert(sub, defs, resolving, f"{path}.{name}")
                if nullable and name in required:
                    converted["nullable"] = True
                properties[name] = _ordered(converted)
            out["properties"] = properties
        elif key == "items":
            if not isinstance(value, Mapping):
                raise UnsupportedSchemaError(f"{where}: tuple-style items are not structural")
            converted, nullable = _convert(value, defs, resolving, f"{path}[*]")
            if nullable:
                converted["nullable"] = True
            out["items"] = _ordered(converted)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:
                converted, nullable = _convert(value, defs, resolving, f"{path}[*]")
                if nullable:
                    converted["nullable"] = True
                out["additionalProperties"] = _ordered(converted)
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(value, bool):  # already OpenAPI 3.0 style
                out[key] = value
            else:
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
        elif key == "required":
            if value:
                out["required"] = list(value)
        elif key == "type":
            out["type"] = value[0] if isinstance(value, list) else value
        elif key == "x-kubernetes-validations":
            out[key] = [_ordered_rule(rule) for rule in value]
        elif key in _KEPT or key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)
        else:
            raise UnsupportedSchemaError(f"{where}: {key!r} has no place in a structural schema")

    if "type" not in out and not (
        out.get("x-kubernetes-preserve-unknown-fields") or out.get("x-kubernetes-int-or-string")
    ):
        raise UnsupportedSchemaError(f"{where}: a structural schema node needs a type")
    return _ordered(out), False


_RULE_ORDER: Final = ("rule", "message", "messageExpression", "fieldPath", "reason")


def _ordered_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    rank = {key: index for index, key in enumerate(_RULE_ORDER)}
    return dict(sorted(rule.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {key: index for index, key in enumerate(_ORDER)}
    return dict(sorted(node.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


def openapi_schema() -> dict[str, Any]:
    """The CRD version's `openAPIV3Schema`: spec from the validation-mode schema (what users
    write), status from the serialization-mode one (what the operator writes)."""
    return {
        "type": "object",
        "description": DESCRIPTION,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": structural_schema(model_json_schema(KVTopologySpec, "validation")),
            "status": structural_schema(model_json_schema(KVTopologyStatus, "serialization")),
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition `kvtopologies.kvtopo.dev`, as a plain mapping."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": [SHORT_NAME],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(column) for column in PRINTER_COLUMNS],
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER: Final = (
    "# Generated from kvtopo_operator/api.py by kvtopo_operator.crd.render_crd(); do not edit.\n"
    "# Regenerate (this file and the chart's copy): make crds\n"
)


class _Dumper(yaml.SafeDumper):
    """Safe YAML without anchors and aliases (repeated subtrees are written out in full)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd() -> str:
    """The CRD as YAML, exactly as checked in at `crds/kvtopology.yaml`."""
    body = yaml.dump(crd_manifest(), Dumper=_Dumper, sort_keys=False, width=120)
    return HEADER + "---\n" + body


if __name__ == "__main__":
    sys.stdout.write(render_crd())
