"""Tolerant readers: what a newer CRD, operator or worker says and this operator does not know
is ignored and reported, never a skipped topology, a reset status or an "unreachable" worker.
Pure tables for the API models and the invalid-spec status; a real aiohttp server for the
worker client."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from kvtopo_operator.api import (
    EngineState,
    KVTopologySpec,
    KVTopologyStatus,
    Reason,
    dump,
    read_tolerant,
)
from kvtopo_operator.logic import invalid_spec
from kvtopo_operator.model import WorkerView
from tests.operator.test_workers import read_state

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SPEC = {
    "prefill": {"selector": {"matchLabels": {"app": "llama", "role": "p"}}},
    "decode": {"selector": {"matchLabels": {"app": "llama", "role": "d"}}},
}


def engine(pod: str, state: str, **extra: Any) -> dict[str, Any]:
    return {
        "pod": pod,
        "role": "decode",
        "engineId": f"e-{pod}",
        "endpoint": "10.0.0.1:8975",
        "state": state,
        "since": "2026-12-01T11:00:00.000Z",
        **extra,
    }


def test_unknown_fields_of_a_newer_crd_are_ignored_and_named() -> None:
    data = {
        **SPEC,
        "futureField": {"x": 1},
        "transfer": {"mode": "push", "compression": "lz4"},
        "eviction": {"graceSeconds": 5, "graceJitter": 1},
    }
    spec, ignored = read_tolerant(KVTopologySpec, data, ".spec", drop_invalid=False)
    assert spec.eviction.grace_seconds == 5
    assert sorted(ignored) == [
        ".spec.eviction.graceJitter",
        ".spec.futureField",
        ".spec.transfer.compression",
    ]
    with pytest.raises(ValidationError):  # the strict read refuses the same object
        KVTopologySpec.model_validate(data)


@pytest.mark.parametrize(
    "bad",
    [
        {"transfer": {"mode": "stream"}},  # a value this operator has no path for
        {"handshake": {"timeoutSeconds": -1}},
        {"controlPort": "many"},
    ],
)
def test_a_spec_that_does_not_validate_once_unknown_fields_are_ignored_is_invalid(
    bad: dict[str, Any],
) -> None:
    with pytest.raises(ValidationError):
        read_tolerant(KVTopologySpec, {**SPEC, **bad}, ".spec", drop_invalid=False)


def test_a_newer_operators_status_keeps_everything_this_one_understands() -> None:
    status = {
        "observedGeneration": 4,
        "futureCounter": 3,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllPairsConnected",
                "lastTransitionTime": "2026-12-01T11:00:00Z",
                "observedGeneration": 4,
                "severity": "Info",
            },
            {  # a condition type added later
                "type": "Quarantined",
                "status": "False",
                "reason": "None",
                "lastTransitionTime": "2026-12-01T11:00:00Z",
            },
        ],
        "engines": [
            engine("a", "Quarantined"),  # a state added later
            engine("b", "Connected", failuresSeen={"gpu_oom": 2}, healthScore=0.9),
        ],
        "failures": {"counts": {"transfer_failed": 7, "gpu_oom": 2}, "window": "1h"},
    }
    read, ignored = read_tolerant(KVTopologyStatus, status, ".status")
    # Counters and timers survive: nothing is reset for a field or a value not known here.
    assert read.failures.counts == {"transfer_failed": 7, "gpu_oom": 2}
    assert read.observed_generation == 4
    assert [(e.pod, e.state) for e in read.engines] == [("b", EngineState.CONNECTED)]
    assert read.engines[0].failures_seen == {"gpu_oom": 2}
    assert [c.type.value for c in read.conditions] == ["Ready"]
    assert sorted(ignored) == [
        ".status.conditions[0].severity",
        ".status.conditions[1]",
        ".status.engines[0]",
        ".status.engines[1].healthScore",
        ".status.failures.window",
        ".status.futureCounter",
    ]


def test_an_unreadable_spec_says_so_and_keeps_the_status() -> None:
    previous, _ = read_tolerant(
        KVTopologyStatus,
        {
            "engines": [engine("b", "Connected")],
            "failures": {"counts": {"transfer_failed": 7}},
        },
    )
    status, events = invalid_spec(previous, 6, "spec.transfer.mode: bad", NOW)
    conditions = {c.type.value: (c.status, c.reason) for c in status.conditions}
    assert conditions == {
        "Ready": ("False", Reason.INVALID_SPEC.value),
        "Progressing": ("False", Reason.INVALID_SPEC.value),
        "Degraded": ("True", Reason.INVALID_SPEC.value),
    }
    assert status.observed_generation == 6
    assert dump(status)["engines"] == dump(previous)["engines"]
    assert status.failures == previous.failures
    assert [e.reason for e in events] == ["InvalidSpec"]
    again, events = invalid_spec(status, 6, "spec.transfer.mode: bad", NOW)
    assert events == () and dump(again) == dump(status), "one Event, on the transition"


def test_a_newer_worker_is_read_not_called_unreachable() -> None:
    state = {
        "engine_id": "w1",
        "role": "decode",
        "compat_hash": "h",
        "protocol_version": 9,
        "peers": [
            {
                "engine_id": "p1",
                "agents": {"0": "a"},
                "transfers_in_flight": 0,
                "eviction_pending": False,
                "idle_s": 0.0,
                "incarnation": "i1",
                "health": "ok",
            },
        ],
        "failures": {"gpu_oom": 3, "transfer_failed": 1},
        "requests_done": 0,
        "requests_failed": 0,
        "requests_in_flight": 0,
        "started_at": 0.0,
        "last_failure": {"time": 5.0, "type": "gpu_oom", "message": "out of memory"},
        "incarnation": "boot",
        "pod": {"namespace": "ns", "name": "d", "uid": "u1", "node": "n1"},
        "accelerator": "h200",
    }

    def body() -> object:
        return read_state(state, 2.0)

    view = body()
    assert isinstance(view, WorkerView), view
    # One closed vocabulary in the status: a type this operator does not know is "other".
    assert view.failures == {"other": 3, "transfer_failed": 1}
    assert view.last_failure is not None and view.last_failure.type == "other"
    assert view.last_failure.message == "(gpu_oom) out of memory"
    assert (view.pod_uid, view.incarnation) == ("u1", "boot")
    assert view.peer_incarnations == {"p1": "i1"}


def test_a_prefill_holding_thousands_of_peers_is_read_whole() -> None:
    """A state answer far larger than one network read (here 3,000 peers, about 400 KB) is
    read to its end: read with one `StreamReader.read`, it was truncated and the worker
    called unreachable ("DecodeError: Input data was truncated"), which kept a 32 x 1000
    topology from ever converging."""
    peer = {"agents": {"0": "agent-name"}, "transfers_in_flight": 0, "eviction_pending": False}
    state = {
        "engine_id": "p0",
        "role": "prefill",
        "compat_hash": "h",
        "protocol_version": 4,
        "peers": [
            {**peer, "engine_id": f"decode-{i:05d}", "idle_s": 0.0, "incarnation": f"i{i}"}
            for i in range(3000)
        ],
        "failures": {},
        "requests_done": 0,
        "requests_failed": 0,
        "requests_in_flight": 0,
        "started_at": 0.0,
    }

    def body() -> object:
        return read_state(state, 5.0)

    view = body()
    assert isinstance(view, WorkerView), view
    assert len(view.peers) == 3000
