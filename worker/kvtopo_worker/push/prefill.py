"""The prefill half of a push: registrations and cancels in, WRITEs and answers out.

Owns each request's KV record (`_Send`, moved through `lifecycle.SEND_TABLE`) and what the
prefill keeps per (sender agent, request id) (`_Keep`, through `lifecycle.HELD_TABLE`):
registrations waiting for their KV, and tombstones of cancels that came first.

- Everything is keyed by the sender's exact agent, which names one process (an incarnation):
  a registration counts only from the current agent of our TP rank of the engine it names,
  is written only into that agent's blocks, and dies with it. When a decode engine's agents
  leave the registry (evicted, or replaced by a new incarnation under the same engine id),
  what they had pending here is dropped, never written into their successor's memory.
- Notifications are handled in the order they came. A cancel that finds nothing leaves a
  tombstone (until the KV lease ends) that refuses the registration it overtook, and a
  request whose KV becomes ready after its decode cancelled it fails at once.
- A request's KV is matched with the registration of its decode engine's current agent and
  WRITTEN into the blocks it named with a `PUSH_DONE` completion; requests matched in the same
  pass for the same agent share one WRITE (bounded by `max_requests_per_write` and
  `max_bytes_per_write`). The decode engine is pinned in the registry for the transfer. A
  WRITE that times out is aborted; one that cannot be aborted is watched to its end before
  the decode is told anything, so a `PUSH_FAIL` always means no WRITE of the request can
  still land. Answers go to the exact agent concerned, never to a successor.
- Bounded: at most `max_held_per_peer` registrations per decode agent, and no more of its
  blocks than it has (its metadata says how many), are held; beyond, a registration is
  refused at once. Tombstones are bounded per agent too (the oldest leaves first).
- A request may also carry an *alias*: another name its decode may know it by (vLLM's P/D
  router hands the decode its own request id, not the prefill's). A registration or cancel
  under an alias counts for the one request that carries it, and only when its prompt digest
  is that request's: an alias two requests carry finds neither (the registration is refused),
  and one of another prompt is refused. Inside, everything is keyed by our own id; what the
  decode is told names the request as the decode named it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kvtopo_worker.protocol import (
    FailureType,
    Notification,
    PushCancel,
    PushDone,
    PushFail,
    PushRegistration,
    Role,
    encode_notification,
)
from kvtopo_worker.push.core import PushConnector, signal_event
from kvtopo_worker.push.lifecycle import (
    Held,
    HeldAction,
    HeldEvent,
    Send,
    SendAction,
    SendEvent,
    advance_held,
    advance_send,
)
from kvtopo_worker.transport import TransportError, XferHandle, XferState

log = logging.getLogger("kvtopo_worker.push")

TOMBSTONES_PER_PEER = 4096  # cancels that came first, kept per decode agent at most
# Answers nobody honest waits on (a cancel that found nothing; a registration for a request
# this prefill never had, at its lease's end) are rate-limited per decode agent: a decode
# that gets none ends such a request by its own deadline. A flood of them costs the
# flooder, not a NIXL answer per message.
COURTESY_ANSWERS_PER_S = 100.0
COURTESY_ANSWERS_BURST = 256.0


@dataclass
class _Send:
    block_ids: list[int]
    deadline: float  # the KV lease
    decode_engine_id: str | None  # the decode engine it is paired with, if known
    phase: Send = Send.WAITING
    agent: str = ""  # the decode agent it is being written to (WRITING)
    prompt_digest: str = ""  # what a registration under its alias must carry


@dataclass
class _Keep:
    phase: Held
    engine_id: str  # the sender's engine
    deadline: float
    reg: PushRegistration | None = None  # HELD only
    blocks: int = 0


@dataclass
class _InFlight:
    handle: XferHandle
    decode_engine_id: str
    agent_name: str
    deadline: float
    started: float
    nbytes: int
    request_ids: tuple[str, ...]  # the requests this WRITE carries (keyed by the first)
    abort_failed_at: float | None = None  # past its deadline, NIXL would not release it
    released: bool = False  # aborted: nothing of it can land any more


@dataclass(frozen=True)
class _Outcome:
    """How a prefill request ended, kept to answer a late cancel or registration for it."""

    done: bool
    engine_id: str | None
    agent: str = ""  # the decode agent it was written to, or told of its failure
    reason: FailureType | None = None
    message: str = ""


class PrefillPush(PushConnector):
    """The prefill side of push-mode KV transfer for one engine rank."""

    role: Role = "prefill"

    def _init_side(self) -> None:
        self._sends: dict[str, _Send] = {}
        self._kept: OrderedDict[tuple[str, str], _Keep] = OrderedDict()  # (agent, rid)
        self._kept_by_rid: dict[str, set[str]] = {}  # rid -> agents
        self._kept_by_agent: dict[str, dict[str, None]] = {}  # agent -> rids (ordered)
        self._held_blocks: dict[str, int] = {}  # agent -> blocks its HELD registrations name
        self._tombstones: dict[str, dict[str, None]] = {}  # agent -> its tombstones (oldest first)
        self._in_flight: dict[str, _InFlight] = {}  # by the first request id of the WRITE
        self._outcomes: OrderedDict[str, _Outcome] = OrderedDict()
        # Every lease and tombstone deadline, soonest first: (deadline, seq, agent (""
        # for a request's own KV lease), request id, record);
        # an entry whose record has left (or moved on) since is skipped when it comes up,
        # so a deadline check costs what expires, not what is kept.
        self._deadlines: list[tuple[float, int, str, str, _Send | _Keep]] = []
        self._seq = itertools.count()
        # Aliases, while their request or its outcome is kept: alias -> the requests that
        # carry it (it finds a request only when exactly one does), our id -> its alias, and
        # our id -> {decode agent: the name that agent registered it under}.
        self._aliases: dict[str, set[str]] = {}
        self._alias_of: dict[str, str] = {}
        self._called: dict[str, dict[str, str]] = {}
        # Per decode agent: the courtesy answers it may still get (tokens, when counted).
        self._courtesy: dict[str, tuple[float, float]] = {}

    # --- names: our request ids, and the aliases a decode may use -------------------------

    def _resolve(self, name: str) -> str:
        """Our id of the request a decode names `name` (call under the state lock): itself
        when it is ours (or nothing carries it as an alias), else the one request that
        carries it as its alias."""
        if name in self._sends or name in self._outcomes:
            return name
        carriers = self._aliases.get(name)
        if carriers is not None and len(carriers) == 1:
            return next(iter(carriers))
        return name

    def _ambiguous(self, name: str) -> bool:
        """Several requests carry `name` as their alias (call under the state lock)."""
        return len(self._aliases.get(name, ())) > 1

    def _name_for(self, rid: str, agent: str) -> str:
        """What `agent` calls our request `rid` (its alias, where it registered under it)."""
        return self._called.get(rid, {}).get(agent, rid)

    def _adopt_alias(self, rid: str, alias: str) -> list[tuple[str, _Keep]]:
        """Gives request `rid` its alias (call under the state lock). What decodes had kept
        here under the alias before the request's KV was ready becomes the request's; the
        registrations among it of another prompt are dropped and returned, to be refused."""
        carriers = self._aliases.setdefault(alias, set())
        carriers.add(rid)
        self._alias_of[rid] = alias
        if len(carriers) > 1 or alias in self._sends or alias in self._outcomes:
            return []  # several carry it: it finds none of them
        send = self._sends.get(rid)
        digest = send.prompt_digest if send is not None else ""
        refused: list[tuple[str, _Keep]] = []
        for agent in list(self._kept_by_rid.get(alias, ())):
            keep = self._drop(agent, alias)
            if keep is None:
                continue
            if keep.reg is not None:
                if keep.reg.prompt_digest != digest:
                    refused.append((agent, keep))
                    continue
                keep.reg = msgspec.structs.replace(keep.reg, request_id=rid)
            self._called.setdefault(rid, {})[agent] = alias
            self._put(agent, rid, keep)
        return refused

    def _forget_names(self, rid: str) -> None:
        """`rid`'s outcome left: so do its alias and the names decodes gave it."""
        self._called.pop(rid, None)
        alias = self._alias_of.pop(rid, None)
        if alias is None:
            return
        carriers = self._aliases.get(alias)
        if carriers is not None:
            carriers.discard(rid)
            if not carriers:
                del self._aliases[alias]

    # --- what is kept per (agent, request) -------------------------------------------------

    def _put(self, agent: str, rid: str, keep: _Keep) -> None:
        """Keeps `keep` (call under the state lock)."""
        self._drop(agent, rid)
        self._kept[(agent, rid)] = keep
        heapq.heappush(self._deadlines, (keep.deadline, next(self._seq), agent, rid, keep))
        if len(self._deadlines) > 2 * (len(self._kept) + len(self._sends)) + 1024:
            self._compact_deadlines()
        self._kept_by_rid.setdefault(rid, set()).add(agent)
        rids = self._kept_by_agent.setdefault(agent, {})
        rids[rid] = None
        if keep.phase is Held.HELD:
            self._held_blocks[agent] = self._held_blocks.get(agent, 0) + keep.blocks
        else:
            tombstones = self._tombstones.setdefault(agent, {})
            tombstones[rid] = None
            if len(tombstones) > TOMBSTONES_PER_PEER:
                self._drop(agent, next(iter(tombstones)))
                self.metrics.reject("tombstone_overflow")

    def _live(self, entry: tuple[float, int, str, str, _Send | _Keep]) -> bool:
        """Whether a deadline entry still stands for its record (call under the state lock)."""
        deadline, _, agent, rid, record = entry
        if record.deadline != deadline:
            return False
        if isinstance(record, _Send):
            return self._sends.get(rid) is record
        return self._kept.get((agent, rid)) is record

    def _compact_deadlines(self) -> None:
        """Drops the entries of records that left or moved on (call under the state lock):
        a stream of tombstones replacing each other must not grow the heap by one entry per
        message for a whole lease."""
        self._deadlines[:] = [e for e in self._deadlines if self._live(e)]
        heapq.heapify(self._deadlines)

    def _courtesy_allowed(self, agent: str) -> bool:
        """Whether `agent` may get one more courtesy answer now (its token bucket)."""
        now = self._clock()
        with self._state_lock:
            tokens, since = self._courtesy.get(agent, (COURTESY_ANSWERS_BURST, now))
            tokens = min(COURTESY_ANSWERS_BURST, tokens + (now - since) * COURTESY_ANSWERS_PER_S)
            allowed = tokens >= 1.0
            self._courtesy[agent] = (tokens - 1.0 if allowed else tokens, now)
        if not allowed:
            self.metrics.reject("unanswered_courtesy")
        return allowed

    def _drop(self, agent: str, rid: str) -> _Keep | None:
        keep = self._kept.pop((agent, rid), None)
        if keep is None:
            return None
        agents = self._kept_by_rid[rid]
        agents.discard(agent)
        if not agents:
            del self._kept_by_rid[rid]
        rids = self._kept_by_agent[agent]
        del rids[rid]
        if not rids:
            del self._kept_by_agent[agent]
        if keep.phase is Held.HELD:
            left = self._held_blocks.get(agent, 0) - keep.blocks
            if left > 0:
                self._held_blocks[agent] = left
            else:
                self._held_blocks.pop(agent, None)
        else:
            tombstones = self._tombstones[agent]
            del tombstones[rid]
            if not tombstones:
                del self._tombstones[agent]
        return keep

    def _held_step(self, agent: str, rid: str, event: HeldEvent) -> tuple[_Keep | None, HeldAction]:
        """Moves what is kept of (agent, rid) by `event` (call under the state lock): the
        record it concerned (None when nothing was kept) and the action to take."""
        keep = self._kept.get((agent, rid))
        step = advance_held(keep.phase if keep is not None else Held.GONE, event)
        if step is None:
            return keep, HeldAction.NONE
        phase, action = step
        if phase is Held.GONE:
            self._drop(agent, rid)
        elif keep is not None and keep.phase is not phase:
            self._drop(agent, rid)
            keep.phase = phase
            if phase is Held.TOMBSTONE:
                keep.reg, keep.blocks = None, 0
                keep.deadline = self._clock() + self.config.kv_lease_s
            self._put(agent, rid, keep)
        return keep, action

    def _advance(self, rid: str, send: _Send, event: SendEvent) -> SendAction | None:
        """Moves a request's KV record by `event` (call under the state lock); an ended one
        leaves the table."""
        step = advance_send(send.phase, event)
        if step is None:
            return None
        send.phase, action = step
        if send.phase in (Send.DONE, Send.FAILED) and self._sends.get(rid) is send:
            del self._sends[rid]
        return action

    # --- engine-thread API ---------------------------------------------------------------

    def request_send(
        self,
        request_id: str,
        block_ids: Sequence[int],
        decode_engine_id: str | None = None,
        *,
        alias: str = "",
        prompt_digest: str = "",
    ) -> None:
        """The request's KV is in `block_ids`; push it when its decode engine
        (`decode_engine_id` when known; else the first that registers it) registers, under
        our id or under `alias` with `prompt_digest`. A request its decode engine cancelled
        before this call fails at once."""
        cancelled = False
        refused: list[tuple[str, _Keep]] = []
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("the connector is stopped")
            if request_id in self._sends or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            send = _Send(
                list(block_ids),
                self._clock() + self.config.kv_lease_s,
                decode_engine_id,
                prompt_digest=prompt_digest,
            )
            self._sends[request_id] = send
            if alias and alias != request_id:
                refused = self._adopt_alias(request_id, alias)
            for agent in self._kept_by_rid.get(request_id, ()):
                keep = self._kept[(agent, request_id)]
                if keep.phase is Held.TOMBSTONE and decode_engine_id in (None, keep.engine_id):
                    cancelled = True
            if cancelled:
                del self._sends[request_id]
            else:
                entry = (send.deadline, next(self._seq), "", request_id, send)
                heapq.heappush(self._deadlines, entry)
        for agent, keep in refused:
            self.metrics.reject("prompt_mismatch")
            why = "the registration's prompt is not the prompt of the request with that id"
            self._answer(agent, keep.engine_id, alias, FailureType.REMOTE_REJECTED, why)
        if cancelled:
            self._fail_send(
                request_id,
                FailureType.REGISTRATION_TIMEOUT,
                "the decode engine gave the request up before its KV was ready",
                decode_engine_id,
            )
            return
        signal_event(self._wake)

    def abandon(self, request_id: str, reason: FailureType, message: str) -> None:
        """A request not being written ends at once, and a decode agent that registered it
        is told; one being written ends with its WRITE."""
        answers: list[tuple[str, _Keep]] = []
        with self._state_lock:
            send = self._sends.get(request_id)
            if send is None or self._advance(request_id, send, SendEvent.ABANDONED) is None:
                return
            if send.phase is Send.FAILED:
                for agent in list(self._kept_by_rid.get(request_id, ())):
                    keep = self._kept[(agent, request_id)]
                    if keep.phase is Held.HELD:
                        self._drop(agent, request_id)
                        answers.append((agent, keep))
        if send.phase is Send.FAILED:
            self._fail_send(request_id, reason, message, send.decode_engine_id)
            for agent, keep in answers:
                self._answer(agent, keep.engine_id, request_id, reason, message)
        signal_event(self._wake)

    def in_flight(self) -> int:
        with self._state_lock:
            return len(self._sends)

    def settles_within(self) -> float:
        now = self._clock()
        with self._state_lock:
            xfers = list(self._in_flight.values())
        if not xfers:
            return 0.0
        # A WRITE NIXL will not release has no bound: wait one more transfer timeout.
        last = max(
            x.deadline if x.abort_failed_at is None else now + self.config.transfer_timeout_s
            for x in xfers
        )
        return max(0.0, last - now)

    def writing(self, request_id: str) -> bool:
        with self._state_lock:
            send = self._sends.get(request_id)
            return send is not None and send.phase is Send.WRITING

    def _stop_pending(self, why: str) -> None:
        with self._state_lock:
            sends = [(rid, s) for rid, s in self._sends.items() if s.phase is Send.WAITING]
            for rid, send in sends:
                self._advance(rid, send, SendEvent.STOP)
            held = [(a, r, k) for (a, r), k in self._kept.items() if k.phase is Held.HELD]
            self._kept.clear()
            self._kept_by_rid.clear()
            self._kept_by_agent.clear()
            self._held_blocks.clear()
            self._tombstones.clear()
            xfers = list(self._in_flight.values())
            self._in_flight.clear()
        for xfer in xfers:
            if xfer.abort_failed_at is not None:
                self.metrics.writes_unreleasable.dec()
        for rid, send in sends:
            self._fail_send(rid, FailureType.SHUTDOWN, why, send.decode_engine_id)
        for agent, rid, keep in held:
            self._answer(agent, keep.engine_id, rid, FailureType.SHUTDOWN, why)
        for xfer in xfers:
            try:
                landed = self.transport.poll(xfer.handle) == "DONE"
            except Exception:
                landed = False
            if landed:  # it landed before the stop: done on both sides
                self._finish_transfer(xfer, "DONE", self._clock())
                continue
            # A WRITE NIXL will not release may still land: its requests end here (the
            # engine stops), but its decode is not told they failed; its give-up bound ends
            # them there.
            released = self._release(xfer.handle)
            self._finish_transfer(
                xfer, "ERR", self._clock(), FailureType.SHUTDOWN, why, released=True, tell=released
            )

    # --- registry events -------------------------------------------------------------------

    def agents_removed(self, engine_id: str, agents: Mapping[int, str]) -> None:
        """The agents' process was evicted or replaced: what it had pending here dies with
        it, unanswered (there is nobody left to answer) and never written."""
        agent = agents.get(self.tp_rank)
        if agent is None:
            return
        with self._state_lock:
            self._courtesy.pop(agent, None)
            rids = list(self._kept_by_agent.get(agent, {}))
            for rid in rids:
                self._held_step(agent, rid, HeldEvent.SENDER_GONE)
        if rids:
            log.info(
                "dropped %d registrations and cancels of agent %s (engine %s left)",
                len(rids),
                agent,
                engine_id,
            )

    # --- notifications -------------------------------------------------------------------

    def _on_message(self, agent_name: str, msg: Notification) -> None:
        if isinstance(msg, PushRegistration):
            self._on_registration(agent_name, msg)
        elif isinstance(msg, PushCancel):
            self._on_cancel(agent_name, msg)
        else:  # completions and failures are the decode's to receive
            self.metrics.reject("notification")

    def _blocks_allowed(self, agent: str) -> int:
        """How many blocks of `agent`'s registrations may be held: as many as its engine
        rank has (its metadata says), when the transport knows."""
        known = getattr(self.transport, "remote_num_blocks", None)
        blocks = known(agent) if known is not None else None
        return int(blocks) if blocks else 1 << 24

    def _on_registration(self, agent: str, msg: PushRegistration) -> None:
        engine = self._sender(agent)
        if (
            engine is None
            or engine != msg.decode_engine_id
            or msg.prefill_engine_id != self.engine_id
            or msg.decode_tp_rank != self.tp_rank
        ):
            self.metrics.reject("notification")
            self.metrics.warn_limited(
                "registration",
                "registration of %s from agent %s (not %s's current agent of rank %d) dropped",
                msg.request_id,
                agent,
                msg.decode_engine_id,
                self.tp_rank,
            )
            return
        self.registry.touch(engine)
        name = msg.request_id  # what the decode calls the request
        now, wall = self._clock(), self._wall()
        answer: tuple[FailureType, str] | None = None
        with self._state_lock:
            rid = self._resolve(name)
            if rid != name:
                target = self._sends.get(rid)
                if target is not None and msg.prompt_digest != target.prompt_digest:
                    answer = (
                        FailureType.REMOTE_REJECTED,
                        "the registration's prompt is not the prompt of the request with that id",
                    )
                else:
                    msg = msgspec.structs.replace(msg, request_id=rid)
                    self._called.setdefault(rid, {})[agent] = name
            elif self._ambiguous(name):
                answer = (FailureType.REMOTE_REJECTED, "several requests here carry that id")
        if answer is not None:
            self.metrics.reject("notification")
            self._answer(agent, engine, name, *answer)
            return
        with self._state_lock:
            kept = self._kept.get((agent, rid))
            send = self._sends.get(rid)
            outcome = self._outcomes.get(rid) if send is None else None
            if kept is not None and kept.phase is Held.TOMBSTONE:
                self._held_step(agent, rid, HeldEvent.REGISTERED)  # refused: cancel answered
                self.metrics.reject("cancelled_registration")
                return
            expired_send: _Send | None = None
            if kept is not None or (send is not None and send.phase is Send.WRITING):
                self.metrics.reject("notification")  # a duplicate
                return
            if send is not None and send.decode_engine_id not in (None, engine):
                answer = (
                    FailureType.REMOTE_REJECTED,
                    "the request is paired with another decode engine",
                )
            elif outcome is not None and outcome.engine_id in (None, engine):
                if outcome.done and outcome.agent == agent:
                    self.metrics.reject("notification")  # a duplicate of one written
                    return
                if outcome.done:
                    answer = (FailureType.REMOTE_REJECTED, "written to another decode process")
                else:
                    reason = outcome.reason or FailureType.TRANSFER_FAILED
                    answer = (reason, outcome.message)
            elif wall >= msg.expires_at:
                answer = (
                    FailureType.REGISTRATION_TIMEOUT,
                    "the registration expired before it could be used",
                )
                # Its decode gives the request up on this answer: so does our side.
                if (
                    send is not None
                    and send.decode_engine_id in (None, engine)
                    and self._advance(rid, send, SendEvent.CANCELLED) is SendAction.END
                ):
                    expired_send = send
            elif len(
                self._kept_by_agent.get(agent, {})
            ) >= self.config.max_held_per_peer or self._held_blocks.get(agent, 0) + len(
                msg.block_ids
            ) > self._blocks_allowed(agent):
                answer = (
                    FailureType.REMOTE_REJECTED,
                    "too many registrations of this decode engine are waiting here",
                )
            else:
                lease = min(self.config.kv_lease_s, msg.expires_at - wall)
                keep = _Keep(Held.HELD, engine, now + lease, msg, len(msg.block_ids))
                self._put(agent, rid, keep)
        if expired_send is not None:
            self._fail_send(
                rid, FailureType.REGISTRATION_TIMEOUT, answer[1] if answer else "", None
            )
        if answer is not None:
            self.metrics.reject("notification")
            self._answer(agent, engine, rid, *answer)
        else:
            signal_event(self._wake)

    def _on_cancel(self, agent: str, msg: PushCancel) -> None:
        """The decode gave `msg.request_id` up: drop its registration (and fail our side of
        the request), unless its WRITE to that agent is in flight, whose end answers; a
        cancel that finds nothing leaves a tombstone. Always answered, to that agent."""
        engine = self.registry.agent_owner(agent)
        if (
            engine is None
            or engine != msg.decode_engine_id
            or msg.prefill_engine_id != self.engine_id
            or msg.decode_tp_rank != self.tp_rank
        ):
            self.metrics.reject("notification")
            self.metrics.warn_limited(
                "cancel", "cancel of %s from agent %s dropped", msg.request_id, agent
            )
            return
        name = msg.request_id  # what the decode calls the request
        why = "the decode engine gave the request up"
        failed_send: _Send | None = None
        resend: _Outcome | None = None
        tombstone = False
        with self._state_lock:
            rid = self._resolve(name)
            if rid != name:
                self._called.setdefault(rid, {})[agent] = name
            send = self._sends.get(rid)
            if send is not None and send.phase is Send.WRITING and send.agent == agent:
                return  # the WRITE's end answers
            outcome = self._outcomes.get(rid) if send is None else None
            if outcome is not None and outcome.agent == agent:
                resend = outcome
            else:
                kept, _ = self._held_step(agent, rid, HeldEvent.CANCELLED)
                tombstone = kept is None
                if tombstone:  # nothing was kept: a tombstone refuses its registration
                    self._put(
                        agent,
                        rid,
                        _Keep(Held.TOMBSTONE, engine, self._clock() + self.config.kv_lease_s),
                    )
                if (
                    send is not None
                    and send.decode_engine_id in (None, engine)
                    and self._advance(rid, send, SendEvent.CANCELLED) is SendAction.END
                ):
                    failed_send = send
        if resend is not None:
            if resend.done:  # it landed: say so again (the decode then ends it done)
                done = PushDone(request_id=name, prefill_engine_id=self.engine_id, num_blocks=0)
                self._notify(agent, done, rid, engine)
            else:
                reason = resend.reason or FailureType.TRANSFER_FAILED
                self._answer(agent, engine, rid, reason, resend.message)
            return
        if failed_send is not None:
            self._fail_send(rid, FailureType.REGISTRATION_TIMEOUT, why, None)
        elif tombstone and not self._courtesy_allowed(agent):
            return  # nothing of it was here: the decode's own deadline ends it
        self._answer(agent, engine, rid, FailureType.REGISTRATION_TIMEOUT, "cancelled")

    def _answer(
        self, agent: str, engine_id: str, rid: str, reason: FailureType, message: str
    ) -> None:
        """PUSH_FAIL for `rid` to exactly `agent` (a decode rank), while it is held; it
        names the request as that agent did."""
        if self.registry.agent_owner(agent) != engine_id:
            return
        fail = PushFail(
            request_id=self._name_for(rid, agent),
            prefill_engine_id=self.engine_id,
            reason=reason,
            message=message[:200],
        )
        self._notify(agent, fail, rid, engine_id)

    # --- matching and WRITEs -------------------------------------------------------------

    def _progress_side(self) -> None:
        self._start_matched_transfers()
        burst_end = time.monotonic() + self.config.transfer_poll_burst_s
        while self._poll_transfers() == 0 and time.monotonic() < burst_end:
            pass

    def _start_matched_transfers(self) -> None:
        with self._state_lock:
            candidates = [
                (rid, agent, self._kept[(agent, rid)].engine_id)
                for rid, agents in self._kept_by_rid.items()
                if (send := self._sends.get(rid)) is not None and send.phase is Send.WAITING
                for agent in agents
                if self._kept[(agent, rid)].phase is Held.HELD
            ]
        if not candidates:
            return
        # Which senders are still their engine's current agent (one lookup per agent).
        current: dict[str, bool] = {}
        for _, agent, engine in candidates:
            if agent not in current:
                current[agent] = self.registry.current_agent(engine, self.tp_rank) == agent
        work: list[tuple[str, PushRegistration, _Send]] = []
        refused: list[tuple[str, str, str]] = []
        with self._state_lock:
            for rid, agent, engine in candidates:
                send = self._sends.get(rid)
                keep = self._kept.get((agent, rid))
                if send is None or send.phase is not Send.WAITING or keep is None:
                    continue
                if keep.phase is not Held.HELD or keep.reg is None:
                    continue
                if not current[agent]:
                    self._held_step(agent, rid, HeldEvent.SENDER_GONE)
                    continue
                if send.decode_engine_id not in (None, engine):
                    self._drop(agent, rid)
                    refused.append((agent, engine, rid))
                    continue
                self._held_step(agent, rid, HeldEvent.MATCHED)
                self._advance(rid, send, SendEvent.MATCHED)
                send.agent = agent
                work.append((agent, keep.reg, send))
        for agent, engine, rid in refused:
            self.metrics.reject("notification")
            why = "the request is paired with another decode engine"
            self._answer(agent, engine, rid, FailureType.REMOTE_REJECTED, why)
        if work:
            self._write_batches(work)

    def _write_batches(self, work: list[tuple[str, PushRegistration, _Send]]) -> None:
        wall = self._wall()
        batch: list[tuple[PushRegistration, list[int]]] = []
        batch_agent = ""
        nbytes = 0
        for agent, reg, send in work:
            rid = reg.request_id
            blocks = send.block_ids
            if wall >= reg.expires_at:
                self._write_failed(
                    rid,
                    FailureType.REGISTRATION_TIMEOUT,
                    "the registration expired before its KV was ready",
                )
                continue
            if reg.first_block:  # the decode holds the first blocks from its prefix cache
                blocks = blocks[reg.first_block :]
            if len(reg.block_ids) != len(blocks):
                msg = (
                    f"decode offered {len(reg.block_ids)} blocks, request has "
                    f"{len(blocks)} (from block {reg.first_block} on)"
                )
                self._write_failed(rid, FailureType.TRANSFER_SETUP_FAILED, msg)
                continue
            size = len(blocks) * self.block_len
            if batch and (
                agent != batch_agent
                or len(batch) >= self.config.max_requests_per_write
                or nbytes + size > self.config.max_bytes_per_write
            ):
                self._start_batch(batch_agent, batch)
                batch, nbytes = [], 0
            batch_agent = agent
            batch.append((reg, blocks))
            nbytes += size
        if batch:
            self._start_batch(batch_agent, batch)

    def _write_failed(self, rid: str, reason: FailureType, message: str) -> None:
        """A matched request whose WRITE could not start (nothing of it can land): failed,
        and the decode agent it was matched with is told."""
        with self._state_lock:
            send = self._sends.get(rid)
            if send is None or self._advance(rid, send, SendEvent.WRITE_FAILED) is None:
                return
        self._fail_send(rid, reason, message, send.decode_engine_id, send.agent)

    def _start_batch(self, agent: str, batch: list[tuple[PushRegistration, list[int]]]) -> None:
        """Starts one WRITE; whatever raises, every request of the batch ends once."""
        try:
            self._start_transfer(agent, batch)
        except Exception as exc:
            log.exception("starting a WRITE")
            with self._state_lock:
                started = batch[0][0].request_id in self._in_flight
            if not started:
                for reg, _ in batch:
                    self._write_failed(
                        reg.request_id,
                        FailureType.TRANSFER_SETUP_FAILED,
                        f"{type(exc).__name__}: {exc}",
                    )

    def _start_transfer(self, agent: str, batch: list[tuple[PushRegistration, list[int]]]) -> None:
        """One WRITE to exactly `agent` for requests it registered (a batch of one when
        batching is off or nothing else matched)."""
        first = batch[0][0]
        rids = tuple(reg.request_id for reg, _ in batch)
        decode_id = first.decode_engine_id

        def fail(reason: FailureType, message: str, tell: bool) -> None:
            for rid in rids:
                with self._state_lock:
                    send = self._sends.get(rid)
                    if send is None or self._advance(rid, send, SendEvent.WRITE_FAILED) is None:
                        continue
                self._fail_send(rid, reason, message, decode_id, agent if tell else "")

        agents = self.registry.begin_transfer(decode_id)
        if agents is None or agents.get(self.tp_rank) != agent:
            if agents is not None:
                self.registry.end_transfer(decode_id)
            fail(
                FailureType.TRANSFER_SETUP_FAILED,
                f"the decode process that registered it (agent {agent}) left engine {decode_id}",
                False,
            )
            return
        try:
            local: list[int] = []
            remote: list[int] = []
            for reg, blocks in batch:
                local += blocks
                remote += reg.block_ids
            names = [self._name_for(rid, agent) for rid in rids]
            done = encode_notification(
                PushDone(
                    request_id=names[0],
                    more_request_ids=names[1:],
                    prefill_engine_id=self.engine_id,
                    num_blocks=len(remote),
                )
            )
            timeout = min([self.config.transfer_timeout_s] + [r.write_timeout_s for r, _ in batch])
            now = self._clock()
            handle, state = self.transport.write_blocks(agent, local, remote, done)
        except Exception as exc:
            self._transport_failed(decode_id, agent, exc)
            self.registry.end_transfer(decode_id)
            reason = (
                FailureType.TRANSFER_FAILED
                if isinstance(exc, TransportError)
                else FailureType.TRANSFER_SETUP_FAILED
            )
            fail(reason, str(exc), True)
            return
        xfer = _InFlight(
            handle, decode_id, agent, now + timeout, now, len(local) * self.block_len, rids
        )
        if state == "DONE":  # shared-memory WRITEs often finish inside the post
            self._finish_transfer(xfer, "DONE", self._clock())
            return
        with self._state_lock:
            self._in_flight[rids[0]] = xfer

    def _poll_transfers(self) -> int:
        """Polls the WRITEs in flight once; returns how many ended, -1 if none is."""
        with self._state_lock:
            items = list(self._in_flight.items())
        if not items:
            return -1
        now = self._clock()
        ended = 0
        for rid, xfer in items:
            why, dropped = "WRITE failed", False
            try:
                state = self.transport.poll(xfer.handle)
            except TransportError as exc:  # NIXL says the decode's agent disconnected
                state, why, dropped = "ERR", str(exc), exc.kind == "disconnected"
            except Exception:
                log.exception("polling a WRITE")
                state = "ERR"
            if state == "PROC":
                if now < xfer.deadline or not self._abort(xfer, now):
                    continue  # in flight (or not releasable: it stays WRITING)
                state = "ERR"
            with self._state_lock:
                if self._in_flight.pop(rid, None) is None:
                    continue  # ended by stop()
            if xfer.abort_failed_at is not None:
                self.metrics.writes_unreleasable.dec()
            ended += 1
            self._finish_transfer(
                xfer,
                state,
                now,
                FailureType.TRANSFER_FAILED,
                "WRITE timed out" if xfer.released else why,
                released=xfer.released,
                dropped=dropped,
            )
        return ended

    def _abort(self, xfer: _InFlight, now: float) -> bool:
        """A WRITE past its deadline: True once it is released (aborted: nothing of it can
        land any more). One NIXL will not release may still land: it stays WRITING (its
        requests and their blocks stay held, no PUSH_FAIL is sent), counted in
        `kvtopo_worker_writes_unreleasable` and `/v1/state`, polled and asked again until
        NIXL ends or releases it; the decode's own give-up bound ends its side."""
        if self._release(xfer.handle):
            xfer.released = True
            return True
        if xfer.abort_failed_at is None:
            xfer.abort_failed_at = now
            with self._state_lock:
                for rid in xfer.request_ids:
                    send = self._sends.get(rid)
                    if send is not None:
                        self._advance(rid, send, SendEvent.RELEASE_REFUSED)
            self.metrics.writes_unreleasable.inc()
            log.error(
                "WRITE %s to %s is past its deadline and NIXL will not release it: its "
                "requests stay held until NIXL ends it",
                xfer.handle,
                xfer.agent_name,
            )
        return False

    def _release(self, handle: XferHandle) -> bool:
        try:
            return self.transport.release(handle) is not False
        except Exception:
            log.exception("releasing a WRITE")
            return False

    def _finish_transfer(
        self,
        xfer: _InFlight,
        state: XferState,
        now: float,
        reason: FailureType = FailureType.TRANSFER_FAILED,
        message: str = "WRITE failed",
        *,
        released: bool = False,
        dropped: bool = False,
        tell: bool = True,
    ) -> None:
        """Releases a WRITE that ended (DONE, or ERR) and ends each of its requests: sent,
        or failed with `reason` (its decode agent told); the decode engine is unpinned
        whatever raises. Unless the engine stopped, the outcome counts for the decode
        engine's health (`dropped`: NIXL said its agent disconnected)."""
        try:
            if state == "DONE":
                self.registry.peer_succeeded(xfer.decode_engine_id, xfer.agent_name)
            elif reason != FailureType.SHUTDOWN:
                why = f"{message} (WRITE to {xfer.agent_name})"
                self._peer_failed(xfer.decode_engine_id, xfer.agent_name, why, dropped=dropped)
            if not released:
                self._release(xfer.handle)
        finally:
            self.registry.end_transfer(xfer.decode_engine_id)
        if state == "DONE":
            event = SendEvent.WRITE_DONE
        else:
            event = SendEvent.WRITE_FAILED if tell else SendEvent.STOP_UNRELEASED
        ended: list[str] = []
        with self._state_lock:
            for rid in xfer.request_ids:
                send = self._sends.get(rid)
                if send is not None and self._advance(rid, send, event) is SendAction.END_UNTOLD:
                    tell = False
                if state == "DONE":
                    self._keep_outcome(rid, _Outcome(True, xfer.decode_engine_id, xfer.agent_name))
                ended.append(rid)
        if state == "DONE":
            self.metrics.transfer_seconds.observe(now - xfer.started)
            self.metrics.transfer_bytes_total.inc(xfer.nbytes)
            for rid in ended:
                self._report("sent", rid)
        else:
            told = xfer.agent_name if tell else ""
            for rid in ended:
                self._fail_send(rid, reason, message, xfer.decode_engine_id, told)

    def _keep_outcome(self, rid: str, outcome: _Outcome) -> None:
        """Remembers how a prefill request ended (call under the lock), to answer a cancel."""
        self._outcomes[rid] = outcome
        if len(self._outcomes) > self._ended_cap:
            gone, _ = self._outcomes.popitem(last=False)
            self._forget_names(gone)

    def _fail_send(
        self,
        request_id: str,
        reason: FailureType,
        message: str,
        engine_id: str | None,
        tell_agent: str = "",
    ) -> None:
        """Fails a prefill-side request once and, best effort, tells `tell_agent` (the
        decode agent it was matched with) that nothing of it will land."""
        with self._state_lock:
            self._keep_outcome(request_id, _Outcome(False, engine_id, tell_agent, reason, message))
        self._record_and_report(request_id, engine_id or "", reason, message)
        if tell_agent and engine_id is not None:
            self._answer(tell_agent, engine_id, request_id, reason, message)

    # --- deadlines -----------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        sends: list[tuple[str, _Send]] = []
        answers: list[tuple[str, str, str]] = []
        with self._state_lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                deadline, _, agent, rid, record = heapq.heappop(heap)
                if record.deadline != deadline:
                    continue  # moved on (a tombstone's new lease has an entry of its own)
                if isinstance(record, _Send):
                    if self._sends.get(rid) is record and record.phase is Send.WAITING:
                        self._advance(rid, record, SendEvent.LEASE_EXPIRED)
                        sends.append((rid, record))
                    continue
                if self._kept.get((agent, rid)) is not record:
                    continue  # dropped, or kept anew
                _, action = self._held_step(agent, rid, HeldEvent.EXPIRED)
                if action is HeldAction.ANSWER_FAIL:
                    answers.append((agent, record.engine_id, rid))
        for rid, send in sends:
            msg = f"no registration within the {self.config.kv_lease_s:g} s KV lease"
            self._fail_send(rid, FailureType.KV_EXPIRED, msg, send.decode_engine_id)
        for agent, engine, rid in answers:
            # A registration for a request this prefill never had (within the lease).
            self.metrics.reject("orphan_registration")
            if self._courtesy_allowed(agent):
                self._answer(agent, engine, rid, FailureType.REMOTE_REJECTED, "unknown request")

    def _load(self) -> str:
        with self._state_lock:
            if self._in_flight:
                return "transferring"
            if self._sends or self._held_blocks:
                return "waiting"
            return "idle"
