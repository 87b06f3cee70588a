"""`BothPush`: both push halves for one rank of a kv_both engine (selective P/D).

vLLM's `kv_role: kv_both` engine decides each request's part from its `kv_transfer_params`:
it may prefill for a remote decode, decode from a remote prefill and serve plain requests at
once. `BothPush` owns the one thing the halves cannot each do alone on a shared NIXL agent:
reading its notifications. One progress thread takes them in arrival order and hands each to
the half it is for (registrations and cancels to the sending half, completions and failures
to the receiving half); greetings and registry events go to both. Each half keeps its own
requests, records and outcomes (`sending`, `receiving`): the two never share a request
record, so a prefill request and a remote prefill's request of the same id stay apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvtopo_worker.protocol import (
    FailureType,
    Notification,
    PushCancel,
    PushRegistration,
    Role,
)
from kvtopo_worker.push.core import Finished, PushConnector
from kvtopo_worker.push.decode import DecodePush
from kvtopo_worker.push.prefill import PrefillPush

_LOADS = ("idle", "waiting", "transferring")  # the progress loop's paces, slowest first


class BothPush(PushConnector):
    """The sending and the receiving half of one engine rank over one transport."""

    role: Role = "both"

    def _init_side(self) -> None:
        common = {
            "engine_id": self.engine_id,
            "transport": self.transport,
            "registry": self.registry,
            "metrics": self.metrics,
            "config": self.config,
            "clock": self._clock,
            "wall_clock": self._wall,
            "tp_rank": self.tp_rank,
            "block_len": self.block_len,
            "outcome_ready": self._outcome_ready,
            "part_of": self,
        }
        self.sending = PrefillPush(**common)  # type: ignore[arg-type]
        self.receiving = DecodePush(**common)  # type: ignore[arg-type]

    # --- life cycle ----------------------------------------------------------------------

    def _thread_targets(self) -> list[tuple[str, Callable[[], None]]]:
        return [("writer", self.receiving._writer_loop), ("progress", self._progress_loop)]

    def _wake_threads(self) -> None:
        self.receiving._wake_threads()  # the shared wake event, and the writer's queue

    def _stop_pending(self, why: str) -> None:
        # The halves are stopped too: neither takes a request after the engine stopped
        # (one taken then would never end).
        for half in (self.sending, self.receiving):
            with half._state_lock:
                half._stopped = True
            half._stop_pending(why)

    # --- registry events and greetings ---------------------------------------------------

    def _greeted(self, agent: str, engine_id: str) -> None:
        self.sending._greeted(agent, engine_id)
        self.receiving._greeted(agent, engine_id)

    def agents_removed(self, engine_id: str, agents: Mapping[int, str]) -> None:
        self.sending.agents_removed(engine_id, agents)
        self.receiving.agents_removed(engine_id, agents)

    # --- engine-thread API ---------------------------------------------------------------

    def request_receive(
        self,
        request_id: str,
        prefill_engine_id: str,
        block_ids: Sequence[int],
        first_block: int = 0,
        prompt_digest: str = "",
    ) -> None:
        self.receiving.request_receive(
            request_id, prefill_engine_id, block_ids, first_block, prompt_digest
        )

    def request_send(
        self,
        request_id: str,
        block_ids: Sequence[int],
        decode_engine_id: str | None = None,
        *,
        alias: str = "",
        prompt_digest: str = "",
    ) -> None:
        self.sending.request_send(
            request_id, block_ids, decode_engine_id, alias=alias, prompt_digest=prompt_digest
        )

    def abandon(self, request_id: str, reason: FailureType, message: str) -> None:
        """Gives `request_id` up on whichever half holds it (a caller that knows which calls
        that half: the ids of the two halves are separate spaces)."""
        self.sending.abandon(request_id, reason, message)
        self.receiving.abandon(request_id, reason, message)

    def flush_registrations(self) -> int:
        return self.receiving.flush_registrations()

    def in_flight(self) -> int:
        return self.sending.in_flight() + self.receiving.in_flight()

    def writing(self, request_id: str) -> bool:
        return self.sending.writing(request_id)

    def settles_within(self) -> float:
        return max(self.sending.settles_within(), self.receiving.settles_within())

    def get_finished(self) -> Finished:
        """Both halves' outcomes (each half's requests end exactly once there)."""
        sent, received = self.sending.get_finished(), self.receiving.get_finished()
        return Finished(
            done_sending=sent.done_sending,
            done_receiving=received.done_receiving,
            failed=[*sent.failed, *received.failed],
        )

    # --- the progress pass ---------------------------------------------------------------

    def _on_message(self, agent_name: str, msg: Notification) -> None:
        half = self.sending if isinstance(msg, PushRegistration | PushCancel) else self.receiving
        half._on_message(agent_name, msg)

    def _progress_side(self) -> None:
        self.sending._progress_side()

    def _expire(self, now: float) -> None:
        self.sending._expire(now)
        self.receiving._expire(now)

    def _load(self) -> str:
        return max(self.sending._load(), self.receiving._load(), key=_LOADS.index)
