"""The drill's credentials, as a cluster's Secrets and each pod's mounted copy of them.

Owns the operator's key pair (its private half what the operator, and the drill's router as
the drill's observer, sign the workers' admin calls with; its public half what engines
verify those calls with) and the client token (what the router presents on the engines'
traffic routes): a master copy, and one mounted copy per holder, written the way kubelet
updates a Secret volume: the whole file replaced at once, on each pod at its own moment.
An engine's mount holds the public key and the client token only: nothing in it can sign a
call or mint a ticket (`kvtopo_worker.signing`).

`rotate` replaces both under traffic as `docs/install.md` tells an operator user to: first
every copy becomes "new, then old" (signers sign with the first key the engine lists in its
challenge, verifiers accept both), pod by pod in random order; then, once every copy has the
new one, the old one is dropped, pod by pod again. A holder that has not been updated yet
still talks to one that has, so a rotation costs no request. Called by `fleet` and `run`.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from kvtopo_worker.signing import new_private_key, private_pem, public_pem

SIGNERS = frozenset({"operator", "standby", "router"})
"""Holders that mount the private key (the operator's replicas and the drill's observer)."""


@dataclass(frozen=True)
class Mount:
    """One holder's mounted copies: the operator's private key (signers only), its public
    key and the client token."""

    operator_key: Path | None
    operator_public: Path
    client_token: Path


def _write(path: Path, text: str) -> None:
    """Replaces `path` at once (a new file renamed over it), as kubelet swaps a Secret
    volume's contents: a reader sees the old text or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def new_token() -> str:
    return secrets.token_urlsafe(32)


class DrillSecrets:
    """The credentials of one drill and their mounted copies, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.keys: list[ec.EllipticCurvePrivateKey] = [new_private_key()]
        self.tokens: list[str] = [new_token()]
        self.mounts: dict[str, Mount] = {}
        self.rotations = 0

    def _sync(self, mount: Mount) -> None:
        if mount.operator_key is not None:
            _write(mount.operator_key, "".join(private_pem(k) for k in self.keys))
        _write(mount.operator_public, "".join(public_pem(k) for k in self.keys))
        _write(mount.client_token, "\n".join(self.tokens) + "\n")

    def mount(self, holder: str) -> Mount:
        """The holder's copies (created from the Secrets as they are now, when new)."""
        if holder in self.mounts:
            return self.mounts[holder]
        folder = self.root / holder
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        mount = Mount(
            operator_key=folder / "operator.key" if holder in SIGNERS else None,
            operator_public=folder / "operator.pub",
            client_token=folder / "client-token",
        )
        self._sync(mount)
        self.mounts[holder] = mount
        return mount

    def unmount(self, holder: str) -> None:
        """The holder is gone (its pod deleted): its copies go with it."""
        if self.mounts.pop(holder, None) is not None:
            shutil.rmtree(self.root / holder, ignore_errors=True)

    async def _sync_all(self, spread_s: float, rng: random.Random) -> int:
        """Copies the Secrets to every holder, one at a time in random order, over about
        `spread_s` seconds; how many holders were updated."""
        holders = sorted(self.mounts)
        rng.shuffle(holders)
        for holder in holders:
            mount = self.mounts.get(holder)
            if mount is not None:  # not gone meanwhile
                self._sync(mount)
            await asyncio.sleep(rng.uniform(0, 2 * spread_s / max(1, len(holders))))
        return len(holders)

    async def rotate(
        self, spread_s: float, rng: random.Random, mark: Callable[[str], None]
    ) -> None:
        """Replaces the key pair and the client token, overlap-safe (see the module
        docstring)."""
        self.keys = [new_private_key(), self.keys[0]]
        self.tokens = [new_token(), self.tokens[0]]
        mark("rotation: a new key pair and client token in the Secrets (the old ones kept)")
        n = await self._sync_all(spread_s, rng)
        mark(f"rotation: {n} mounted copies hold the new and the old ones")
        self.keys = self.keys[:1]
        self.tokens = self.tokens[:1]
        n = await self._sync_all(spread_s, rng)
        self.rotations += 1
        mark(f"rotation: old key and token dropped from the Secrets and {n} mounted copies")
