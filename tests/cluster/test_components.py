"""The components' command lines: loopback only, and the tier-specific flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvtopo.cluster import components
from kvtopo.cluster.components import ControlPlaneLayout, ControlPlanePorts
from kvtopo.cluster.pki import ClusterPki

LAYOUT = ControlPlaneLayout(
    directory=Path("/c"),
    etcd_data=Path("/dev/shm/e"),
    ports=ControlPlanePorts(2379, 2380, 6443, 10257, 10259),
    pki=ClusterPki(Path("/c/pki")),
)
BIN = Path("/bin/x")
ANY_ADDRESS = re.compile(r"(?<![\d.])(0\.0\.0\.0|\[::\])")  # not 10.0.0.0/24


def _all_argvs(tier: str) -> dict[str, list[str]]:
    return {
        "etcd": components.etcd_argv(BIN, LAYOUT),
        "kube-apiserver": components.apiserver_argv(BIN, LAYOUT, tier),
        "kube-controller-manager": components.controller_manager_argv(BIN, LAYOUT),
        "kube-scheduler": components.scheduler_argv(BIN, LAYOUT),
        "kwok": components.kwok_argv(BIN, LAYOUT),
    }


def _flag(argv: list[str], name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"--{name}=")]
    return values[-1] if values else None


@pytest.mark.parametrize("component", sorted(_all_argvs("b")))
def test_everything_binds_loopback_only(component: str) -> None:
    argv = _all_argvs("b")[component]
    assert not any(ANY_ADDRESS.search(arg) for arg in argv)
    for flag in ("bind-address", "advertise-address"):
        value = _flag(argv, flag)
        assert value in (None, "127.0.0.1"), (flag, value)
    for flag in ("listen-client-urls", "listen-peer-urls", "advertise-client-urls"):
        value = _flag(argv, flag)
        assert value is None or value.startswith("http://127.0.0.1:"), (flag, value)
    # kwok would serve on 0.0.0.0 with either of these; it must serve nothing.
    assert _flag(argv, "server-address") is None
    assert _flag(argv, "node-port") is None


def test_components_that_serve_get_explicit_loopback_ports() -> None:
    argvs = _all_argvs("b")
    assert _flag(argvs["kube-apiserver"], "bind-address") == "127.0.0.1"
    assert _flag(argvs["kube-apiserver"], "secure-port") == "6443"
    assert _flag(argvs["kube-controller-manager"], "bind-address") == "127.0.0.1"
    assert _flag(argvs["kube-controller-manager"], "secure-port") == "10257"
    assert _flag(argvs["kube-scheduler"], "secure-port") == "10259"
    assert _flag(argvs["etcd"], "listen-client-urls") == "http://127.0.0.1:2379"


def test_tier_a_disables_service_account_admission_only() -> None:
    tier_a = components.apiserver_argv(BIN, LAYOUT, "a")
    tier_b = components.apiserver_argv(BIN, LAYOUT, "b")
    assert _flag(tier_a, "disable-admission-plugins") == "ServiceAccount"
    assert _flag(tier_b, "disable-admission-plugins") is None


def test_tier_a_audits_service_accounts_metadata_only() -> None:
    tier_a = components.apiserver_argv(BIN, LAYOUT, "a")
    assert _flag(tier_a, "audit-policy-file") == "/c/audit-policy.yaml"
    assert _flag(tier_a, "audit-log-path") == "/c/logs/kube-apiserver-audit.log"
    assert _flag(tier_a, "audit-log-format") == "json"
    max_size = _flag(tier_a, "audit-log-maxsize")
    assert max_size is not None and 0 < int(max_size) <= 100
    policy = yaml.safe_load(components.AUDIT_POLICY)
    assert policy["apiVersion"] == "audit.k8s.io/v1" and policy["kind"] == "Policy"
    assert policy["omitStages"] == ["RequestReceived"]
    # ServiceAccounts' requests at Metadata (never bodies), nobody else's.
    assert policy["rules"] == [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ]
    # Tier b's controllers run as ServiceAccounts: no audit log there.
    tier_b = components.apiserver_argv(BIN, LAYOUT, "b")
    assert not any(arg.startswith("--audit-") for arg in tier_b)


def test_etcd_data_on_the_given_tmpfs_folder_without_fsync() -> None:
    argv = components.etcd_argv(BIN, LAYOUT)
    assert _flag(argv, "data-dir") == "/dev/shm/e"
    assert "--unsafe-no-fsync" in argv


def test_kwok_manages_only_annotated_nodes_with_stages() -> None:
    argv = components.kwok_argv(BIN, LAYOUT)
    assert _flag(argv, "manage-nodes-with-annotation-selector") == "kwok.x-k8s.io/node=fake"
    assert _flag(argv, "config") == str(LAYOUT.kwok_stages)
    pod_cidr = _flag(argv, "cidr")
    assert pod_cidr is not None
    assert not pod_cidr.startswith("10.0.0."), "must not overlap the service range"


def test_each_cluster_gets_its_own_loopback_pod_range() -> None:
    """Pod IPs are loopback, outside 127.0/16 (the control plane) and 127.200/16 (tier a's
    hand-made pod IPs), and clusters on other ports get other ranges, so an engine left by
    one run cannot hold the address of another run's pod."""
    cidrs = set()
    for port in range(30000, 30000 + len(components.FAKE_POD_SECOND_OCTETS)):
        layout = ControlPlaneLayout(
            directory=Path("/c"),
            etcd_data=Path("/dev/shm/e"),
            ports=ControlPlanePorts(2379, 2380, port),
            pki=ClusterPki(Path("/c/pki")),
        )
        cidr = _flag(components.kwok_argv(BIN, layout), "cidr")
        assert cidr is not None and cidr.startswith("127.") and cidr.endswith(".0.0/16")
        assert cidr.split(".")[1] not in {"0", "200"}
        cidrs.add(cidr)
    assert len(cidrs) == len(components.FAKE_POD_SECOND_OCTETS)
