"""The KVTopology API (kvtopo.dev/v1alpha1): the single source of truth for spec and status.

Owns the pydantic models of the custom resource, the condition types and reasons, engine
states and the closed set of failure types the status counts. The CRD schema
(`crds/kvtopology.yaml`, `kvtopo crds`) is generated from these models; CEL rules, bounds and
printer columns ride along in `json_schema_extra`. Field names are camelCase on the wire.
Imported by every other operator layer; imports nothing of kubernetes, kopf, nixl or torch.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "kvtopo.dev"
VERSION = "v1alpha1"
KIND = "KVTopology"
PLURAL = "kvtopologies"
SHORT_NAME = "kvt"

ROLE_LABEL = "kvtopo.dev/role"
ENDPOINT_ANNOTATION = "kvtopo.dev/control-endpoint"

MAX_ENGINES_IN_STATUS = 2048
MAX_LABEL_VALUE = 63
MAX_LABEL_KEY = 317  # prefix (253) + "/" + name (63)
MAX_TIMESTAMP = 64
MAX_SUMMARY = 32

# --- CRD validation riding along in json_schema_extra (see kvtopo_operator.crd) ----------
# Label syntax (apimachinery's), as RE2 for CEL `matches()`: a key is an optional DNS-subdomain
# prefix (<= 253) and "/", then a name (<= 63); a value is such a name or empty.
LABEL_NAME_RE = "([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
DNS_SUBDOMAIN_RE = "[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY_RE = f"^({DNS_SUBDOMAIN_RE}/)?{LABEL_NAME_RE}$"
LABEL_VALUE_RE = f"^({LABEL_NAME_RE})?$"
_NAME_HELP = (
    "at most 63 alphanumerics, dashes, underscores or dots, starting and ending with an "
    "alphanumeric"
)
_KEY_HELP = (
    f"an optional DNS subdomain prefix (at most 253 characters) and a slash, then {_NAME_HELP}"
)


def _is_label_key(var: str) -> str:
    """CEL: the string `var` is a valid label key."""
    return f"{var}.matches('{LABEL_KEY_RE}') && {var}.indexOf('/') <= 253"


def _same_selectors(one: str, other: str) -> str:
    """CEL: the LabelSelectors `one` and `other` are identical (an absent list or map is empty)."""

    def labels(var: str) -> str:
        return f"(has({var}.matchLabels) ? {var}.matchLabels : {{}})"

    def exprs(var: str) -> str:
        return (
            f"(has({var}.matchExpressions) ? {var}.matchExpressions.map(e, "
            "[e.key, e.operator] + (has(e.values) ? e.values : [])) : [])"
        )

    return f"{labels(one)} == {labels(other)} && {exprs(one)} == {exprs(other)}"


def _cel(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


LabelKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_LABEL_KEY,
        json_schema_extra=_cel(
            {
                "rule": _is_label_key("self"),
                "message": f"must be a valid label key: {_KEY_HELP}",
            }
        ),
    ),
]
LabelValue = Annotated[
    str,
    Field(
        max_length=MAX_LABEL_VALUE,
        json_schema_extra=_cel(
            {
                "rule": f"self.matches('{LABEL_VALUE_RE}')",
                "message": f"must be a valid label value: empty, or {_NAME_HELP}",
            }
        ),
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


# --- spec --------------------------------------------------------------------------------


class LabelSelectorRequirement(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "!(self.operator in ['In', 'NotIn']) || "
                "(has(self.values) && size(self.values) > 0)",
                "messageExpression": "'values must not be empty when operator is ' + self.operator",
                "fieldPath": ".values",
                "reason": "FieldValueRequired",
            },
            {
                "rule": "!(self.operator in ['Exists', 'DoesNotExist']) || "
                "!has(self.values) || size(self.values) == 0",
                "messageExpression": "'values must be empty when operator is ' + self.operator",
                "fieldPath": ".values",
                "reason": "FieldValueForbidden",
            },
        )
    )

    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=64)


class LabelSelector(_Model):
    """A standard Kubernetes LabelSelector; must not be empty (it would select every pod)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
                "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
                "message": "selector must not be empty (it would select every pod): "
                "set matchLabels or matchExpressions",
                "reason": "FieldValueRequired",
            }
        )
    )

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=32,
        json_schema_extra=_cel(
            {
                "rule": f"self.all(k, {_is_label_key('k')})",
                "message": f"every key must be a valid label key: {_KEY_HELP}",
                # Naming only the first bad key keeps the estimated cost within the limits.
                "messageExpression": "'invalid label key \"' + "
                f"self.filter(k, !({_is_label_key('k')}))[0] + '\": a label key is {_KEY_HELP}'",
            }
        ),
    )
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)


class RoleSpec(_Model):
    selector: LabelSelector = Field(
        description="Label selector choosing this role's engine pods (which also carry the "
        "label kvtopo.dev/role); must not be empty."
    )


Backend = Literal["UCX", "GDS", "POSIX", "LIBFABRIC", "MOONCAKE"]


def _default_backends() -> list[Backend]:
    return ["UCX"]


