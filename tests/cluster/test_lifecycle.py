"""Start-up failures, Ctrl-C, `down` and the detached CLI leave no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtopo.cluster.binaries import find_binary
from kvtopo.cluster.local_cluster import STATE_FILE, LocalCluster, stop_cluster
from kvtopo.cluster.processes import ControlPlaneProcessError, ProcessRecord

pytestmark = pytest.mark.cluster

CLI_TIMEOUT_S = 240


def _live_processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes (zombies excluded) naming any of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] in "ZX":
            continue
        if any(needle in cmdline for needle in needles):
            found.append(cmdline)
    return found


def _records(directory: Path) -> tuple[list[ProcessRecord], str]:
    state = json.loads((directory / STATE_FILE).read_text())
    return [ProcessRecord.from_json(p) for p in state["processes"]], state["etcd_data"]


def test_down_stops_every_process_and_cleans_tmpfs(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "c", "a").up()
    records, etcd_data = _records(cluster.directory)
    try:
        assert {r.name for r in records} == {"etcd", "kube-apiserver"}
        assert all(r.is_alive() for r in records)
        assert Path(etcd_data).is_dir()
    finally:
        cluster.down()
    assert not [r.name for r in records if r.is_alive()]
    assert not _live_processes_mentioning(str(cluster.directory), etcd_data)
    assert not Path(etcd_data).exists()
    assert not (cluster.directory / STATE_FILE).exists()


def test_ctrl_c_during_up_stops_what_was_started(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    seen: list[ProcessRecord] = []

    def interrupt_once_the_apiserver_is_ready(line: str) -> None:
        if line.startswith("kube-apiserver ready"):
            seen.extend(_records(directory)[0])
            raise KeyboardInterrupt

    cluster = LocalCluster(directory, "a", progress=interrupt_once_the_apiserver_is_ready)
    with pytest.raises(KeyboardInterrupt):
        cluster.up()
    assert {r.name for r in seen} == {"etcd", "kube-apiserver"}
    assert not [r.name for r in seen if r.is_alive()]
    assert not _live_processes_mentioning(str(directory.resolve()))
    assert not (directory / STATE_FILE).exists()


def test_component_exiting_early_is_named_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kube-apiserver that dies at once, beside the real etcd and kubectl.
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("etcd", "kubectl"):
        (assets / name).symlink_to(find_binary(name))
    fake = assets / "kube-apiserver"
    fake.write_text("#!/bin/sh\necho 'Error: unknown flag: --kvtopo-broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))

    cluster = LocalCluster(tmp_path / "c", "a")
    with pytest.raises(ControlPlaneProcessError) as raised:
        cluster.up()
    assert raised.value.name == "kube-apiserver"
    assert "exited early with code 1" in str(raised.value)
    assert "unknown flag: --kvtopo-broken" in str(raised.value)
    etcd_data = str(cluster.layout.etcd_data)
    assert not _live_processes_mentioning(str(cluster.directory), etcd_data)
    assert not Path(etcd_data).exists()
    assert not (cluster.directory / STATE_FILE).exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtopo.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_cli_up_leaves_tier_b_running_detached_until_down(tmp_path: Path) -> None:
    directory = tmp_path / "detached"
    try:
        up = _cli("up", "--tier", "b", "--dir", str(directory))
        assert up.returncode == 0, up.stdout + up.stderr
        kubeconfig = directory / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        assert "ready" in up.stdout

        # The CLI has exited; its cluster runs on, recorded in the state file.
        records, etcd_data = _records(directory)
        assert {r.name for r in records} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        }
        assert all(r.is_alive() for r in records)
        env = _cli("env", "--dir", str(directory))
        assert env.returncode == 0
        assert env.stdout.strip() == f"export KUBECONFIG={kubeconfig}"
        nodes = subprocess.run(
            [
                str(find_binary("kubectl")),
                f"--kubeconfig={kubeconfig}",
                "get",
                "nodes",
                "-l",
                "type=kwok",
                "-o",
                "jsonpath={.items[*].metadata.name}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert len(nodes.stdout.split()) == 3

        again = _cli("up", "--tier", "b", "--dir", str(directory))
        assert again.returncode == 0
        assert "already running" in again.stdout
        other_tier = _cli("up", "--tier", "a", "--dir", str(directory))
        assert other_tier.returncode == 1
        assert "down" in other_tier.stderr

        down = _cli("down", "--dir", str(directory))
        assert down.returncode == 0, down.stderr
        assert not [r.name for r in records if r.is_alive()]
        assert not _live_processes_mentioning(str(directory), etcd_data)
        assert not Path(etcd_data).exists()
        assert not (directory / STATE_FILE).exists()
        after = _cli("env", "--dir", str(directory))
        assert after.returncode == 1
        assert "no running cluster" in after.stderr
    finally:
        stop_cluster(directory)
