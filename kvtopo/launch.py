"""Starting kvtopo's own processes (a `kvtopo-worker` and the operator) and stopping a process.

Owns the command lines of kvtopo's two programs and how they are started: a `kvtopo-worker`
(the emulated engine, :data:`WORKER_MODULE`) prints one JSON line ``{engine_id, endpoint,
role}`` on stdout once it serves, and :func:`start_worker` waits for that line on the real
pipe, with a deadline, and raises :class:`LaunchError` carrying the worker's log tail when it
does not come; :func:`parse_ready_line` reads that line (also for the drill's asyncio fleet,
which spawns workers with :func:`worker_command`). The operator (:data:`OPERATOR_MODULE`) runs
with :func:`operator_args` (or a caller's own arguments, such as the Helm chart's) through
:func:`start_operator`, its stdout and stderr in one log file; several replicas of which one
acts add :func:`leader_election_args`. :func:`stop_process` stops a
child for good: a signal (SIGTERM), a grace period, then SIGKILL.

Launches the programs by module name and imports neither of them (nor the drill or the
benchmarks). Called by the drill (:mod:`kvtopo.drill.run`, :mod:`kvtopo.drill.fleet`), the
operator benchmark (`kvtopo_bench.operator`) and the integration tests.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtopo.cluster.processes import KILL_GRACE_S, STOP_GRACE_S, log_tail
from kvtopo.localkeys import Credentials

WORKER_MODULE = "kvtopo_worker.emulated"
"""The `kvtopo-worker` command's module."""
ENGINE_MODULES = {"emulated": WORKER_MODULE, "vllm": "kvtopo_worker.vllm.engine"}
"""The engines a worker process may run: the emulated engine, or vLLM's scheduler with
KVTopoConnector (the same command line and ready line, and the same traffic routes)."""
OPERATOR_MODULE = "kvtopo_operator.main"
"""The `kvtopo-operator` command's module."""


class LaunchError(RuntimeError):
    """A process did not start; the message carries the last lines of its log."""


@dataclass(frozen=True)
class WorkerReady:
    """What a worker's ready line says: who it is and where its control API listens."""

    engine_id: str
    endpoint: str
    incarnation: str = ""  # the worker process's boot id (new on every start)


@dataclass(frozen=True)
class StartedWorker:
    """A serving `kvtopo-worker` child (its stdout stays a pipe, its stderr in `log_path`)."""

    role: str
    proc: subprocess.Popen[str]
    engine_id: str
    endpoint: str
    log_path: Path
    incarnation: str = ""


def worker_command(
    role: str,
    token_file: Path,
    *extra: str,
    engine: str = "emulated",
    operator_key_file: Path | None = None,
) -> list[str]:
    """The command line of a worker (`engine`: a key of ENGINE_MODULES) on a free loopback
    port, taking `token_file` as its client token and `operator_key_file` as the operator's
    public key (default: the one beside `token_file`, `localkeys.Credentials.beside`)."""
    public = operator_key_file or Credentials.beside(token_file).operator_public
    return [
        sys.executable,
        "-m",
        ENGINE_MODULES[engine],
        "--role",
        role,
        "--port",
        "0",
        "--token-file",
        str(token_file),
        "--operator-key-file",
        str(public),
        *extra,
    ]


def parse_ready_line(line: str | bytes) -> WorkerReady:
    """The worker's ready line read; ValueError when `line` is not one (empty at EOF)."""
    try:
        info = json.loads(line)
        return WorkerReady(
            engine_id=str(info["engine_id"]),
            endpoint=str(info["endpoint"]),
            incarnation=str(info.get("incarnation", "")),
        )
    except (KeyError, TypeError) as exc:  # JSON, but not the ready line
        raise ValueError(f"not a worker's ready line: {line[:200]!r}") from exc


def start_worker(
    role: str,
    token_file: Path,
    log_path: Path,
    *extra: str,
    deadline_s: float = 60.0,
    engine: str = "emulated",
) -> StartedWorker:
    """Start a `kvtopo-worker` (stderr to `log_path`) and wait for its ready line.

    Waits on the worker's stdout itself (EOF when it exits), at most `deadline_s`; when no
    ready line comes, the worker is killed and :class:`LaunchError` says why, with its log.
    """
    return wait_ready(spawn_worker(role, token_file, log_path, *extra, engine=engine), deadline_s)


@dataclass(frozen=True)
class SpawnedWorker:
    """A worker process started, its ready line not read yet (`wait_ready`)."""

    role: str
    proc: subprocess.Popen[str]
    log_path: Path


def spawn_worker(
    role: str, token_file: Path, log_path: Path, *extra: str, engine: str = "emulated"
) -> SpawnedWorker:
    """Starts a `kvtopo-worker` (stderr to `log_path`) without waiting for it: several
    start side by side (a vLLM engine's imports take tens of seconds), then `wait_ready`."""
    with log_path.open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            worker_command(role, token_file, *extra, engine=engine),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    return SpawnedWorker(role, proc, log_path)


