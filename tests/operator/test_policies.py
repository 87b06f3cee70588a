"""Each of `evaluate`'s policies on its own, as tables: which engines are usable, which
pairs are expected and connected and which handshakes are missing, which engines are gone,
which evictions are due, how failure counters add up, each engine's status line, the
topology-wide Events and the idle-TTL settings. `test_logic.py` covers their chain."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kvtopo_operator.api import (
    EngineState,
    EngineStatus,
    Failures,
    KVTopologySpec,
    KVTopologyStatus,
    Reason,
)
from kvtopo_operator.logic import (
    Engines,
    Gone,
    Usable,
    engine_statuses,
    evictions_due,
    gone_engines,
    idle_ttl_changes,
    pair_engines,
    tally_failures,
    topology_events,
    usable_engines,
)
from kvtopo_operator.model import (
    Eviction,
    FailureView,
    Memory,
    Observed,
    PodView,
    WorkerUnreachable,
    WorkerView,
    precise,
)

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
GRACE = timedelta(seconds=10)


def spec(**extra: object) -> KVTopologySpec:
    return KVTopologySpec.model_validate(
        {
            "prefill": {"selector": {"matchLabels": {"kvtopo.dev/role": "prefill"}}},
            "decode": {"selector": {"matchLabels": {"kvtopo.dev/role": "decode"}}},
            "pairing": {"matchLabels": ["version"]},
            "eviction": {"graceSeconds": 10, "idleTTLSeconds": 30},
            **extra,
        }
    )


def pod(name: str, version: str = "v1", **kw: object) -> PodView:
    role = "prefill" if name.startswith("p") else "decode"
    fields: dict[str, object] = {
        "name": name,
        "role": role,
        "labels": {"kvtopo.dev/role": role, "version": version},
        "ready": True,
        "deleting": False,
        "endpoint": f"127.0.0.1:{9000 + int(name[1:])}",
        "uid": f"uid-{name}",
    }
    return PodView(**{**fields, **kw})  # type: ignore[arg-type]


def worker(name: str, peers: set[str] = frozenset(), **kw: object) -> WorkerView:  # type: ignore[assignment]
    role = "prefill" if name.startswith("p") else "decode"
    fields: dict[str, object] = {
        "engine_id": name.upper(),
        "role": role,
        "compat_hash": "h",
        "peers": frozenset(peers),
        "pod_uid": f"uid-{name}",
        "incarnation": f"i-{name}",
        "peer_incarnations": {p: f"i-{p.lower()}" for p in peers},
    }
    return WorkerView(**{**fields, **kw})  # type: ignore[arg-type]


def usable(name: str, peers: set[str] = frozenset(), version: str = "v1", **kw: object) -> Usable:
    return Usable(pod(name, version), worker(name, peers, **kw))


def live(*engines: Usable) -> dict[str, Usable]:
    return {e.worker.engine_id: e for e in engines}


def observed(previous: list[EngineStatus] = (), **kw: object) -> Observed:  # type: ignore[assignment]
    fields: dict[str, object] = {
        "generation": 1,
        "spec": spec(),
        "pods": (),
        "workers": {},
        "previous": KVTopologyStatus(engines=list(previous)),
    }
    return Observed(**{**fields, **kw})  # type: ignore[arg-type]


def line(
    name: str, state: EngineState, since: datetime = T0, pod_name: str | None = None
) -> EngineStatus:
    role = "prefill" if name.startswith("p") else "decode"
    return EngineStatus(
        pod=name if pod_name is None else pod_name,
        role=role,  # type: ignore[arg-type]
        engine_id=name.upper(),
        state=state,
        since=precise(since),
    )


# --- usable_engines ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "read", "want"),
    [
        (pod("d0"), worker("d0"), "live"),
        (pod("d0", ready=False), worker("d0"), None),  # not up: not considered at all
        (pod("d0", deleting=True), worker("d0"), None),
        (pod("d0", endpoint=""), worker("d0"), None),  # no address yet
        (pod("d0"), None, None),  # not read yet
        (pod("d0", endpoint_error="a host"), None, Reason.ENDPOINT_REFUSED),
        (pod("d0"), WorkerUnreachable("refused"), Reason.WORKER_UNREACHABLE),
        (pod("d0"), worker("d0", pod_uid="uid-other"), Reason.IDENTITY_MISMATCH),
        (pod("d0"), worker("d0", role="prefill"), Reason.WORKER_UNREACHABLE),
    ],
)
def test_usable_engines(view: PodView, read: object, want: object) -> None:
    engines = usable_engines([view], {} if read is None else {"d0": read})  # type: ignore[dict-item]
    if want == "live":
        assert list(engines.live) == ["D0"] and not engines.unusable
    elif want is None:
        assert not engines.live and not engines.unusable
    else:
        assert not engines.live and engines.unusable["d0"][2] == want


# --- pair_engines ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p0", "d0", "expected", "connected", "halves"),
    [
        (usable("p0", {"D0"}), usable("d0", {"P0"}), 1, 1, set()),
        (usable("p0"), usable("d0"), 1, 0, {("p0", "D0"), ("d0", "P0")}),
        (usable("p0", {"D0"}), usable("d0"), 1, 0, {("d0", "P0")}),
        # held under the decode's previous incarnation: the half is made again
        (
            usable("p0", {"D0"}, peer_incarnations={"D0": "old"}),
            usable("d0", {"P0"}),
            1,
            0,
            {("p0", "D0")},
        ),
        # held while being evicted, or reported unhealthy: made again
        (
            usable("p0", {"D0"}, evicting=frozenset({"D0"})),
            usable("d0", {"P0"}),
            1,
            0,
            {("p0", "D0")},
        ),
        (
            usable("p0", {"D0"}, unhealthy_peers={"D0": "dropped: disconnect"}),
            usable("d0", {"P0"}),
            1,
            0,
            {("p0", "D0")},
        ),
        (usable("p0"), usable("d0", version="v2"), 0, 0, set()),  # not paired (version)
        (usable("p0"), usable("d0", compat_hash="other"), 0, 0, set()),  # incompatible
    ],
)
def test_pair_engines(
    p0: Usable, d0: Usable, expected: int, connected: int, halves: set[tuple[str, str]]
) -> None:
    pairing = pair_engines(spec(), live(p0, d0))
    assert len(pairing.expected) == expected and len(pairing.connected) == connected
    assert {(h.pod, h.peer_engine_id) for h in pairing.handshakes} == halves
    if d0.worker.compat_hash != p0.worker.compat_hash:
        assert set(pairing.incompatible) == {"P0", "D0"}
    if p0.worker.unhealthy_peers:
        assert pairing.unhealthy == {("P0", "D0"): ("p0", "d0", "dropped: disconnect")}


def test_a_handshake_names_the_peer_pod_and_incarnation() -> None:
    [half] = pair_engines(spec(), live(usable("p0", {"D0"}), usable("d0"))).handshakes
    assert (half.pod, half.peer_engine_id, half.peer_role) == ("d0", "P0", "prefill")
    assert (half.peer_pod_uid, half.peer_incarnation, half.pair) == ("uid-p0", "i-p0", ("P0", "D0"))


# --- gone_engines ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("previous", "engines", "claimed", "gone"),
    [
        ([line("d0", EngineState.CONNECTED)], Engines({}, {}), {}, {"D0"}),  # its pod went
        ([line("d0", EngineState.CONNECTED)], Engines(live(usable("d0")), {}), {}, set()),
        ([line("d0", EngineState.EVICTED)], Engines({}, {}), {}, set()),  # evicted: done
        # its worker cannot be read: nobody can tell, it is kept as it was
        (
            [line("d0", EngineState.FAILED)],
            Engines({}, {"d0": (pod("d0"), "refused", Reason.WORKER_UNREACHABLE)}),
            {},
            set(),
        ),
        # its pod belongs to an older topology now: handed over
        ([line("d0", EngineState.CONNECTED)], Engines({}, {}), {"d0": "older"}, set()),
        # a stale peer a live engine holds, unknown to the status
        ([], Engines(live(usable("p0", {"D9"})), {}), {}, {"D9"}),
        # held by a live engine, its own pod's worker unreadable: kept as well
        (
            [line("d0", EngineState.FAILED)],
            Engines(
                live(usable("p0", {"D0"})),
                {"d0": (pod("d0"), "refused", Reason.WORKER_UNREACHABLE)},
            ),
            {},
            set(),
        ),
    ],
)
def test_gone_engines(
    previous: list[EngineStatus], engines: Engines, claimed: dict[str, str], gone: set[str]
) -> None:
    assert set(gone_engines(observed(previous, claimed=claimed), engines, T0)) == gone


def test_a_gone_engine_keeps_its_first_gone_time_from_the_memory() -> None:
    memory = Memory(gone_since={"D0": T0 - timedelta(seconds=7)})
    obs = observed([line("d0", EngineState.CONNECTED)], memory=memory)
    assert gone_engines(obs, Engines({}, {}), T0)["D0"].since == T0 - timedelta(seconds=7)


# --- evictions_due -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gone_for", "evicted", "due_in"),
    [(timedelta(seconds=3), (), (7.0,)), (GRACE, (Eviction("p0", "127.0.0.1:9000", "D0"),), ())],
)
def test_a_gone_engine_is_evicted_from_its_holders_after_the_grace(
    gone_for: timedelta, evicted: tuple[Eviction, ...], due_in: tuple[float, ...]
) -> None:
    engines = live(usable("p0", {"D0"}))
    gone = {"D0": Gone("d0", "decode", "127.0.0.1:9100", T0 - gone_for)}
    pairing = pair_engines(spec(), engines)
    got = evictions_due(engines, gone, pairing, Memory(), GRACE, T0)
    assert (got.evictions, got.due_in, got.still_held) == (evicted, due_in, {"D0": 1})


@pytest.mark.parametrize(("since", "evicted"), [(T0, False), (T0 - GRACE, True)])
def test_a_connection_no_longer_paired_is_evicted_after_the_grace(
    since: datetime, evicted: bool
) -> None:
    engines = live(usable("p0", {"D0"}), usable("d0", {"P0"}, version="v2"))  # not paired now
    memory = Memory(unpairing_since={("P0", "D0"): since, ("D0", "P0"): since})
    got = evictions_due(engines, {}, pair_engines(spec(), engines), memory, GRACE, T0)
    assert set(got.unpairing) == {("P0", "D0"), ("D0", "P0")}
    assert len(got.evictions) == (2 if evicted else 0)


# --- tally_failures ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("baseline", "now", "total", "new"),
    [
        ({"transfer_failed": 2}, 5, 10 + 3, 3),  # grew by 3 since last read
        ({"transfer_failed": 2}, 2, 10, 0),  # nothing new
        ({"transfer_failed": 7}, 4, 10 + 4, 4),  # went down: the worker restarted
        ({}, 4, 10 + 4, 4),  # never read before
    ],
)
def test_failure_counters_add_their_growth(
    baseline: dict[str, int], now: int, total: int, new: int
) -> None:
    failure = FailureView(time=T0.timestamp(), type="transfer_failed", engine_id="P0")
    engines = live(usable("d0", failures={"transfer_failed": now}, last_failure=failure))
    memory = Memory(baselines={"D0": baseline}, counts={"transfer_failed": 10})
    tally = tally_failures(engines, KVTopologyStatus(failures=Failures()), memory)
    assert tally.counts == {"transfer_failed": total}
    assert dict(tally.new) == ({"transfer_failed": new} if new else {})
    assert (tally.last is not None) == bool(new)
    assert tally.seen_now == {"D0": {"transfer_failed": now}}


# --- engine_statuses ---------------------------------------------------------------------------


def test_engine_statuses_from_pairs_failures_and_gone_engines() -> None:
    engines = Engines(
        live(usable("p0", {"D0"}), usable("d0", {"P0"}), usable("d1"), usable("d2", version="v9")),
        {"d3": (pod("d3"), "worker unreachable: refused", Reason.WORKER_UNREACHABLE)},
    )
    pairing = pair_engines(spec(), engines.live)
    gone = {
        "D4": Gone("d4", "decode", "", T0 - timedelta(seconds=2)),  # held, in its grace
        "D5": Gone("d5", "decode", "", T0 - GRACE),  # held by nobody, grace over
    }
    evicting = evictions_due(engines.live, gone, pairing, Memory(), GRACE, T0)
    tally = tally_failures(engines.live, KVTopologyStatus(), Memory())
    previous = [line("d5", EngineState.DRAINING)]
    statuses, events = engine_statuses(
        observed(previous), engines, pairing, gone, evicting, tally, T0
    )
    states = {s.pod: s.state for s in statuses}
    assert states == {
        "p0": EngineState.HANDSHAKING,  # 1 of its 2 pairs
        "d0": EngineState.CONNECTED,
        "d1": EngineState.HANDSHAKING,
        "d2": EngineState.PENDING,  # no v9 prefill
        "d3": EngineState.FAILED,
        "d4": EngineState.DRAINING,
        "d5": EngineState.EVICTED,
    }
    assert [e.reason for e in events] == ["EngineEvicted"]  # unreachable: no Event (flaps)


# --- topology_events and idle_ttl_changes ------------------------------------------------------


def test_topology_events_are_said_when_they_begin() -> None:
    engines = live(usable("p0", {"D0"}, unhealthy_peers={"D0": "dropped: x"}), usable("d0", {"P0"}))
    pairing = pair_engines(spec(), engines)
    tally = tally_failures(
        live(usable("d0", failures={"transfer_failed": 1})), KVTopologyStatus(), Memory()
    )
    fresh = topology_events(observed(claimed={"d9": "older"}), pairing, tally)
    assert [e.reason for e in fresh] == ["TransferFailures", "PeerUnhealthy", "Conflict"]
    known = Memory(unhealthy=frozenset({("P0", "D0")}))
    quiet = topology_events(
        observed(memory=known), pairing, tally_failures({}, KVTopologyStatus(), known)
    )
    assert quiet == []


def test_idle_ttl_goes_only_to_workers_that_report_another() -> None:
    engines = live(
        usable("p0", idle_ttl_s=0.0),
        usable("d0", idle_ttl_s=30.0),
        usable("d1"),  # d1: too old
    )
    assert [(c.pod, c.idle_ttl_s) for c in idle_ttl_changes(spec(), engines)] == [("p0", 30.0)]