class TransferSpec(_Model):
    mode: Literal["push", "pull"] = Field(
        default="push", description="push: prefill writes KV blocks to decode; pull: decode reads."
    )
    backends: list[Backend] = Field(
        default_factory=_default_backends,
        min_length=1,
        max_length=4,
        description="NIXL backends, in order of preference; no duplicates.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class PairingSpec(_Model):
    """Label keys whose values must be equal on a prefill and a decode pod to pair them."""

    match_labels: list[LabelKey] = Field(
        default_factory=list,
        max_length=8,
        description="Label keys (no duplicates) whose values must be equal on a prefill and a "
        "decode pod to pair them, e.g. app.kubernetes.io/version to keep revisions apart.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class HandshakeSpec(_Model):
    timeout_seconds: int = Field(
        default=5, ge=1, le=60, description="Deadline of one NIXL handshake."
    )
    max_concurrent: int = Field(
        default=64, ge=1, le=1024, description="Handshakes the operator drives at once."
    )


class EvictionSpec(_Model):
    grace_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description="How long a gone engine is kept (draining in-flight transfers) before it "
        "is evicted from every peer.",
    )
    idle_ttl_seconds: int = Field(
        default=0,
        ge=0,
        le=86400,
        alias="idleTTLSeconds",
        description="In-worker idle backstop (vLLM's engine_ttl); 0 turns it off.",
    )


class KVTopologySpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": f"!({_same_selectors('self.prefill.selector', 'self.decode.selector')})",
                "message": "prefill and decode selectors must differ (identical selectors would "
                "pair every engine with itself)",
                "fieldPath": ".decode.selector",
            }
        )
    )

    prefill: RoleSpec = Field(description="The prefill engines.")
    decode: RoleSpec = Field(description="The decode engines.")
    control_port: int = Field(
        default=8975,
        ge=1,
        le=65535,
        description="The worker agent's control port on each engine pod; the pod annotation "
        "kvtopo.dev/control-endpoint (host:port) overrides podIP:controlPort.",
    )
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    pairing: PairingSpec = Field(default_factory=PairingSpec)
    handshake: HandshakeSpec = Field(default_factory=HandshakeSpec)
    eviction: EvictionSpec = Field(default_factory=EvictionSpec)


# --- status ------------------------------------------------------------------------------


class ConditionType(enum.StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"


class Reason(enum.StrEnum):
    """Closed set of condition reasons (CamelCase, per the API conventions)."""

    ALL_PAIRS_CONNECTED = "AllPairsConnected"
    PAIRS_MISSING = "PairsMissing"
    NO_ENGINES = "NoEngines"
    HANDSHAKING = "Handshaking"
    DRAINING = "Draining"
    STABLE = "Stable"
    HANDSHAKE_FAILED = "HandshakeFailed"
    INCOMPATIBLE = "Incompatible"
    WORKER_UNREACHABLE = "WorkerUnreachable"
    HEALTHY = "Healthy"
    FIRST_RECONCILE = "FirstReconcile"


class EngineState(enum.StrEnum):
    PENDING = "Pending"
    HANDSHAKING = "Handshaking"
    CONNECTED = "Connected"
    DRAINING = "Draining"
    EVICTED = "Evicted"
    FAILED = "Failed"
    INCOMPATIBLE = "Incompatible"


class Condition(_Model):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=128)
    message: str = Field(default="", max_length=1024)
    last_transition_time: str = Field(max_length=MAX_TIMESTAMP)
    observed_generation: int = 0


class Summary(_Model):
    prefill: str = Field(default="0/0", max_length=MAX_SUMMARY)
    decode: str = Field(default="0/0", max_length=MAX_SUMMARY)
    pairs: str = Field(default="0/0", max_length=MAX_SUMMARY)


class EngineStatus(_Model):
    pod: str = Field(max_length=253)
    role: Literal["prefill", "decode"]
    engine_id: str = Field(default="", max_length=256)
    endpoint: str = Field(default="", max_length=300)
    state: EngineState
    peers: int = 0
    since: str = Field(max_length=MAX_TIMESTAMP)
    message: str = Field(default="", max_length=512)
    compat_hash: str = Field(default="", max_length=64)
    # Last failure counters read from this engine's worker: the baseline for the deltas
    # that `failures` accumulates, so totals survive worker and operator restarts.
    failures_seen: dict[str, int] = Field(default_factory=dict, max_length=32)


class LastFailure(_Model):
    time: str = Field(max_length=MAX_TIMESTAMP)
    type: str = Field(max_length=64)
    engine_id: str = Field(default="", max_length=256)
    pod: str = Field(default="", max_length=253)
    request_id: str = Field(default="", max_length=256)
    message: str = Field(default="", max_length=512)


class Failures(_Model):
    counts: dict[str, int] = Field(default_factory=dict, max_length=32)
    last: LastFailure | None = None


class KVTopologyStatus(_Model):
    observed_generation: int = 0
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    summary: Summary = Field(default_factory=Summary)
    engines: list[EngineStatus] = Field(default_factory=list, max_length=MAX_ENGINES_IN_STATUS)
    failures: Failures = Field(default_factory=Failures)


class KVTopology(_Model):
    """The whole object as the operator reads it (metadata kept as a plain mapping)."""

    api_version: str = f"{GROUP}/{VERSION}"
    kind: Literal["KVTopology"] = "KVTopology"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: KVTopologySpec
    status: KVTopologyStatus = Field(default_factory=KVTopologyStatus)


def dump(model: BaseModel) -> dict[str, Any]:
    """The wire form: camelCase keys, no Nones."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")
