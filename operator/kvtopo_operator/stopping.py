"""What a topology's loop leaves behind when it stops: the fail-static policy.

Owns `on_loop_stop`, the one decision about the writes a stopping loop makes, as a table
(`STOP_WRITES`): a loop stops because its topology was deleted, because this replica lost
the Lease (a renewal refused or late: the API server stalled or partitioned, a standby took
over), because the process is stopping (SIGTERM: a `helm upgrade`, a node drain), or its
rounds fail because the API server cannot be reached (the loop then keeps running and
retrying; listed so the table is whole). Only a deletion changes anything, and only the pods'
gates: the pods that no topology selects any more have theirs turned False, by this replica
when no other topology is left in the namespace, else by the loop of the namespace's oldest
topology (it un-gates whatever no topology selects, `gate.stray_gates`). Peers, settings and
statuses are never changed by a stop. The writes themselves are fenced on leadership
(`fence`): a replica that does not lead makes none of them, deletion or not.

Pure: no I/O. Used by `reconcile`.
"""

from __future__ import annotations

from enum import StrEnum


class StopCause(StrEnum):
    DELETED = "the topology was deleted"
    LEASE_LOST = "this replica lost the Lease"
    PROCESS_STOP = "the operator is stopping"
    API_UNREACHABLE = "the API server cannot be reached"


class StopWrites(StrEnum):
    NOTHING = "nothing: gates, peers, settings, status and Events stay as they are"
    UNGATE_HERE = "the gates of the pods it selected turn False (no topology is left)"
    UNGATE_BY_OLDEST = (
        "the oldest other topology's loop turns False the gates of the pods none selects"
    )


# (why the loop stops, whether another topology is left in its namespace) -> what it writes
STOP_WRITES: dict[tuple[StopCause, bool], StopWrites] = {
    (StopCause.DELETED, False): StopWrites.UNGATE_HERE,
    (StopCause.DELETED, True): StopWrites.UNGATE_BY_OLDEST,
    (StopCause.LEASE_LOST, False): StopWrites.NOTHING,
    (StopCause.LEASE_LOST, True): StopWrites.NOTHING,
    (StopCause.PROCESS_STOP, False): StopWrites.NOTHING,
    (StopCause.PROCESS_STOP, True): StopWrites.NOTHING,
    (StopCause.API_UNREACHABLE, False): StopWrites.NOTHING,
    (StopCause.API_UNREACHABLE, True): StopWrites.NOTHING,
}


def on_loop_stop(cause: StopCause, others_left: bool) -> StopWrites:
    """What a loop stopping for `cause` writes (see `STOP_WRITES`)."""
    return STOP_WRITES[(cause, others_left)]
