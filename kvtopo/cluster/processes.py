"""Control-plane processes: started in their own process group, logged, and stopped for good.

Owns the OS side of the local control plane. Every component runs in its own session (so
its own process group, out of reach of the terminal's Ctrl-C, which the Python side turns
into an orderly stop instead) with stdout and stderr in one log file. A
:class:`ProcessRecord` (pid plus the kernel's start time of that pid) is what survives in
the cluster's state file, so that ``kvtopo cluster down`` from another process stops exactly
these processes and never an unrelated one that reused a pid.

Called by :mod:`kvtopo.cluster.local_cluster`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0
KILL_GRACE_S = 5.0
POLL_INTERVAL_S = 0.05


class ControlPlaneProcessError(RuntimeError):
    """A component failed to start or exited early; the message carries its log's tail."""

    def __init__(self, name: str, problem: str, log: Path) -> None:
        self.name = name
        self.log = log
        super().__init__(
            f"{name} {problem}; last lines of {log}:\n{log_tail(log) or '(log is empty)'}"
        )


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log`` ('' when it does not exist)."""
    try:
        with log.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ..." where comm may hold spaces and parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


@dataclass(frozen=True)
class ProcessRecord:
    """What identifies one running component across processes (kept in the state file)."""

    name: str
    pid: int
    start_ticks: int
    log: str

    def is_alive(self) -> bool:
        """True while this very process runs (a zombie or a reused pid counts as gone)."""
        stat = _proc_stat(self.pid)
        return stat is not None and stat[1] == self.start_ticks and stat[0] not in "ZX"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(str(data["name"]), int(data["pid"]), int(data["start_ticks"]), str(data["log"]))


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    if not record.is_alive():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(record.pid, sig)  # the component leads its own group: pgid == pid


def _wait_gone(records: list[ProcessRecord], deadline: float) -> list[ProcessRecord]:
    alive = [record for record in records if record.is_alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        alive = [record for record in alive if record.is_alive()]
    return alive


def stop_processes(
    records: Iterable[ProcessRecord],
    grace_s: float = STOP_GRACE_S,
) -> list[str]:
    """SIGTERM every record's process group, SIGKILL what outlives ``grace_s``, wait.

    Returns the names that had to be killed. Raises if anything survives SIGKILL.
    """
    pending = list(records)
    for record in pending:
        _signal_group(record, signal.SIGTERM)
    survivors = _wait_gone(pending, time.monotonic() + grace_s)
    for record in survivors:
        _signal_group(record, signal.SIGKILL)
    undead = _wait_gone(survivors, time.monotonic() + KILL_GRACE_S)
    if undead:
        names = ", ".join(f"{record.name} (pid {record.pid})" for record in undead)
        raise RuntimeError(f"control-plane processes survived SIGKILL: {names}")
    return [record.name for record in survivors]


class ComponentProcess:
    """One control-plane component started by this Python process."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        *,
        die_with_parent: bool,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.die_with_parent = die_with_parent
        self.env = dict(env) if env is not None else None
        self._popen: subprocess.Popen[bytes] | None = None
        self._record: ProcessRecord | None = None

    def start(self) -> ProcessRecord:
        argv = list(self.argv)
        setpriv = shutil.which("setpriv")
        if self.die_with_parent and setpriv:
            # The kernel sends SIGKILL when this Python process dies (even by SIGKILL), so a
            # killed test run leaves no control plane behind. KILL, not TERM: with etcd gone
            # too, kube-apiserver's graceful shutdown would hang on etcd for long seconds.
            # setpriv execs the component: the pid and process group stay the component's.
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            try:
                self._popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=self.env,
                    close_fds=True,
                )
            except OSError as error:
                raise ControlPlaneProcessError(
                    self.name, f"could not be started ({error})", self.log
                ) from error
        stat = _proc_stat(self._popen.pid)
        self._record = ProcessRecord(
            self.name, self._popen.pid, stat[1] if stat else -1, str(self.log)
        )
        return self._record

    @property
    def record(self) -> ProcessRecord:
        if self._record is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._record

    @property
    def started(self) -> bool:
        return self._popen is not None

    def check_running(self) -> None:
        """Raise :class:`ControlPlaneProcessError` when the component has exited."""
        if self._popen is None:
            raise RuntimeError(f"{self.name} was not started")
        code = self._popen.poll()
        if code is not None:
            raise ControlPlaneProcessError(self.name, f"exited early with code {code}", self.log)

    def reap(self) -> None:
        """Collect the exit status once the process is gone (no zombie left behind)."""
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=KILL_GRACE_S)
