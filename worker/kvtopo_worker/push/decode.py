"""The decode half of a push: registrations out, completions in, and giving requests up.

Owns each decode request's record (`_Recv`) from `request_receive` to its one outcome, moved
only through `lifecycle.RECV_TABLE`. The registration writer takes a registry snapshot under
the lock and sends outside it, to the prefill engine's agent of our TP rank as it is at that
moment; the request is bound to exactly that agent (that prefill process) from then on:
completions and failures count only from it, and a cancel goes only to it. A process that
replaced it under the same engine id knows nothing of the request and ends nothing of it.

Giving a request up (registration timeout, `abandon`, the drain deadline) sends PUSH_CANCEL
to its agent and ends the request only when no WRITE of it can land any more: its agent
answered (PUSH_FAIL: failed; PUSH_DONE: the bytes landed, done), or the registration's
validity plus the WRITE timeout and `cancel_margin_s` have passed. A registration never sent
ends at once. Background threads never fail a request themselves: they enqueue it.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
from kvtopo_worker.push.lifecycle import Recv, RecvAction, RecvEvent, advance_recv
from kvtopo_worker.transport import TransportError

log = logging.getLogger("kvtopo_worker.push")

# How long past its give-up time a request waits for one more pass of notifications before
# it ends unanswered (an answer may be queued behind a freeze of this process).
OVERDUE_GRACE_S = 0.05


@dataclass
class _Recv:
    prefill_engine_id: str
    block_ids: list[int]
    deadline: float  # registration timeout: give up (cancel) from then on
    give_up_at: float  # no WRITE can land after this: end the request even unanswered
    expires_at: float  # wall clock: the last moment a WRITE may start
    phase: Recv = Recv.QUEUED
    agent: str = ""  # the prefill agent it was registered with (from SENT on)
    overdue_since: float | None = None  # give_up_at seen passed (decided at a later look)
    cancel_reason: FailureType = FailureType.REGISTRATION_TIMEOUT  # why it was given up
    cancel_message: str = ""


class DecodePush(PushConnector):
    """The decode side of push-mode KV transfer for one engine rank."""

    role: Role = "decode"

    def _init_side(self) -> None:
        self._reg_q: queue.SimpleQueue[PushRegistration | None] = queue.SimpleQueue()
        self._recv: dict[str, _Recv] = {}
        self._heard: set[str] = set()  # prefill agents that greeted us (they hold our agent)
        # Registrations waiting for their prefill agent's greeting, by prefill engine.
        self._parked: dict[str, list[PushRegistration]] = {}
        self._parked_pruned = 0.0

    def _thread_targets(self) -> list[tuple[str, Callable[[], None]]]:
        return [("writer", self._writer_loop), *super()._thread_targets()]

    def _wake_threads(self) -> None:
        super()._wake_threads()
        self._reg_q.put(None)

    # --- greetings -------------------------------------------------------------------------

    def _greeted(self, agent: str, engine_id: str) -> None:
        with self._state_lock:
            self._heard.add(agent)
            parked = self._parked.pop(engine_id, [])
        for reg in parked:
            self._reg_q.put(reg)
        if parked:
            signal_event(self._wake)

    def agents_removed(self, engine_id: str, agents: Mapping[int, str]) -> None:
        """The engine's agents left (evicted, replaced): it no longer greets us, and the
        registrations parked for its greeting are dropped (their requests end at their
        deadline, as any never sent)."""
        agent = agents.get(self.tp_rank)
        with self._state_lock:
            self._heard.discard(agent or "")
            self._parked.pop(engine_id, None)

    # --- transitions -----------------------------------------------------------------------

    def _advance(self, rid: str, rec: _Recv, event: RecvEvent) -> RecvAction | None:
        """Moves `rec` by `event` (call under the state lock); an ended request leaves the
        table. None when the event changes nothing in its phase."""
        step = advance_recv(rec.phase, event)
        if step is None:
            return None
        rec.phase, action = step
        if rec.phase in (Recv.DONE, Recv.FAILED):
            del self._recv[rid]
        return action

    def _end_failed(self, rid: str, rec: _Recv, reason: FailureType, message: str) -> None:
        self._record_and_report(rid, rec.prefill_engine_id, reason, message)

    # --- engine-thread API ---------------------------------------------------------------

    def request_receive(
        self,
        request_id: str,
        prefill_engine_id: str,
        block_ids: Sequence[int],
        first_block: int = 0,
        prompt_digest: str = "",
    ) -> None:
        """Asks the prefill engine to push `request_id` into `block_ids` (its blocks from
        `first_block` on); `prompt_digest` (`protocol.prompt_digest` of the prompt's token
        ids, where known) lets the prefill check a request it finds by another name."""
        cfg = self.config
        now = self._clock()
        expires_at = self._wall() + cfg.registration_timeout_s
        reg = PushRegistration(
            request_id=request_id,
            decode_engine_id=self.engine_id,
            prefill_engine_id=prefill_engine_id,
            block_ids=list(block_ids),
            decode_tp_rank=self.tp_rank,
            expires_at=expires_at,
            write_timeout_s=cfg.transfer_timeout_s,
            first_block=first_block,
            prompt_digest=prompt_digest,
        )
        give_up_at = now + cfg.registration_timeout_s + cfg.transfer_timeout_s + cfg.cancel_margin_s
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("the connector is stopped")
            if request_id in self._recv or request_id in self._ended:
                raise ValueError(f"request {request_id} was already submitted")
            self._recv[request_id] = _Recv(
                prefill_engine_id,
                reg.block_ids,
                now + cfg.registration_timeout_s,
                give_up_at,
                expires_at,
            )
        self._reg_q.put(reg)
        signal_event(self._wake)

    def abandon(self, request_id: str, reason: FailureType, message: str) -> None:
        """A registration not yet sent ends at once; one sent is cancelled (to the agent it
        went to) and ends when that agent answers, or past the last moment a WRITE could
        land."""
        now = self._clock()
        with self._state_lock:
            rec = self._recv.get(request_id)
            if rec is None:
                return
            if rec.phase is Recv.REGISTERED:
                rec.cancel_reason, rec.cancel_message = reason, message
            rec.deadline = min(rec.deadline, now)
            action = self._advance(request_id, rec, RecvEvent.GIVE_UP)
        if action is RecvAction.END:
            self._end_failed(request_id, rec, reason, f"{message} (never sent)")
        elif action is RecvAction.SEND_CANCEL:
            self._send_cancel(request_id, rec)
        signal_event(self._wake)

    def in_flight(self) -> int:
        with self._state_lock:
            return len(self._recv)

    def settles_within(self) -> float:
        now = self._clock()
        with self._state_lock:
            last = max((rec.give_up_at for rec in self._recv.values()), default=now)
        return max(0.0, last - now) + (self.config.deadline_check_s if last > now else 0.0)

    def _stop_pending(self, why: str) -> None:
        with self._state_lock:
            ended = list(self._recv.items())
            actions = [self._advance(rid, rec, RecvEvent.STOP) for rid, rec in ended]
        for (rid, rec), action in zip(ended, actions, strict=True):
            if action is RecvAction.SEND_CANCEL:
                self._send_cancel(rid, rec)
            self._end_failed(rid, rec, FailureType.SHUTDOWN, why)

    # --- the registration writer ---------------------------------------------------------

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            reg = self._reg_q.get()
            if reg is None:
                continue
            self._write_registration(reg)

    def flush_registrations(self) -> int:
        """Sends the registrations queued so far on the calling thread (what the writer
        thread does; for callers that run without it); returns how many were taken."""
        n = 0
        while True:
            try:
                reg = self._reg_q.get_nowait()
            except queue.Empty:
                return n
            if reg is None:
                continue
            self._write_registration(reg)
            n += 1

    def _write_registration(self, reg: PushRegistration) -> None:
        try:
            self.send_registration(reg)
        except Exception as exc:  # never let one request kill the writer
            log.exception("registration writer")
            self._send_failed(reg.request_id, repr(exc))

    def _send_failed(self, rid: str, message: str) -> None:
        with self._state_lock:
            rec = self._recv.get(rid)
            action = self._advance(rid, rec, RecvEvent.SEND_FAILED) if rec else None
        if rec is not None and action is RecvAction.END:
            self._end_failed(rid, rec, FailureType.PUSH_REG_NOTIF_FAILED, message)

    def send_registration(self, reg: PushRegistration) -> None:
        """Sends the registration of a request still QUEUED to the prefill engine's agent of
        our TP rank (writer thread) and binds the request to that agent; one given up
        meanwhile is not sent. Waits (parked) for that agent's greeting first."""
        rid = reg.request_id
        agent = self.registry.snapshot(reg.prefill_engine_id).get(self.tp_rank)
        if agent is None:
            why = (
                f"engine {reg.prefill_engine_id} has no rank {self.tp_rank}"
                if self.registry.snapshot(reg.prefill_engine_id)
                else f"No remote agents for engine {reg.prefill_engine_id}"
            )
            self._send_failed(rid, why)
            return
        with self._state_lock:
            rec = self._recv.get(rid)
            if rec is None or rec.phase is not Recv.QUEUED:
                return  # ended (given up, stopped) before its turn, or sent already
            if self.config.greet_peers and agent not in self._heard:
                # Not greeted yet: that process does not hold us (a registration would
                # be dropped there). It waits for the greeting, within its timeout.
                self._parked.setdefault(reg.prefill_engine_id, []).append(reg)
                return
            rec.agent = agent  # before the send: its answer may come at once
            self._advance(rid, rec, RecvEvent.SENT)
        try:
            self.deliver_registration(reg, agent)
        except TransportError as exc:
            self._send_failed(rid, f"sending registration to rank {self.tp_rank} ({agent}): {exc}")

    def deliver_registration(self, reg: PushRegistration, agent: str | None = None) -> str:
        """Sends `reg` to `agent` (default: the prefill engine's agent of our rank, from a
        registry snapshot taken under the lock; the send runs outside it, so an eviction
        the moment after makes it fail cleanly); no request state is read or changed (the
        registration writer's data path, which the registry benchmark measures alone).
        Raises TransportError when it cannot be sent (counted against the peer)."""
        given = agent is not None
        if agent is None:
            # The agent, and the engine marked in use, in one pass under the lock.
            agent = self.registry.use(reg.prefill_engine_id, self.tp_rank)
            if agent is None:
                raise TransportError(f"No remote agents for engine {reg.prefill_engine_id}")
        try:
            self.transport.send_notif(agent, encode_notification(reg))
        except TransportError as exc:
            self._transport_failed(reg.prefill_engine_id, agent, exc)
            raise
        if given:
            self.registry.touch(reg.prefill_engine_id)
        return agent

    def _send_cancel(self, request_id: str, rec: _Recv) -> None:
        """PUSH_CANCEL to the agent the request was registered with, while it is held; an
        agent evicted since cannot be told (the give-up deadline then ends the request)."""
        if not rec.agent or self.registry.owner_of(rec.agent) is None:
            return
        cancel = PushCancel(
            request_id=request_id,
            decode_engine_id=self.engine_id,
            prefill_engine_id=rec.prefill_engine_id,
            decode_tp_rank=self.tp_rank,
        )
        try:
            self.transport.send_notif(rec.agent, encode_notification(cancel))
        except TransportError as exc:
            if exc.kind == "not_found":
                return  # evicted meanwhile: the deadline ends it
            self.metrics.record_failure(
                FailureType.NOTIFICATION_FAILED,
                {"request_id": request_id, "engine_id": rec.prefill_engine_id, "msg": str(exc)},
                level=logging.INFO,
            )
            self._transport_failed(rec.prefill_engine_id, rec.agent, exc)

    # --- notifications -------------------------------------------------------------------

    def _on_message(self, agent_name: str, msg: Notification) -> None:
        if isinstance(msg, PushDone):
            self._on_answer(agent_name, msg.prefill_engine_id, msg.request_ids, None)
        elif isinstance(msg, PushFail):
            self._on_answer(agent_name, msg.prefill_engine_id, [msg.request_id], msg)
        else:  # registrations and cancels are the prefill's to receive
            self.metrics.reject("notification")

    def _on_answer(
        self, agent_name: str, prefill_engine_id: str, rids: list[str], fail: PushFail | None
    ) -> None:
        """A completion (`fail` None) or a failure from `agent_name`: it ends the requests
        registered with exactly that agent; anything else is counted and dropped."""
        event = RecvEvent.COMPLETED if fail is None else RecvEvent.REFUSED
        ended: list[tuple[str, _Recv, Recv]] = []
        with self._state_lock:
            for rid in rids:
                rec = self._recv.get(rid)
                if (
                    rec is None
                    or rec.agent != agent_name
                    or rec.prefill_engine_id != prefill_engine_id
                ):
                    continue
                prior = rec.phase
                if self._advance(rid, rec, event) is RecvAction.END:
                    ended.append((rid, rec, prior))
        if len(ended) < len(rids):
            self.metrics.reject("notification")  # late (ended), unknown or not its agent
        if not ended:
            return
        if fail is None:
            self.registry.peer_succeeded(prefill_engine_id, agent_name)
            for rid, _, _ in ended:
                self._report("recv", rid)
            return
        for rid, rec, prior in ended:
            if prior is Recv.CANCELLING:
                reason = rec.cancel_reason
                message = f"{self._why_given_up(rec)}; the prefill answered the cancel"
            else:
                reason, message = fail.reason, f"prefill refused: {fail.message}"
            self._end_failed(rid, rec, reason, message)

    def _why_given_up(self, rec: _Recv) -> str:
        if rec.cancel_message:
            return rec.cancel_message
        return f"no completion within {self.config.registration_timeout_s:g} s"

    # --- deadlines -----------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        unsent: list[tuple[str, _Recv]] = []
        cancels: list[tuple[str, _Recv]] = []
        given_up: list[tuple[str, _Recv]] = []
        with self._state_lock:
            if self._parked and now - self._parked_pruned >= 1.0:
                # Parked registrations of requests that ended meanwhile (once a second).
                self._parked_pruned = now
                self._parked = {
                    e: kept
                    for e, regs in self._parked.items()
                    if (kept := [r for r in regs if r.request_id in self._recv])
                }
            for rid, rec in list(self._recv.items()):
                if rec.deadline > now:
                    continue
                if rec.phase is Recv.QUEUED:
                    self._advance(rid, rec, RecvEvent.GIVE_UP)
                    unsent.append((rid, rec))
                elif rec.phase is Recv.REGISTERED:
                    self._advance(rid, rec, RecvEvent.GIVE_UP)
                    cancels.append((rid, rec))
                elif rec.give_up_at <= now:
                    # Decide at a later look, after one more pass of notifications: an
                    # answer may be queued behind a freeze of this process.
                    if rec.overdue_since is None:
                        rec.overdue_since = now
                    elif now - rec.overdue_since >= OVERDUE_GRACE_S:
                        self._advance(rid, rec, RecvEvent.UNANSWERED)
                        given_up.append((rid, rec))
        timeout = f"no completion within {self.config.registration_timeout_s:g} s"
        for rid, rec in unsent:  # the registration never left: nothing can land
            self._end_failed(rid, rec, FailureType.REGISTRATION_TIMEOUT, f"{timeout} (never sent)")
        for rid, rec in cancels:
            self._send_cancel(rid, rec)
        for rid, rec in given_up:
            if rec.agent:  # the prefill never answered: one more failed transfer of it
                why = f"request {rid} given up: the prefill did not answer its cancel"
                self._peer_failed(rec.prefill_engine_id, rec.agent, why, dropped=False)
            self._end_failed(
                rid,
                rec,
                rec.cancel_reason,
                f"{self._why_given_up(rec)}; the prefill engine did not answer the cancel",
            )

    def parked(self) -> int:
        """Registrations waiting for their prefill agent's greeting (`/v1/state`-free
        introspection for tests and the bench)."""
        with self._state_lock:
            return sum(len(regs) for regs in self._parked.values())

    def _load(self) -> str:
        with self._state_lock:
            return "waiting" if self._recv else "idle"
