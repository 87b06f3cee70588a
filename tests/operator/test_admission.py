"""Admissions: the engines that arrive between the rounds are connected at once.

`logic.admission_handshakes`: the halves that connect the engines arrived since the last
round are exactly the halves of them that the round's own pairing (`pair_engines`) would
plan, whatever the engines hold, their versions, compatibility hashes and incarnations.
`Reconciler._admit` (the real constructor, the fakes of `tests.operator.fakes`): an engine
that arrives while a round is stuck is connected before that round ends, and an arrival
whose worker is another pod's, or reports an engine id already taken, is not."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo_operator.logic import Usable, admission_handshakes, pair_engines
from tests.operator.fakes import FakeKube, RecordingWorkers
from tests.operator.test_policies import live, spec, usable
from tests.operator.test_reconcile import KEY, build, topology_body, until
from tests.operator.test_reconcile import pod as rpod

NAMES = [f"p{i}" for i in range(4)] + [f"d{i}" for i in range(6)]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[dict[str, Usable], set[str]]:
    """Engines with random versions, hashes and holdings; some of them arrived."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, unique=True))
    ids = [n.upper() for n in names]
    engines = []
    for n in names:
        held = draw(st.sets(st.sampled_from(ids))) - {n.upper()}
        stale = draw(st.sets(st.sampled_from(sorted(held)))) if held else set()
        e = usable(
            n,
            held,
            version=draw(st.sampled_from(["v1", "v2"])),
            compat_hash=draw(st.sampled_from(["h", "h", "h2"])),
            evicting=frozenset(draw(st.sets(st.sampled_from(sorted(held))))) if held else (),
        )
        # A peer held at another incarnation (it restarted), or reported unhealthy, is not
        # held as it is now.
        incarnations = dict(e.worker.peer_incarnations)
        incarnations.update({s: "old" for s in stale})
        sick = draw(st.sets(st.sampled_from(sorted(held)))) if held else set()
        view = dataclasses.replace(
            e.worker,
            peer_incarnations=incarnations,
            unhealthy_peers={s: "health: dropped" for s in sick},
        )
        engines.append(Usable(e.pod, view))
    arrived = draw(st.sets(st.sampled_from(ids)))
    return live(*engines), arrived


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_admission_plans_what_the_round_would_of_the_arrivals(
    fleet: tuple[dict[str, Usable], set[str]],
) -> None:
    engines, arrived = fleet
    arrivals = {eid: e for eid, e in engines.items() if eid in arrived}
    known = {eid: e for eid, e in engines.items() if eid not in arrived}
    round_halves = {
        h
        for h in pair_engines(spec(), engines).handshakes
        if h.engine_id in arrived or h.peer_engine_id in arrived
    }
    assert set(admission_handshakes(spec(), arrivals, known)) == round_halves


def test_no_arrival_no_half_and_known_pairs_are_left_to_the_round() -> None:
    p0, d0, d1 = usable("p0"), usable("d0"), usable("d1", {"P0"})
    # p0 and d0 are known and not connected: the round's business, not the admission's.
    assert admission_handshakes(spec(), {}, live(p0, d0, d1)) == ()
    halves = admission_handshakes(spec(), live(d1), live(p0, d0))
    # d1 holds p0 already; p0 lacks d1; nothing of p0 and d0.
    assert [(h.pod, h.peer_engine_id) for h in halves] == [("p0", "D1")]


class HeldKube(FakeKube):
    """A kube whose topology reads wait while `held` is set: a round stuck at its start, as
    one that takes seconds at 2,000 engines."""

    def __init__(self, bodies: dict[str, dict[str, Any]]) -> None:
        super().__init__(bodies)
        self.released = asyncio.Event()
        self.released.set()
        self.waiting = 0

    async def get_topology(self, namespace: str, name: str) -> dict[str, Any] | None:
        if not self.released.is_set():
            self.waiting += 1
            await self.released.wait()
        return await super().get_topology(namespace, name)


@pytest.mark.asyncio
@pytest.mark.parametrize("admissions", [True, False])
async def test_an_engine_arriving_during_a_round_is_connected_before_the_next(
    admissions: bool,
) -> None:
    p0, d0, d1 = rpod("p0", "prefill"), rpod("d0", "decode"), rpod("d1", "decode")
    # d2's worker says it runs in another pod; d3's worker reports d0's engine id.
    d2, d3 = rpod("d2", "decode"), rpod("d3", "decode")
    pods = [p0, d0]
    kube = HeldKube({"llama": topology_body()})
    workers = RecordingWorkers.for_pods([p0, d0, d1, d2, d3])
    workers.views[d2.endpoint] = dataclasses.replace(
        workers.views[d2.endpoint],  # type: ignore[arg-type]
        pod_uid="uid-somebody-else",
    )
    workers.views[d3.endpoint] = dataclasses.replace(
        workers.views[d3.endpoint],  # type: ignore[arg-type]
        engine_id="D0",
    )
    reconciler = build(lambda: list(pods), kube, workers)
    reconciler.settings.admissions = admissions
    reconciler.settings.max_gap_s = 0.0
    try:
        reconciler.ensure(KEY)
        await until("the first pair", lambda: workers.peers_of(p0.endpoint) == {"D0"})
        await until("the first round over", lambda: "status" in kube.bodies["llama"])
        kube.released.clear()  # the next round sticks at its start
        reconciler.poke_namespace("ns")
        await until("a round stuck", lambda: kube.waiting > 0)
        pods.extend([d1, d2, d3])
        reconciler.poke_namespace("ns")
        if not admissions:
            # Without admissions the arrival waits for the round under way and the next.
            with pytest.raises(AssertionError, match="timed out"):
                await until("d1 connected", lambda: workers.peers_of(d1.endpoint) == {"P0"}, 1.0)
            return
        await until("d1 connected", lambda: workers.peers_of(d1.endpoint) == {"P0"})
        await until("p0 holds D1", lambda: workers.peers_of(p0.endpoint) == {"D0", "D1"})
        assert kube.waiting == 1  # no round ended meanwhile
        # Neither the worker of another pod nor the duplicate engine id got or gave a peer.
        assert workers.peers_of(d2.endpoint) == workers.peers_of(d3.endpoint) == frozenset()
        sample = reconciler.metrics.registry.get_sample_value
        assert sample("kvtopo_operator_admission_handshakes_total") == 2
        kube.released.set()
        # The round after counts the pair it did not make; d0 and d3 share an engine id:
        # neither is usable (d0's pair with p0 is no pair any more), nor is d2.
        await until(
            "the round after counts the pair",
            lambda: (
                kube.bodies["llama"]["status"]["summary"]
                == {
                    "prefill": "1/1",
                    "decode": "1/4",
                    "pairs": "1/1",
                }
            ),
        )
    finally:
        kube.released.set()
        await reconciler.stop()
