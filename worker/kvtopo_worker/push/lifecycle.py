"""The life of a request on each side of a push, as explicit state machines.

Owns the phases a request (decode side), a request's KV (prefill side) and a registration the
prefill holds go through, the events that move them, and the one table per machine that says
what each (phase, event) pair leads to and what the connector must do on the way. The
connectors (`decode`, `prefill`) keep one record per request with its phase and move it only
through `advance`, under their state lock; a pair missing from a table is an event that
changes nothing for that phase (a late or repeated message), which the caller counts.

Decode side (`Recv`): a registration is QUEUED until it goes out to exactly one agent of the
prefill engine (REGISTERED); given up (timeout, abort, drain) it is CANCELLING until that same
agent answers or the last moment a WRITE could land has passed. Only then does it end, so
the decode never hands its blocks back while a WRITE of the request can still land.

Prefill side (`Send`): a request's KV WAITS for its decode's registration, is WRITTEN into
the blocks that registration named, and ends DONE or FAILED. Registrations (`Held`) are kept
per (sender agent, request id): HELD until matched, cancelled, expired or their sender's
process is gone; a cancel that finds nothing leaves a TOMBSTONE that refuses the
registration it overtook.
"""

from __future__ import annotations

import enum


class Recv(enum.StrEnum):
    """Phases of a request on the decode side."""

    QUEUED = "queued"  # registration not sent yet (queued, or parked until the prefill greets)
    REGISTERED = "registered"  # sent to one agent of the prefill engine (`_Recv.agent`)
    CANCELLING = "cancelling"  # given up; waiting for that agent's answer or the deadline
    DONE = "done"  # its KV landed
    FAILED = "failed"  # ended without its KV; nothing of it can land any more


class RecvEvent(enum.StrEnum):
    SENT = "sent"  # the registration is going out to the chosen agent
    SEND_FAILED = "send_failed"  # NIXL refused to send it: nothing went out
    COMPLETED = "completed"  # PUSH_DONE from the agent it was registered with
    REFUSED = "refused"  # PUSH_FAIL from that agent: no WRITE of it can land any more
    GIVE_UP = "give_up"  # registration timeout, abort or drain deadline
    UNANSWERED = "unanswered"  # the last moment a WRITE could land has passed, no answer
    STOP = "stop"  # the engine stops (its KV memory goes with it)


class RecvAction(enum.StrEnum):
    NONE = "none"
    SEND_CANCEL = "send_cancel"  # tell the agent it was registered with: PUSH_CANCEL
    END = "end"  # report the outcome (the phase says which)


RECV_TABLE: dict[tuple[Recv, RecvEvent], tuple[Recv, RecvAction]] = {
    (Recv.QUEUED, RecvEvent.SENT): (Recv.REGISTERED, RecvAction.NONE),
    (Recv.QUEUED, RecvEvent.SEND_FAILED): (Recv.FAILED, RecvAction.END),
    (Recv.QUEUED, RecvEvent.GIVE_UP): (Recv.FAILED, RecvAction.END),  # never sent
    (Recv.QUEUED, RecvEvent.STOP): (Recv.FAILED, RecvAction.END),
    (Recv.REGISTERED, RecvEvent.SEND_FAILED): (Recv.FAILED, RecvAction.END),
    (Recv.REGISTERED, RecvEvent.COMPLETED): (Recv.DONE, RecvAction.END),
    (Recv.REGISTERED, RecvEvent.REFUSED): (Recv.FAILED, RecvAction.END),
    (Recv.REGISTERED, RecvEvent.GIVE_UP): (Recv.CANCELLING, RecvAction.SEND_CANCEL),
    # Stopping: the peer is told, and the engine's memory goes away with it.
    (Recv.REGISTERED, RecvEvent.STOP): (Recv.FAILED, RecvAction.SEND_CANCEL),
    (Recv.CANCELLING, RecvEvent.COMPLETED): (Recv.DONE, RecvAction.END),  # it landed first
    (Recv.CANCELLING, RecvEvent.REFUSED): (Recv.FAILED, RecvAction.END),
    (Recv.CANCELLING, RecvEvent.UNANSWERED): (Recv.FAILED, RecvAction.END),
    (Recv.CANCELLING, RecvEvent.STOP): (Recv.FAILED, RecvAction.END),
}


class Send(enum.StrEnum):
    """Phases of a request's KV on the prefill side."""

    WAITING = "waiting"  # KV ready, no registration matched yet (within the KV lease)
    WRITING = "writing"  # its WRITE is in flight to the agent that registered it
    DONE = "done"
    FAILED = "failed"


class SendEvent(enum.StrEnum):
    MATCHED = "matched"  # a registration of its decode engine's current agent
    WRITE_DONE = "write_done"
    WRITE_FAILED = "write_failed"  # erred, timed out and released, or could not start
    LEASE_EXPIRED = "lease_expired"  # no registration within the KV lease
    CANCELLED = "cancelled"  # its decode gave it up
    ABANDONED = "abandoned"  # the engine gave it up (abort, drain deadline)
    STOP = "stop"
    # Past its deadline, NIXL would not release (abort) its WRITE: it may still land.
    RELEASE_REFUSED = "release_refused"
    # The engine stops beside a WRITE NIXL would not release.
    STOP_UNRELEASED = "stop_unreleased"


