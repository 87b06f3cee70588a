"""Orphaned tmpfs etcd folders (left by runs killed outright) are swept, live ones kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtopo.cluster import local_cluster
from kvtopo.cluster.processes import ComponentProcess, stop_processes


def _folder(root: Path, name: str, age_s: float) -> Path:
    path = root / f"{local_cluster.ETCD_DATA_PREFIX}{name}"
    (path / "member").mkdir(parents=True)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_sweep_removes_only_old_unused_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_cluster, "TMPFS", tmp_path)
    orphan = _folder(tmp_path, "orphan", age_s=3600)
    young = _folder(tmp_path, "young", age_s=0)
    in_use = _folder(tmp_path, "inuse", age_s=3600)
    unrelated = tmp_path / "someone-else"
    unrelated.mkdir()
    os.utime(unrelated, (0, 0))
    # A live process naming the folder on its command line, as etcd's --data-dir does.
    holder = ComponentProcess(
        "holder",
        ["/bin/sh", "-c", "sleep 60; :", "sh", f"--data-dir={in_use}"],
        tmp_path / "holder.log",
        die_with_parent=True,
    )
    record = holder.start()
    try:
        # The sweep reads command lines from /proc: wait until the holder's is sh's (on a
        # busy machine the fork can still be running Python's when the sweep looks).
        cmdline = Path(f"/proc/{record.pid}/cmdline")
        deadline = time.monotonic() + 30
        while f"--data-dir={in_use}".encode() not in cmdline.read_bytes():
            assert time.monotonic() < deadline, "the holder never exec'd its command"
            time.sleep(0.01)
        removed = local_cluster.sweep_orphaned_etcd_data(min_age_s=60)
    finally:
        stop_processes([holder.record])
        holder.reap()
    assert removed == [orphan]
    assert not orphan.exists()
    assert young.exists()
    assert in_use.exists()
    assert unrelated.exists()
