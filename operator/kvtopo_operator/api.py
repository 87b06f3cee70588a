"""The KVTopology API (kvtopo.dev/v1alpha1): the single source of truth for spec and status.

Owns the pydantic models of the custom resource, the condition types and reasons, engine
states and the closed set of failure types the status counts. The CRD schema
(`crds/kvtopology.yaml`, `kvtopo crds`) is generated from these models; CEL rules, bounds and
printer columns ride along in `json_schema_extra`. Field names are camelCase on the wire.
Also owns reading objects tolerantly (`read_tolerant`): what a newer CRD or operator wrote
and this version does not know is ignored and reported, never a reason to skip a topology
or to forget its status.
Imported by every other operator layer; imports nothing of kubernetes, kopf, nixl or torch.
"""

from __future__ import annotations

import enum
import types
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from kvtopo_worker.protocol import FailureType

GROUP = "kvtopo.dev"
VERSION = "v1alpha1"
KIND = "KVTopology"
PLURAL = "kvtopologies"
SHORT_NAME = "kvt"

ROLE_LABEL = "kvtopo.dev/role"
ENDPOINT_ANNOTATION = "kvtopo.dev/control-endpoint"
# The pod readiness gate the operator owns: a pod listing it in spec.readinessGates becomes
# Ready only once the operator sets this condition True (its engine moves KV to its partners).
KV_CONNECTED_GATE = "kvtopo.dev/kv-connected"

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


# What the workers implement. The enums keep the other names (NIXL's backends, the pull
# mode) so that a CEL rule, not a bare "Unsupported value", says they are not implemented
# (an enum violation stops the API server before any CEL rule runs), and so that objects
# stored before the rules existed still read.
SUPPORTED_MODE = "push"
SUPPORTED_BACKEND = "UCX"
PULL_REFUSED = (
    "pull is not implemented: push (the prefill writes KV blocks into the decode's memory) "
    "is the only transfer mode"
)
BACKEND_REFUSED = (
    "is not implemented: the workers create their NIXL agents with UCX, the only backend "
    "they support"
)

Backend = Annotated[
    Literal["UCX", "GDS", "POSIX", "LIBFABRIC", "MOONCAKE"],
    Field(
        json_schema_extra={
            "maxLength": 16,  # bounds the CEL cost of the message below
            **_cel(
                {
                    "rule": f"self == '{SUPPORTED_BACKEND}'",
                    "message": f"this backend {BACKEND_REFUSED}",
                    "messageExpression": f"'backend ' + self + ' {BACKEND_REFUSED}'",
                }
            ),
        }
    ),
]


def _default_backends() -> list[Backend]:
    return ["UCX"]


class TransferSpec(_Model):
    mode: Literal["push", "pull"] = Field(
        default="push",
        description="push (the only mode implemented): the prefill engine writes the KV blocks "
        "into the decode engine's memory. pull is refused.",
        json_schema_extra=_cel({"rule": f"self == '{SUPPORTED_MODE}'", "message": PULL_REFUSED}),
    )
    backends: list[Backend] = Field(
        default_factory=_default_backends,
        min_length=1,
        max_length=4,
        description="NIXL backends, in order of preference; no duplicates. Only UCX is "
        "implemented (the workers create their NIXL agents with it); the others are refused.",
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
        default=5,
        ge=1,
        le=60,
        description="Deadline of one handshake: the operator sends it with every batch of "
        "peers it asks a worker to add, and the worker bounds each peer's metadata fetch and "
        "NIXL agent add by it (instead of its own default).",
    )
    max_concurrent: int = Field(
        default=64, ge=1, le=1024, description="Handshakes the operator drives at once."
    )
    progress_deadline_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="A pair whose handshake has kept failing this long makes the topology "
        "Degraded=True with reason HandshakeFailed (as a Deployment's progress deadline), "
        "naming the pod, its peer and the last error.",
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
        description="In-worker idle backstop (vLLM's engine_ttl): a worker evicts a peer "
        "that carried no transfer for this long (one the topology still pairs is added back "
        "at the operator's next round). The operator sets it on every worker it manages, "
        "overriding the worker's --idle-ttl; 0 turns it off.",
    )


