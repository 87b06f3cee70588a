"""Process groups, early-exit reports and stops, with plain shell processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.processes import (
    ComponentProcess,
    ControlPlaneProcessError,
    ProcessRecord,
    stop_processes,
)


def _start(tmp_path: Path, name: str, script: str) -> ComponentProcess:
    process = ComponentProcess(
        name, ["/bin/sh", "-c", script], tmp_path / f"{name}.log", die_with_parent=True
    )
    process.start()
    return process


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def test_early_exit_names_the_process_and_its_log_tail(tmp_path: Path) -> None:
    process = _start(tmp_path, "fake-apiserver", "echo 'listen tcp: no such flag'; exit 3")
    try:
        with pytest.raises(ControlPlaneProcessError) as raised:
            wait_until(process.check_running, 10, "the process to exit")
        message = str(raised.value)
        assert message.startswith("fake-apiserver exited early with code 3")
        assert "listen tcp: no such flag" in message
    finally:
        stop_processes([process.record])
        process.reap()


def test_component_leads_its_own_process_group(tmp_path: Path) -> None:
    process = _start(tmp_path, "sleeper", "exec sleep 60")
    try:
        assert os.getpgid(process.record.pid) == process.record.pid
        assert os.getpgid(process.record.pid) != os.getpgrp()
        assert process.record.is_alive()
    finally:
        stop_processes([process.record])
        process.reap()
    assert not process.record.is_alive()


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    # The shell ignores SIGTERM and so does its child: only SIGKILL to the group ends both.
    child_file = tmp_path / "child"
    process = _start(tmp_path, "stubborn", f"trap '' TERM; sleep 60 & echo $! > {child_file}; wait")
    wait_until(lambda: child_file.exists() and child_file.read_text().strip(), 10, "child pid")
    child = int(child_file.read_text())
    killed = stop_processes([process.record], grace_s=0.5)
    process.reap()
    assert killed == ["stubborn"]
    assert not process.record.is_alive()
    # The child was signalled with its group: gone (at most a zombie awaiting its reaper).
    wait_until(lambda: _gone(child), 5, f"child {child} of the stubborn group to die")


def test_reused_pid_is_not_the_recorded_process(tmp_path: Path) -> None:
    process = _start(tmp_path, "sleeper", "exec sleep 60")
    try:
        record = process.record
        stranger = ProcessRecord(record.name, record.pid, record.start_ticks + 1, record.log)
        assert record.is_alive()
        assert not stranger.is_alive()
        assert stop_processes([stranger]) == []  # not signalled: not ours
        assert record.is_alive()
    finally:
        stop_processes([process.record])
        process.reap()


def test_record_survives_the_state_file_round_trip() -> None:
    record = ProcessRecord("etcd", 123, 456, "/c/logs/etcd.log")
    assert ProcessRecord.from_json(record.to_json()) == record
