"""The operator's client for the worker control API (`kvtopo_worker.agent`).

Owns the HTTP calls the operator makes to engine pods: read `/v1/state`, add a peer
(`PUT /v1/peers/{id}`), evict a peer (`DELETE /v1/peers/{id}`), or both for many peers in
one call (`PATCH /v1/peers`, falling back to single calls for a worker that lacks it), each
with the bearer token, a timeout and a shared connection pool. Decodes answers with the
worker's wire protocol (`kvtopo_worker.protocol`, which imports neither torch nor nixl).
Called by `reconcile`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from kvtopo_operator.logic import FailureView, WorkerUnreachable, WorkerView
from kvtopo_worker.protocol import (
    ErrorBody,
    PeerAddItem,
    PeerChanges,
    PeerChangesResult,
    PeerResult,
    WorkerState,
)

PEER_BATCH_CONCURRENCY = 16  # the worker's handshakes of one batch running at once


@dataclass(frozen=True)
class CallResult:
    ok: bool
    status: int  # HTTP status, 0 when the worker could not be reached
    message: str
    result: str = ""  # PeerResult.result on success


class WorkerClient:
    """Async client for many workers; one pool, bounded by the caller's semaphore."""

    def __init__(self, token_file: Path | None, token: str | None = None) -> None:
        self._token_file = token_file
        self._token = token
        self._file_token = ""
        self._file_mtime = -1.0
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        token = self._token
        if token is None and self._token_file is not None:
            # Re-read only when the mounted Secret changes (rotation), not on every call.
            mtime = self._token_file.stat().st_mtime
            if mtime != self._file_mtime:
                self._file_token = self._token_file.read_text().strip()
                self._file_mtime = mtime
            token = self._file_token
        return {"Authorization": f"Bearer {token}"} if token else {}

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

    async def add_peer(
        self,
        endpoint: str,
        peer_engine_id: str,
        peer_endpoint: str,
        peer_role: str,
        timeout_s: float,
    ) -> CallResult:
        body = {"endpoint": peer_endpoint, "role": peer_role}
        return await self._call("PUT", endpoint, peer_engine_id, body, timeout_s)

    async def evict_peer(self, endpoint: str, engine_id: str, timeout_s: float) -> CallResult:
        return await self._call("DELETE", endpoint, engine_id, None, timeout_s)

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
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            failed = CallResult(False, 0, f"{type(exc).__name__}: {exc}"[:300])
            return dict.fromkeys(keys, failed)
        if status in (404, 405):  # a worker from before batches: one call per peer
            out: dict[tuple[str, str], CallResult] = {}
            for (op, engine_id), res in zip(
                keys,
                await asyncio.gather(
                    *(self.add_peer(endpoint, e, ep, r, timeout_s) for e, ep, r in adds),
                    *(self.evict_peer(endpoint, e, timeout_s) for e in evicts),
                ),
                strict=True,
            ):
                out[(op, engine_id)] = res
            return out
        if status != 200:
            failed = CallResult(False, status, _error_message(data))
            return dict.fromkeys(keys, failed)
        try:
            answer = msgspec.json.decode(data, type=PeerChangesResult)
        except msgspec.DecodeError as exc:
            return dict.fromkeys(keys, CallResult(False, 502, f"bad batch answer: {exc}"))
        out = {}
        for item in answer.results:
            ok = item.status == 200
            message = "" if ok else f"{item.error}: {item.message}"
            out[(item.op, item.engine_id)] = CallResult(ok, item.status, message, item.result)
        for key in keys:  # an item the worker did not answer has failed
            out.setdefault(key, CallResult(False, 502, "the worker's answer left it out"))
        return out

    async def _call(
        self, method: str, endpoint: str, engine_id: str, body: object, timeout_s: float
    ) -> CallResult:
        try:
            session = await self._http()
            async with session.request(
                method,
                f"http://{endpoint}/v1/peers/{engine_id}",
                json=body,
                headers=self._headers(),
                # The worker fetches the peer's metadata itself within this budget.
                timeout=aiohttp.ClientTimeout(total=timeout_s + 2),
            ) as resp:
                data = await resp.read()
                if resp.status == 200:
                    res = msgspec.json.decode(data, type=PeerResult)
                    return CallResult(True, 200, "", res.result)
                return CallResult(False, resp.status, _error_message(data))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return CallResult(False, 0, f"{type(exc).__name__}: {exc}"[:300])


def _error_message(data: bytes) -> str:
    try:
        err = msgspec.json.decode(data, type=ErrorBody)
        return f"{err.error}: {err.message}"
    except msgspec.DecodeError:
        return data[:300].decode(errors="replace")