class ReadinessGateSpec(_Model):
    min_connected_partners: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="A pod that lists the readiness gate kvtopo.dev/kv-connected "
        "(spec.readinessGates) gets that condition True once its engine is connected to at "
        "least this many of its partners (to all of them when it has fewer); an engine with "
        "no partner, or one the operator cannot reach, has it False. 0: True as soon as the "
        "operator reaches the engine. The operator sets the condition (pods/status); the "
        "kubelet makes the pod Ready once it and the containers are.",
    )


class AvailabilitySpec(_Model):
    """When the topology counts as Ready, as a Deployment's `available >= N` says it."""

    min_available_prefill: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="The topology is Ready once at least this many prefill engines are "
        "available (connected to at least readinessGate.minConnectedPartners of their "
        "partners, as their readiness gate says). Unset: every prefill engine, and every "
        "pair connected.",
    )
    min_available_decode: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="As minAvailablePrefill, for decode engines.",
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
    readiness_gate: ReadinessGateSpec = Field(default_factory=ReadinessGateSpec)
    availability: AvailabilitySpec = Field(default_factory=AvailabilitySpec)


# --- status ------------------------------------------------------------------------------


class ConditionType(enum.StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    CONFLICT = "Conflict"


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
    WORKER_ANSWER_REFUSED = "WorkerAnswerRefused"
    ENGINES_AVAILABLE = "EnginesAvailable"
    TOO_FEW_AVAILABLE = "TooFewAvailable"
    ENGINES_UNAVAILABLE = "EnginesUnavailable"
    ENDPOINT_REFUSED = "EndpointRefused"
    IDENTITY_MISMATCH = "IdentityMismatch"
    DUPLICATE_ENGINE_ID = "DuplicateEngineId"
    INVALID_SPEC = "InvalidSpec"
    ENGINES_UNPAIRED = "EnginesUnpaired"
    HEALTHY = "Healthy"
    FIRST_RECONCILE = "FirstReconcile"
    PODS_CLAIMED_ELSEWHERE = "PodsClaimedElsewhere"
    NO_CONFLICT = "NoConflict"


class EngineState(enum.StrEnum):
    PENDING = "Pending"
    HANDSHAKING = "Handshaking"
    CONNECTED = "Connected"
    DRAINING = "Draining"
    EVICTED = "Evicted"
    FAILED = "Failed"
    INCOMPATIBLE = "Incompatible"


class Condition(_Model):
    """One aspect of the topology's state, in the Kubernetes condition convention."""

    type: ConditionType = Field(
        description="Ready: every expected prefill/decode pair is Connected. Progressing: "
        "handshakes are to be made or gone engines are draining. Degraded: an engine is "
        "incompatible or its worker unreachable. Conflict: pods this topology selects are "
        "managed by an older KVTopology of the namespace (a pod belongs to at most one), "
        "which the message names with the pods."
    )
    status: Literal["True", "False", "Unknown"] = Field(
        description="Whether the condition holds: True, False or Unknown."
    )
    reason: str = Field(
        max_length=128,
        description="Why the condition has its status, one CamelCase word (e.g. "
        "AllPairsConnected, PairsMissing, NoEngines, Handshaking, Draining, Stable, "
        "Incompatible, WorkerUnreachable, Healthy, PodsClaimedElsewhere, NoConflict).",
    )
    message: str = Field(
        default="",
        max_length=1024,
        description="Human-readable details, e.g. how many pairs are connected or which "
        "workers are unreachable.",
    )
    last_transition_time: str = Field(
        max_length=MAX_TIMESTAMP,
        description="When the status last changed (RFC 3339, UTC); kept while only the "
        "reason or message changes.",
    )
    observed_generation: int = Field(
        default=0,
        description="The metadata.generation of the spec this condition was computed from.",
    )


class Summary(_Model):
    """Counts at a glance ("connected/total"), shown by `kubectl get kvt`. Pods managed by
    an older topology (see the Conflict condition) are not counted."""

    prefill: str = Field(
        default="0/0",
        max_length=MAX_SUMMARY,
        description="Available prefill engines (connected to at least "
        "readinessGate.minConnectedPartners of their partners, all of them when they have "
        "fewer) / prefill pods selected.",
    )
    decode: str = Field(
        default="0/0",
        max_length=MAX_SUMMARY,
        description="Available decode engines (as for prefill) / decode pods selected.",
    )
    pairs: str = Field(
        default="0/0",
        max_length=MAX_SUMMARY,
        description="Connected prefill/decode pairs / pairs that must be connected.",
    )


class EngineStatus(_Model):
    """One engine (a selected pod's worker) as the operator last saw it."""

    pod: str = Field(
        max_length=253, description="Name of the engine's pod (empty for an unknown peer)."
    )
    role: Literal["prefill", "decode"] = Field(description="The engine's role.")
    engine_id: str = Field(
        default="",
        max_length=256,
        description="The engine id its worker reports; a restarted engine gets a new one.",
    )
    endpoint: str = Field(
        default="",
        max_length=300,
        description="The worker's control endpoint (host:port) the operator calls.",
    )
    state: EngineState = Field(
        description="Pending: no peer to pair with. Handshaking: some of its pairs are not "
        "connected yet. Connected: all of its pairs are. Draining: the engine is gone and "
        "is kept for eviction.graceSeconds before it is evicted from its peers. Evicted: no "
        "peer holds it any more (listed for a few minutes). Failed: its worker is "
        "unreachable or reports another role. Incompatible: no engine of the other role in "
        "its pairing group has its compatibility hash, though some have another (during a "
        "compatibility rollout, an engine with partners of its own hash is paired with "
        "those)."
    )
    peers: int = Field(
        default=0, description="Remote engines the worker holds (those being evicted excluded)."
    )
    since: str = Field(
        max_length=MAX_TIMESTAMP,
        description="When the engine entered its current state (RFC 3339 with milliseconds, "
        "UTC); for a Draining engine, when it went, which starts the eviction grace.",
    )
    message: str = Field(
        default="",
        max_length=512,
        description="Human-readable details of the state, e.g. pairs connected or why the "
        "worker is unreachable.",
    )
    compat_hash: str = Field(
        default="",
        max_length=64,
        description="The worker's compatibility hash (model, KV layout, dtype, block size, "
        "transfer mode, protocol version); engines are paired only with equal hashes.",
    )
    failures_seen: dict[str, int] = Field(
        default_factory=dict,
        max_length=32,
        description="The failure counters last read from this engine's worker, by failure "
        "type: the baseline for the deltas that failures.counts accumulates, so totals "
        "survive worker and operator restarts.",
    )


class LastFailure(_Model):
    """The most recent failure, as reported by a worker or seen by the operator."""

    time: str = Field(max_length=MAX_TIMESTAMP, description="When it happened (RFC 3339, UTC).")
    type: str = Field(
        max_length=64,
        description="The failure type, one of the keys of failures.counts (e.g. "
        "handshake_failed, transfer_failed, kv_expired).",
    )
    engine_id: str = Field(
        default="",
        max_length=256,
        description="The engine whose worker reported it, or the peer a failed handshake "
        "was adding.",
    )
    pod: str = Field(
        default="", max_length=253, description="The pod of the worker that reported it."
    )
    request_id: str = Field(
        default="",
        max_length=256,
        description="The inference request it failed, where it concerned one.",
    )
    message: str = Field(
        default="", max_length=512, description="Human-readable details of the failure."
    )


class Failures(_Model):
    """Transfer failures of the topology's engines, accumulated across restarts."""

    counts: dict[str, int] = Field(
        default_factory=dict,
        max_length=32,
        description="Total failures by type, summed over every engine's workers; totals "
        "survive worker and operator restarts. The types are the worker protocol's: "
        f"{', '.join(t.value for t in FailureType)}; a type this operator does not know (from "
        "a newer worker) is counted as other.",
    )
    last: LastFailure | None = Field(
        default=None, description="The most recent failure counted; absent until one is."
    )


STALE_PEER_EXAMPLES = 5


class StalePeers(_Model):
    """Peers that engines of the topology hold and no pod of it owns (engines gone before
    the operator knew them, or made up by a worker): a count, never an engine line each."""

    count: int = Field(
        default=0,
        ge=0,
        description="Stale peers held by the topology's engines now, each evicted from its "
        "holders after the eviction grace.",
    )
    engine_ids: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list,
        max_length=STALE_PEER_EXAMPLES,
        description=f"Up to {STALE_PEER_EXAMPLES} of their engine ids, as examples.",
    )


