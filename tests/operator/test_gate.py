"""The readiness gate's decision (`gate.wanted`, `gate.gate_changes`) as a table."""

from __future__ import annotations

import pytest

from kvtopo_operator.gate import gate_changes, wanted
from kvtopo_operator.model import (
    PodView,
    Progress,
)


def pod(name: str, *, gate: str = "", ready: bool = True, deleting: bool = False) -> PodView:
    return PodView(
        name=name,
        role="decode",
        labels={},
        ready=ready,
        deleting=deleting,
        endpoint="127.0.0.9:1",
        gated=True,
        gate=gate,
    )


@pytest.mark.parametrize(
    ("view", "engine", "partners", "minimum", "want"),
    [
        # (connected, expected) partners against minConnectedPartners
        (pod("d"), "e", (1, 1), 1, ("True", "KVConnected", "1/1 partners connected")),
        (pod("d"), "e", (0, 1), 1, ("False", "KVNotConnected", "0/1 partners connected, 1 needed")),
        (pod("d"), "e", (1, 3), 2, ("False", "KVNotConnected", "1/3 partners connected, 2 needed")),
        (pod("d"), "e", (2, 3), 2, ("True", "KVConnected", "2/3 partners connected")),
        (pod("d"), "e", (1, 1), 4, ("True", "KVConnected", "1/1 partners connected")),  # all it has
        (pod("d"), "e", (0, 0), 1, ("False", "NoPartner", "no partner to connect to")),
        (pod("d"), "e", (0, 0), 0, ("True", "KVConnected", "the engine is reached")),
        (pod("d"), None, (0, 0), 0, ("False", "EngineNotUsable", None)),  # unreachable, refused
        (pod("d", ready=False), "e", (1, 1), 1, ("False", "EngineNotUsable", None)),
        (pod("d", deleting=True), "e", (1, 1), 1, ("False", "EngineNotUsable", None)),
    ],
)
def test_the_wanted_condition(
    view: PodView,
    engine: str | None,
    partners: tuple[int, int],
    minimum: int,
    want: tuple[str, str, str | None],
) -> None:
    got = wanted(view, engine, partners, minimum)
    assert (got.status, got.reason) == want[:2]
    if want[2] is not None:
        assert got.message == want[2]


def test_only_gated_pods_whose_condition_differs_are_written() -> None:
    progress = Progress(
        pairs_expected=2,
        missing=frozenset({("p", "d2")}),
        pair_counts={"p": (1, 2), "d1": (1, 1), "d2": (0, 1)},
        live=(("p0", "p"), ("d1", "d1"), ("d2", "d2")),
    )
    pods = [
        pod("p0", gate="False"),  # 1/2 connected, 1 needed: True now
        pod("d1", gate="True"),  # already True: no write
        pod("d2"),  # not set yet: False
        PodView("d3", "decode", {}, True, False, "127.0.0.9:1"),  # no gate: never written
    ]
    changes = gate_changes(pods, progress, 1)
    assert [(c.pod, c.status) for c in changes] == [("d2", "False"), ("p0", "True")]


def test_a_false_gate_is_rewritten_when_its_reason_changes_and_keeps_its_transition_time() -> None:
    """On 7314fe4 a False gate kept the reason it turned False for (`NotSelected` after the
    pod was selected again). Its reason is written when it changes; the status did not
    change, so its lastTransitionTime is left as it was (`transition`)."""
    from dataclasses import replace

    from kvtopo_operator.gate import transition

    stale = replace(pod("d0", gate="False"), gate_reason="NotSelected")
    progress = Progress(live=(("d0", "D0"),), pair_counts={"D0": (0, 1)})
    (change,) = gate_changes([stale], progress, 1)
    assert (change.status, change.reason) == ("False", "KVNotConnected")
    assert not transition(change, stale)
    said = replace(stale, gate_reason="KVNotConnected")
    assert gate_changes([said], progress, 1) == ()


def test_what_a_round_cannot_tell_never_turns_a_true_gate_false() -> None:
    """Fail-static: a gated pod whose worker is unread (a new leader's first rounds) or
    unreachable from the operator keeps a True gate, and so does a partner whose missing
    partners could be it; a pod going, or an engine whose own worker says it lacks
    partners, is turned False."""
    d0, d1, p0 = pod("d0", gate="True"), pod("d1", gate="True"), pod("p0", gate="True")
    progress = Progress(
        live=(("d1", "D1"), ("p0", "P0")),
        pair_counts={"D1": (0, 0), "P0": (0, 0)},  # d0 unread: P0 expects no partner
        cannot_tell={"d0": "its worker is not read yet"},
        maybe_partners={"P0": 1},  # P0 holds D0, the engine d0's pod last had
    )
    changes = {c.pod: c for c in gate_changes([d0, d1, p0], progress, 1)}
    assert set(changes) == {"d1"}, changes  # d1's own view: no partner
    assert changes["d1"].reason == "NoPartner"
    going = replace_pod(d0, deleting=True)
    assert [c.pod for c in gate_changes([going], progress, 1)] == ["d0"]


def replace_pod(p: PodView, **kw: object) -> PodView:
    from dataclasses import replace

    return replace(p, **kw)  # type: ignore[arg-type]
