"""The operator's client for the worker control API (`kvtopo_worker.agent`).

Owns the HTTP calls the operator makes to engine pods: read `/v1/state`, and add and evict
peers, all of one worker's in one call (`PATCH /v1/peers`), each with the bearer token, a
timeout and a shared connection pool. Decodes answers with the worker's wire protocol
(`kvtopo_worker.protocol`, which imports neither torch nor nixl) and reads the token as the
worker does (`kvtopo_worker.credentials`: a file that holds no token fails the call, naming
the file). Called by `reconcile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from kvtopo_operator.logic import FailureView, WorkerUnreachable, WorkerView
from kvtopo_worker.credentials import TokenError, TokenSource
from kvtopo_worker.protocol import (
    PEER_BATCH_CONCURRENCY,
    ErrorBody,
    PeerAddItem,
    PeerChanges,
    PeerChangesResult,
    WorkerState,
)


@dataclass(frozen=True)
class CallResult:
    ok: bool
    status: int  # HTTP status, 0 when the worker could not be reached
    message: str
    result: str = ""  # PeerResult.result on success


class WorkerClient:
    """Async client for many workers; one pool, bounded by the caller's semaphore."""

    def __init__(self, token_file: Path | None, token: str | None = None) -> None:
        """`token` (when set) wins over `token_file`; with neither, calls carry no token.
        A token file that holds no token raises TokenError here, and fails each call while
        it holds none (it is re-read when the mounted Secret changes, not on every call)."""
        self._token: TokenSource | None = None
        if token:
            self._token = TokenSource(value=token)
        elif token_file is not None:
            self._token = TokenSource(path=token_file)
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        """The Authorization header; raises TokenError while the token file is bad."""
        if self._token is None:
            return {}
        return {"Authorization": f"Bearer {self._token.current()}"}

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, force_close=False)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def state(self, endpoint: str, timeout_s: float) -> WorkerView | WorkerUnreachable:
        try:
            session = await self._http()
            async with session.get(
                f"http://{endpoint}/v1/state",
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return WorkerUnreachable(f"HTTP {resp.status}: {body[:200]!r}")
            st = msgspec.json.decode(body, type=WorkerState)
        except TokenError as exc:
            return WorkerUnreachable(str(exc)[:300])
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError) as exc:
            return WorkerUnreachable(f"{type(exc).__name__}: {exc}"[:300])
        lf = st.last_failure
        return WorkerView(
            engine_id=st.engine_id,
            role=st.role,
            compat_hash=st.compat_hash,
            peers=frozenset(p.engine_id for p in st.peers),
            evicting=frozenset(p.engine_id for p in st.peers if p.eviction_pending),
            failures=dict(st.failures),
            last_failure=None
            if lf is None
            else FailureView(lf.time, lf.type.value, lf.request_id, lf.engine_id, lf.message),
        )

    async def change_peers(
        self,
        endpoint: str,
        adds: list[tuple[str, str, str]],
        evicts: list[str],
        timeout_s: float,
    ) -> dict[tuple[str, str], CallResult]:
        """Adds peers (engine id, endpoint, role) and evicts peers (engine id) on one worker
        in one call; the result of each, keyed by ("add" | "evict", engine id). A failed call
        fails every item with its reason."""
        body = msgspec.json.encode(
            PeerChanges(
                add=[PeerAddItem(engine_id=e, endpoint=ep, role=r) for e, ep, r in adds],  # type: ignore[arg-type]
                evict=evicts,
            )
        )
        keys = [("add", e) for e, _, _ in adds] + [("evict", e) for e in evicts]
        # Each add may take the worker up to `timeout_s` (it fetches the peer's metadata).
        rounds = -(-len(adds) // PEER_BATCH_CONCURRENCY) if adds else 1
        try:
            session = await self._http()
            async with session.patch(
                f"http://{endpoint}/v1/peers",
                data=body,
                headers={**self._headers(), "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout_s * rounds + 2),
            ) as resp:
                data = await resp.read()
                status = resp.status
        except TokenError as exc:
            return dict.fromkeys(keys, CallResult(False, 0, str(exc)[:300]))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            failed = CallResult(False, 0, f"{type(exc).__name__}: {exc}"[:300])
            return dict.fromkeys(keys, failed)
        if status != 200:
            failed = CallResult(False, status, _error_message(data))
            return dict.fromkeys(keys, failed)
        try:
            answer = msgspec.json.decode(data, type=PeerChangesResult)
        except msgspec.DecodeError as exc:
            return dict.fromkeys(keys, CallResult(False, 502, f"bad batch answer: {exc}"))
        out: dict[tuple[str, str], CallResult] = {}
        for item in answer.results:
            ok = item.status == 200
            message = "" if ok else f"{item.error}: {item.message}"
            out[(item.op, item.engine_id)] = CallResult(ok, item.status, message, item.result)
        for key in keys:  # an item the worker did not answer has failed
            out.setdefault(key, CallResult(False, 502, "the worker's answer left it out"))
        return out


def _error_message(data: bytes) -> str:
    try:
        err = msgspec.json.decode(data, type=ErrorBody)
        return f"{err.error}: {err.message}"
    except msgspec.DecodeError:
        return data[:300].decode(errors="replace")
