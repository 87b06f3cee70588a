"""The drill's two credentials, as a cluster's Secrets and each pod's mounted copy of them.

Owns the operator credential (what the operator, and the drill's router, present on the
workers' admin routes) and the peer credential (what workers present to fetch each other's
metadata), each a Secret of the drill's namespace: a master copy, and one mounted copy per
holder (each engine, the operator, the router), written the way kubelet updates a Secret
volume: the whole file replaced at once, on each pod at its own moment.

`rotate` replaces both credentials under traffic as `docs/install.md` tells an operator
user to: first every copy becomes "new token, then the old one" (holders send the new one
and accept both), pod by pod in random order; then, once every copy has the new token, the
old one is dropped, pod by pod again. A holder that has not been updated yet still talks to
one that has (the previous token is accepted, and a refused current token is retried with
the previous one), so a rotation costs no request. Called by `fleet` and `run`.
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

KINDS = ("operator", "peer")


@dataclass(frozen=True)
class Mount:
    """One holder's mounted copies: its operator credential and its peer credential."""

    operator: Path
    peer: Path


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
        self.master: dict[str, list[str]] = {kind: [new_token()] for kind in KINDS}
        self.mounts: dict[str, Mount] = {}
        self.rotations = 0

    def _text(self, kind: str) -> str:
        return "\n".join(self.master[kind]) + "\n"

    def mount(self, holder: str) -> Mount:
        """The holder's copies (created from the Secrets as they are now, when new)."""
        if holder in self.mounts:
            return self.mounts[holder]
        folder = self.root / holder
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        mount = Mount(operator=folder / "operator-token", peer=folder / "peer-token")
        _write(mount.operator, self._text("operator"))
        _write(mount.peer, self._text("peer"))
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
                _write(mount.operator, self._text("operator"))
                _write(mount.peer, self._text("peer"))
            await asyncio.sleep(rng.uniform(0, 2 * spread_s / max(1, len(holders))))
        return len(holders)

    async def rotate(
        self, spread_s: float, rng: random.Random, mark: Callable[[str], None]
    ) -> None:
        """Replaces both credentials, overlap-safe (see the module docstring)."""
        for kind in KINDS:
            self.master[kind] = [new_token(), self.master[kind][0]]
        mark("rotation: new tokens in the Secrets (the old ones kept as previous)")
        n = await self._sync_all(spread_s, rng)
        mark(f"rotation: {n} mounted copies hold the new and the old tokens")
        for kind in KINDS:
            self.master[kind] = self.master[kind][:1]
        n = await self._sync_all(spread_s, rng)
        self.rotations += 1
        mark(f"rotation: old tokens dropped from the Secrets and {n} mounted copies")