class SendAction(enum.StrEnum):
    NONE = "none"
    START_WRITE = "start_write"
    END = "end"  # report the outcome; a failure is told to the decode agent concerned
    END_UNTOLD = "end_untold"  # report it here; tell the decode nothing (a WRITE may land)


SEND_TABLE: dict[tuple[Send, SendEvent], tuple[Send, SendAction]] = {
    (Send.WAITING, SendEvent.MATCHED): (Send.WRITING, SendAction.START_WRITE),
    (Send.WAITING, SendEvent.WRITE_FAILED): (Send.FAILED, SendAction.END),  # refused early
    (Send.WAITING, SendEvent.LEASE_EXPIRED): (Send.FAILED, SendAction.END),
    (Send.WAITING, SendEvent.CANCELLED): (Send.FAILED, SendAction.END),
    (Send.WAITING, SendEvent.ABANDONED): (Send.FAILED, SendAction.END),
    (Send.WAITING, SendEvent.STOP): (Send.FAILED, SendAction.END),
    (Send.WRITING, SendEvent.WRITE_DONE): (Send.DONE, SendAction.END),
    (Send.WRITING, SendEvent.WRITE_FAILED): (Send.FAILED, SendAction.END),
    # A WRITE in flight is never abandoned half-way: its end answers the cancel.
    (Send.WRITING, SendEvent.CANCELLED): (Send.WRITING, SendAction.NONE),
    (Send.WRITING, SendEvent.ABANDONED): (Send.WRITING, SendAction.NONE),
    (Send.WRITING, SendEvent.STOP): (Send.FAILED, SendAction.END),
    # A WRITE that may still land is never given up: no PUSH_FAIL while it can land; the
    # decode's own give-up bound ends its side.
    (Send.WRITING, SendEvent.RELEASE_REFUSED): (Send.WRITING, SendAction.NONE),
    (Send.WRITING, SendEvent.STOP_UNRELEASED): (Send.FAILED, SendAction.END_UNTOLD),
}


class Held(enum.StrEnum):
    """What the prefill keeps of one (sender agent, request id)."""

    HELD = "held"  # a registration waiting for its KV (within its lease)
    TOMBSTONE = "tombstone"  # a cancel that came first: refuses the registration
    GONE = "gone"  # nothing kept


class HeldEvent(enum.StrEnum):
    REGISTERED = "registered"
    CANCELLED = "cancelled"
    MATCHED = "matched"
    EXPIRED = "expired"
    SENDER_GONE = "sender_gone"  # the sender's process was evicted or replaced


class HeldAction(enum.StrEnum):
    NONE = "none"
    KEEP = "keep"  # keep the registration
    ANSWER_FAIL = "answer_fail"  # PUSH_FAIL to the sender: no WRITE of it will come
    REFUSE = "refuse"  # drop the registration (its cancel was answered already)
    DROP = "drop"  # forget, tell nobody (the sender is gone)


HELD_TABLE: dict[tuple[Held, HeldEvent], tuple[Held, HeldAction]] = {
    (Held.GONE, HeldEvent.REGISTERED): (Held.HELD, HeldAction.KEEP),
    (Held.GONE, HeldEvent.CANCELLED): (Held.TOMBSTONE, HeldAction.ANSWER_FAIL),
    # A cancelled registration leaves a tombstone too: its KV, ready later, fails at once,
    # and a duplicate of the registration is refused.
    (Held.HELD, HeldEvent.CANCELLED): (Held.TOMBSTONE, HeldAction.ANSWER_FAIL),
    (Held.HELD, HeldEvent.MATCHED): (Held.GONE, HeldAction.NONE),
    (Held.HELD, HeldEvent.EXPIRED): (Held.GONE, HeldAction.ANSWER_FAIL),
    (Held.HELD, HeldEvent.SENDER_GONE): (Held.GONE, HeldAction.DROP),
    (Held.TOMBSTONE, HeldEvent.REGISTERED): (Held.TOMBSTONE, HeldAction.REFUSE),
    (Held.TOMBSTONE, HeldEvent.CANCELLED): (Held.TOMBSTONE, HeldAction.ANSWER_FAIL),
    (Held.TOMBSTONE, HeldEvent.EXPIRED): (Held.GONE, HeldAction.DROP),
    (Held.TOMBSTONE, HeldEvent.SENDER_GONE): (Held.GONE, HeldAction.DROP),
}


def advance_recv(phase: Recv, event: RecvEvent) -> tuple[Recv, RecvAction] | None:
    """Where `event` takes a decode request in `phase`; None: it changes nothing."""
    return RECV_TABLE.get((phase, event))


def advance_send(phase: Send, event: SendEvent) -> tuple[Send, SendAction] | None:
    """Where `event` takes a prefill request in `phase`; None: it changes nothing."""
    return SEND_TABLE.get((phase, event))


def advance_held(phase: Held, event: HeldEvent) -> tuple[Held, HeldAction] | None:
    """Where `event` takes what the prefill keeps of a (sender, request); None: nothing."""
    return HELD_TABLE.get((phase, event))
