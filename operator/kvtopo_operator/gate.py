"""The readiness gate `kvtopo.dev/kv-connected`: which pods' gate condition must change.

Owns the pure decision behind the gate. A pod that lists the gate in `spec.readinessGates`
is Ready only once the operator sets the condition True; the operator does so once the
pod's engine is connected to at least `spec.readinessGate.minConnectedPartners` of its
partners (all of them when it has fewer), from the outcome of the round's acting (`settle`'s
`Progress`). An engine with no partner, one the operator cannot use (unreachable, refused,
another pod's), or a pod being deleted has it False. Only pods whose condition differs from
the wanted one are named, so an unchanged pod costs no API call. No I/O; called by
`kvtopo_operator.reconcile`, which patches `pods/status`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtopo_operator.model import (
    PodView,
    Progress,
)

CONNECTED = "KVConnected"
NOT_CONNECTED = "KVNotConnected"
NO_PARTNER = "NoPartner"
NOT_USABLE = "EngineNotUsable"
NOT_SELECTED = "NotSelected"


@dataclass(frozen=True, order=True)
class GateChange:
    """Set pod `pod`'s kv-connected condition to `status` ("True" or "False")."""

    pod: str
    status: str
    reason: str
    message: str


def wanted(
    pod: PodView, engine_id: str | None, partners: tuple[int, int], minimum: int
) -> GateChange:
    """The condition pod `pod` should have: `engine_id` is its usable engine (None: none),
    `partners` (connected, expected) its pairs."""
    if pod.deleting or not pod.ready or engine_id is None:
        why = (
            "the pod is being deleted" if pod.deleting else "no usable engine (see the KVTopology)"
        )
        return GateChange(pod.name, "False", NOT_USABLE, why)
    ok, total = partners
    if minimum == 0:
        return GateChange(pod.name, "True", CONNECTED, "the engine is reached")
    if total == 0:
        return GateChange(pod.name, "False", NO_PARTNER, "no partner to connect to")
    need = min(minimum, total)
    if ok >= need:
        return GateChange(pod.name, "True", CONNECTED, f"{ok}/{total} partners connected")
    return GateChange(
        pod.name, "False", NOT_CONNECTED, f"{ok}/{total} partners connected, {need} needed"
    )


def transition(change: GateChange, pod: PodView | None) -> bool:
    """Whether writing `change` changes the condition's status (its lastTransitionTime is
    then written too; a write of the reason alone keeps it)."""
    return pod is None or pod.gate != change.status


def stray_gates(
    pods: Iterable[PodView], selected: Iterable[str], topologies: Iterable[str]
) -> tuple[GateChange, ...]:
    """Pods whose gate is True that no KVTopology of the namespace selects any more (a
    relabel, a selector edit, their topology deleted): their condition turns False, so a
    Service stops sending them traffic their engine may not be able to serve. `selected`:
    the names of the pods some topology selects; `topologies`: the namespace's topologies
    (named in the message)."""
    chosen = set(selected)
    names = ", ".join(sorted(topologies)) or "none"
    return tuple(
        GateChange(
            p.name,
            "False",
            NOT_SELECTED,
            f"no KVTopology selects the pod (the namespace has: {names})"[:256],
        )
        for p in sorted(pods, key=lambda p: p.name)
        if p.gated and p.gate == "True" and p.name not in chosen
    )


def gate_changes(
    pods: Iterable[PodView], progress: Progress, minimum: int
) -> tuple[GateChange, ...]:
    """The gate conditions to write: one per gated pod whose condition is not the wanted
    one, given the pairs after acting (`progress`) and the spec's minConnectedPartners.

    Fail-static: a gate that is True turns False only on something known against the
    engine (its pod going or not up, its worker's own answer, a refusal of it), never for
    what the round cannot tell (`progress.cannot_tell`: a worker not read yet or
    unreachable from the operator). Its own gate stays True, and so does a partner's
    whose missing partners could be it (`progress.maybe_partners`)."""
    engine_of: dict[str, str] = dict(progress.live)
    partners = progress.pair_counts or {}  # engine id -> (connected, expected)
    unknown, maybe = progress.cannot_tell, progress.maybe_partners
    changes = []
    for pod in pods:
        if not pod.gated:
            continue
        if pod.gate == "True" and pod.name in unknown and pod.ready and not pod.deleting:
            continue  # nothing known against it: kept
        engine = engine_of.get(pod.name)
        counts = partners.get(engine or "", (0, 0))
        change = wanted(pod, engine, counts, minimum)
        if (
            change.status == "False"
            and pod.gate == "True"
            and engine is not None
            and engine in maybe
        ):
            extra = maybe[engine]
            benefit = wanted(pod, engine, (counts[0] + extra, counts[1] + extra), minimum)
            if benefit.status == "True":
                continue  # its missing partners may be engines the round cannot judge
        if change.status != pod.gate or (
            change.status == "False" and change.reason != pod.gate_reason
        ):
            changes.append(change)  # a False gate says why now, not why it turned False
    return tuple(sorted(changes))