class KVTopologyStatus(_Model):
    """The observed state of the topology, written by the operator."""

    observed_generation: int = Field(
        default=0,
        description="The metadata.generation of the spec the operator last reconciled.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        description="Ready, Progressing, Degraded and Conflict, one of each.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    summary: Summary = Field(
        default_factory=Summary,
        description="Usable engines and connected pairs at a glance (the printer columns); "
        "pods managed by an older topology (see the Conflict condition) are not counted.",
    )
    engines: list[EngineStatus] = Field(
        default_factory=list,
        max_length=MAX_ENGINES_IN_STATUS,
        description="Every selected engine with its state, ordered by role and pod, "
        "recently evicted ones last; at most 2048. The engines of pods managed by an older "
        "topology (see the Conflict condition) are not listed.",
    )
    engines_omitted: int = Field(
        default=0,
        ge=0,
        description="Engines left out of `engines` (beyond 2048 lines or the status's "
        "byte budget; evicted ones go first). The summary, conditions and counters are "
        "over every engine; each engine's worker reports its own detail (/v1/state).",
    )
    failures: Failures = Field(
        default_factory=Failures,
        description="Transfer failure counters by type and the most recent failure.",
    )
    stale_peers: StalePeers = Field(
        default_factory=StalePeers,
        description="Peers the engines hold that no pod of the topology owns (see "
        "StalePeers); they are counted here, not listed as engines.",
    )


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


# --- tolerant reading ----------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model class an annotation names (directly or as `Model | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if _model_of(a) is not None]
        return models[0] if len(models) == 1 else None
    return None


def _prune(model: type[BaseModel], data: Any, path: str, dropped: list[str]) -> Any:
    """`data` without the keys `model` does not know (recursively through nested models and
    lists of them); the paths of what was dropped are appended to `dropped`."""
    if not isinstance(data, dict):
        return data
    known: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        known[name] = info.annotation
        if info.alias:
            known[info.alias] = info.annotation
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            dropped.append(f"{path}.{key}")
            continue
        annotation = known[key]
        inner = _model_of(annotation)
        if inner is not None:
            out[key] = _prune(inner, value, f"{path}.{key}", dropped)
        elif get_origin(annotation) is list and isinstance(value, list):
            (item,) = get_args(annotation) or (Any,)
            item_model = _model_of(item)
            out[key] = [
                _prune(item_model, v, f"{path}.{key}[{i}]", dropped) if item_model else v
                for i, v in enumerate(value)
            ]
        else:
            out[key] = value
    return out


def read_tolerant(
    model: type[M], data: Any, path: str = "", *, drop_invalid: bool = True
) -> tuple[M, list[str]]:
    """Reads what a newer CRD or a newer operator may have written: fields this version does
    not know are ignored, and (`drop_invalid`) a list item or an optional field that does not
    validate (say an engine state added later) is left out, so the rest is kept; what was
    ignored is said in the returned list (JSON paths). Raises pydantic's ValidationError when
    what is left does not validate. A spec is read without `drop_invalid`: a value this
    operator cannot act on makes the spec invalid, never silently the default."""
    dropped: list[str] = []
    pruned = _prune(model, data if data is not None else {}, path, dropped)
    try:
        return model.model_validate(pruned), dropped
    except ValidationError:
        if not drop_invalid or not isinstance(pruned, dict):
            raise
    # Leave out what does not validate: a list item, or an optional field, at a time.
    required = {
        (info.alias or name) for name, info in model.model_fields.items() if info.is_required()
    }
    for _ in range(64):
        try:
            return model.model_validate(pruned), dropped
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            key = str(loc[0]) if loc else ""
            value = pruned.get(key)
            if len(loc) >= 2 and isinstance(value, list) and isinstance(loc[1], int):
                dropped.append(f"{path}.{key}[{loc[1]}]")
                pruned = {**pruned, key: [v for i, v in enumerate(value) if i != loc[1]]}
            elif key in pruned and key not in required:
                dropped.append(f"{path}.{key}")
                pruned = {k: v for k, v in pruned.items() if k != key}
            else:
                raise
    return model.model_validate(pruned), dropped