def wait_ready(spawned: SpawnedWorker, deadline_s: float = 60.0) -> StartedWorker:
    """Waits at most `deadline_s` for the spawned worker's ready line (see `start_worker`)."""
    role, proc, log_path = spawned.role, spawned.proc, spawned.log_path
    assert proc.stdout is not None
    line = ""
    readable, _, _ = select.select([proc.stdout], [], [], deadline_s)
    if readable:
        line = proc.stdout.readline()  # the worker prints the whole line at once
    try:
        ready = parse_ready_line(line)
    except ValueError:
        if not readable:
            problem = f"printed no ready line within {deadline_s:g}s"
        elif not line:
            try:
                problem = f"exited with code {proc.wait(KILL_GRACE_S)}"
            except subprocess.TimeoutExpired:
                problem = "closed its stdout"
        else:
            problem = f"printed {line[:200]!r} instead of its ready line"
        if proc.poll() is None:
            _kill(proc)
        proc.stdout.close()
        raise LaunchError(
            f"{role} worker did not start: {problem}; last lines of {log_path}:\n"
            f"{log_tail(log_path) or '(log is empty)'}"
        ) from None
    return StartedWorker(role, proc, ready.engine_id, ready.endpoint, log_path, ready.incarnation)


def operator_args(
    namespace: str, kubeconfig: Path, key_file: Path, resync_s: int, *extra: str
) -> list[str]:
    """The operator's arguments for one namespace (metrics on a free port), then `extra`;
    `key_file`: its private key (`localkeys.Credentials.operator_key`)."""
    return [
        "--namespace",
        namespace,
        "--kubeconfig",
        str(kubeconfig),
        "--worker-key-file",
        str(key_file),
        "--metrics-port",
        "0",
        "--resync-seconds",
        str(resync_s),
        *extra,
    ]


def leader_election_args(
    identity: str,
    *,
    lease_s: int = 15,
    renew_s: float = 10.0,
    retry_s: float = 2.0,
    lease_name: str = "kvtopo-operator",
) -> list[str]:
    """The operator's flags to run as replica `identity` of several, only the holder of the
    Lease `lease_name` (in the operator's first namespace) acting; `extra` of
    :func:`operator_args`. Needs renew_s < lease_s and retry_s < renew_s."""
    return [
        "--leader-elect",
        f"--leader-elect-identity={identity}",
        f"--leader-elect-lease-name={lease_name}",
        f"--leader-elect-lease-seconds={lease_s}",
        f"--leader-elect-renew-seconds={renew_s:g}",
        f"--leader-elect-retry-seconds={retry_s:g}",
    ]


def operator_command(args: Sequence[str], wrapper: Sequence[str] = ()) -> list[str]:
    """The operator's command line with `args`, run under `wrapper` (a profiler) if given."""
    return [*wrapper, sys.executable, "-m", OPERATOR_MODULE, *args]


def start_operator(
    args: Sequence[str],
    log_path: Path,
    *,
    wrapper: Sequence[str] = (),
    append: bool = False,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the operator with `args`, stdout and stderr in `log_path` (appended to when
    `append`, as for an operator restarted into the same log, else written afresh); `env`
    is its environment (default: this process's)."""
    with log_path.open("ab" if append else "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            operator_command(args, wrapper),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else dict(env),
        )


def stop_process(
    proc: subprocess.Popen[Any],
    grace_s: float = STOP_GRACE_S,
    *,
    sig: signal.Signals = signal.SIGTERM,
) -> int | None:
    """Stop a child for good: `sig`, up to `grace_s` for it to exit, then SIGKILL.

    Returns its exit status (at once when it had already exited), or None when it still
    runs :data:`KILL_GRACE_S` after SIGKILL; never raises, so a teardown goes on.
    """
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        return _kill(proc)


def _kill(proc: subprocess.Popen[Any]) -> int | None:
    proc.kill()
    try:
        return proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        return None


FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
)


def clock_ahead_env(seconds: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that starts a process with its wall clock `seconds` ahead (or behind,
    when negative) and its monotonic clock true: libfaketime preloaded (Debian's `faketime`
    package; its multithreaded library, as the operator runs threads). Preloaded into the
    process itself, so a signal sent to it reaches it (the `faketime` command would run it
    as its child). Raises LaunchError when the library is not installed."""
    import os

    lib = next((p for p in FAKETIME_LIBRARIES if Path(p).exists()), None)
    if lib is None:
        raise LaunchError(
            "libfaketime is not installed: apt-get install faketime (make node-deps does)"
        )
    env = dict(os.environ if base is None else base)
    env.update(
        LD_PRELOAD=lib,
        FAKETIME=f"{seconds:+d}s",
        FAKETIME_DONT_FAKE_MONOTONIC="1",
        FAKETIME_NO_CACHE="1",
    )
    return env
