"""Real `kvtopo-worker` processes for integration tests (started and stopped by
:mod:`kvtopo.launch`), and a small control-API client."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtopo import launch
from kvtopo.cluster import processes
from kvtopo.localkeys import ControlClient, Credentials


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen[str]
    engine_id: str
    endpoint: str
    token: str  # the client token (traffic routes)
    log_path: Path
    client: ControlClient  # signs admin calls with the operator's key, mints tickets
    incarnation: str = ""
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def call(
        self, method: str, path: str, body: object = None, timeout: float = 10
    ) -> tuple[int, Any]:
        """A call with the credential its route takes (as the operator on admin routes; a
        peer add gets a ticket minted for this engine)."""
        return self.client.call(
            method, self.endpoint, path, body, timeout, fetcher=(self.engine_id, self.incarnation)
        )

    def call_text(self, path: str, timeout: float = 10) -> str:
        """A GET answered in text (`/metrics`)."""
        req = urllib.request.Request(self.url + path)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return str(resp.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of Prometheus counter `name` (without its `_total`) whose
        labels include `labels`; 0 when there are none."""
        total = 0.0
        for line in self.call_text("/metrics").splitlines():
            if not line.startswith(name + "_total"):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def rejected(self, source: str) -> int:
        """Messages from `source` the worker dropped (`kvtopo_worker_rejected_messages`)."""
        return int(self.metric("kvtopo_worker_rejected_messages", source=source))

    def raw_metadata(self, rank: int = 0) -> bytes:
        """The worker's `GET /v1/metadata` envelope, as a peer the operator paired it with
        reads it (with a ticket)."""
        return self.client.metadata(self.endpoint, rank)

    def connect(self, peer: WorkerProcess) -> dict[str, Any]:
        status, body = self.call(
            "PUT", f"/v1/peers/{peer.engine_id}", {"endpoint": peer.endpoint, "role": peer.role}
        )
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def submit(self, request_id: str, peer: WorkerProcess, num_blocks: int) -> int:
        status, _ = self.call(
            "POST",
            "/v1/requests",
            {"request_id": request_id, "peer_engine_id": peer.engine_id, "num_blocks": num_blocks},
        )
        return status

    def drain(self) -> list[dict[str, Any]]:
        status, body = self.call("GET", "/v1/finished")
        assert status == 200, body
        self.outcomes.extend(body)
        return body  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        status, body = self.call("GET", "/v1/state")
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM (the worker drains: what it still holds fails with reason `shutdown`),
        collecting outcomes until it exits, as a real client would; SIGKILL after `grace_s`."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):  # the server is gone (exiting)
                status, body = self.call("GET", "/v1/finished", timeout=1)
                if status == 200:
                    self.outcomes.extend(body)
            try:
                self.proc.wait(0.1)
                return
            except subprocess.TimeoutExpired:
                continue
        launch.stop_process(self.proc, 0)

    def log_tail(self, n: int = 30) -> str:
        return processes.log_tail(self.log_path, n)


def forged_answers(prefill_engine_id: str) -> list[bytes]:
    """What a forger sends a decode in the name of prefill engine `prefill_engine_id`: a
    completion of request "r-done" and a failure of "r-fail" (framed, unsealed)."""
    from kvtopo_worker.protocol import FailureType, PushDone, PushFail, encode_notification

    return [
        encode_notification(
            PushDone(request_id="r-done", prefill_engine_id=prefill_engine_id, num_blocks=2)
        ),
        encode_notification(
            PushFail(
                request_id="r-fail",
                prefill_engine_id=prefill_engine_id,
                reason=FailureType.TRANSFER_FAILED,
                message="forged",
            )
        ),
    ]


def rogue_agent(
    targets: Iterable[WorkerProcess], name: str = "kvtopo-rogue", block: int = 64 * 1024
) -> tuple[Any, list[str]]:
    """A NIXL agent in the test process, named `name` (anything a process may choose),
    that has added each target's agent from its metadata, as any process holding the peer
    credential could; and the names of the agents it added."""
    import torch

    from kvtopo_worker.protocol import decode_metadata
    from kvtopo_worker.transport import NixlTransport

    rogue = NixlTransport(name, progress_thread=False)
    rogue.register_kv_cache(torch.zeros((4, block), dtype=torch.uint8))
    names = [
        rogue.add_remote_peer(decode_metadata(w.raw_metadata(), w.state()["compat_hash"]))
        for w in targets
    ]
    return rogue, names


def start_worker(
    role: str,
    token_file: Path,
    log_dir: Path,
    *extra: str,
    deadline_s: float = 60,
    engine: str = "emulated",
) -> WorkerProcess:
    """A serving worker of `role` (`engine`: emulated or vllm), its log `<role>-<ns>.log`
    in `log_dir`."""
    (w,) = start_workers([(role, extra)], token_file, log_dir, deadline_s=deadline_s, engine=engine)
    return w


def start_workers(
    workers: Sequence[tuple[str, Sequence[str]]],
    token_file: Path,
    log_dir: Path,
    *,
    deadline_s: float = 60,
    engine: str = "emulated",
) -> list[WorkerProcess]:
    """Serving workers, each (role, its arguments), started side by side (a vLLM engine
    takes tens of seconds to start): all spawned, then each waited for."""
    spawned = []
    for role, given in workers:
        log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        args = tuple(given)
        if "--drain-timeout" not in args:  # what a stopped test worker still holds fails soon
            args = (*args, "--drain-timeout", "2")
        spawned.append(launch.spawn_worker(role, token_file, log_path, *args, engine=engine))
    started: list[WorkerProcess] = []
    try:
        for one in spawned:
            w = launch.wait_ready(one, deadline_s)
            creds = Credentials.beside(token_file)
            started.append(
                WorkerProcess(
                    w.role,
                    w.proc,
                    w.engine_id,
                    w.endpoint,
                    creds.token(),
                    w.log_path,
                    ControlClient.of(creds),
                    w.incarnation,
                )
            )
    except BaseException:
        for one in spawned:  # the others of a start that failed
            if one.proc.poll() is None:
                one.proc.kill()
                one.proc.wait()
        raise
    return started


def stop_operator_and_workers(
    operator: subprocess.Popen[bytes] | None, grace_s: float, workers: Iterable[WorkerProcess]
) -> None:
    """An end-to-end test's teardown: its operator (when it started one), then its workers."""
    if operator is not None:
        launch.stop_process(operator, grace_s)
    for w in workers:
        w.stop()
