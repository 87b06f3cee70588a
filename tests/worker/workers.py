"""Real `kvtopo-worker` processes for integration tests, and a small control-API client."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen[str]
    engine_id: str
    endpoint: str
    token: str
    log_path: Path
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def call(
        self, method: str, path: str, body: object = None, timeout: float = 10
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_worker(
    role: str, token_file: Path, log_dir: Path, *extra: str, deadline_s: float = 60
) -> WorkerProcess:
    log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
    log = open(log_path, "w")  # noqa: SIM115 - owned by the child for its life
    cmd = [
        sys.executable,
        "-m",
        "kvtopo_worker.emulated",
        "--role",
        role,
        "--port",
        "0",
        "--token-file",
        str(token_file),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    end = time.monotonic() + deadline_s
    line = ""
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    if not line.startswith("{"):
        proc.kill()
        raise RuntimeError(f"{role} worker did not start: {log_path.read_text()[-2000:]}")
    info = json.loads(line)
    return WorkerProcess(
        role, proc, info["engine_id"], info["endpoint"], token_file.read_text().strip(), log_path
    )
