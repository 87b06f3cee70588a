"""Command lines of the control-plane components, as pure functions of the cluster layout.

Owns the flags (see shared/docs/control-plane.md for why each is there): everything binds
and advertises 127.0.0.1 only, on ports picked free at start-up. Kept free of side effects so
the loopback-only rule can be checked without starting anything. Called by
:mod:`kvtopo.cluster.local_cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtopo.cluster.pki import ClusterPki

LOOPBACK = "127.0.0.1"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
# kwok's pod addresses: a loopback /16 (all of 127.0.0.0/8 is loopback on Linux), so each
# pod has an address of its own that a local process serving the pod can bind, and the
# operator reaches a worker at its pod IP exactly as in a real cluster. Each cluster takes
# its own /16 (127.N.0.0, N from its API server's port), so an engine left by another run on
# this machine (or one running beside it) never holds a fresh pod's address. 127.0/16 (the
# control plane) and 127.200/16 (tier-a tests' hand-made pod IPs) are never used. The range
# must not overlap the service range (kwok's default does).
FAKE_POD_SECOND_OCTETS = range(16, 200)
# kwok's fake node address: nothing listens there, never connect to it.
FAKE_NODE_IP = "192.0.2.1"  # TEST-NET-1 (RFC 5737): unroutable by design
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_MANAGED_NODES = "kwok.x-k8s.io/node=fake"
# kwok renews a Lease per fake node at this duration; the heartbeat-with-lease stage only
# refreshes node conditions every ~10 min, so without leases the node lifecycle controller
# would mark every node NotReady after its grace period and evict the pods.
NODE_LEASE_DURATION_S = 40
# Tier a's audit log: metadata (who, verb, resource, response code) of the requests that
# ServiceAccounts make, nothing of anyone else's, so that a test can see exactly which
# verbs an operator running as a ServiceAccount used. Tier a's only ServiceAccount users are
# tokens the tests mint, so the log stays small and the overhead negligible; tier b is left
# out (its controllers run as ServiceAccounts and would flood it). Watches are logged when
# they start (ResponseStarted), other requests when they complete.
AUDIT_LOGGED_GROUP = "system:serviceaccounts"
AUDIT_POLICY = f"""\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["{AUDIT_LOGGED_GROUP}"]
  - level: None
"""
AUDIT_LOG_MAX_SIZE_MB = 64
AUDIT_LOG_MAX_BACKUPS = 2


@dataclass(frozen=True)
class ControlPlanePorts:
    """The loopback ports of one cluster (0 where the tier runs no such component)."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int = 0
    scheduler: int = 0


@dataclass(frozen=True)
class ControlPlaneLayout:
    """Where one cluster's files live and which ports it uses."""

    directory: Path
    etcd_data: Path
    ports: ControlPlanePorts
    pki: ClusterPki

    @property
    def etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.etcd_client}"

    @property
    def server_url(self) -> str:
        return f"https://{LOOPBACK}:{self.ports.apiserver}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def controller_manager_kubeconfig(self) -> Path:
        return self.directory / "kube-controller-manager.kubeconfig"

    @property
    def scheduler_kubeconfig(self) -> Path:
        return self.directory / "kube-scheduler.kubeconfig"

    @property
    def pod_cidr(self) -> str:
        """kwok's pod range for this cluster (see :data:`FAKE_POD_SECOND_OCTETS`)."""
        octets = FAKE_POD_SECOND_OCTETS
        return f"127.{octets[self.ports.apiserver % len(octets)]}.0.0/16"

    @property
    def kwok_stages(self) -> Path:
        return self.directory / "kwok-stages.yaml"

    def log(self, component: str) -> Path:
        return self.directory / "logs" / f"{component}.log"

    @property
    def audit_policy(self) -> Path:
        return self.directory / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (tier a); rotated files lie next to it."""
        return self.log("kube-apiserver-audit")


def etcd_argv(binary: Path, layout: ControlPlaneLayout) -> list[str]:
    peer = f"http://{LOOPBACK}:{layout.ports.etcd_peer}"
    return [
        str(binary),
        "--name=kvtopo",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={layout.etcd_url}",
        f"--advertise-client-urls={layout.etcd_url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvtopo={peer}",
        "--initial-cluster-state=new",
        # Throw-away data on tmpfs: durability buys nothing and fsync costs start-up time.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(binary: Path, layout: ControlPlaneLayout, tier: str) -> list[str]:
    pki = layout.pki
    argv = [
        str(binary),
        f"--etcd-servers={layout.etcd_url}",
        f"--bind-address={LOOPBACK}",
        # Without an explicit address it looks for a default route and refuses to start
        # on machines without one.
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={layout.ports.apiserver}",
        f"--cert-dir={layout.directory / 'apiserver-certs'}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--authorization-mode=Node,RBAC",
        # Towards a real node's kubelet (tier c: `kubectl logs`), at its InternalIP.
        f"--kubelet-client-certificate={pki.kubelet_client_cert}",
        f"--kubelet-client-key={pki.kubelet_client_key}",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        # The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints
        # validation refuses (loopback); the reconciler would log that error forever.
        "--endpoint-reconciler-type=none",
    ]
    if tier == "a":
        # No controller manager, so no `default` ServiceAccounts for the plugin to find.
        argv.append("--disable-admission-plugins=ServiceAccount")
        # ServiceAccounts' requests, metadata only (AUDIT_POLICY, written by the caller).
        argv += [
            f"--audit-policy-file={layout.audit_policy}",
            f"--audit-log-path={layout.audit_log}",
            "--audit-log-format=json",
            f"--audit-log-maxsize={AUDIT_LOG_MAX_SIZE_MB}",
            f"--audit-log-maxbackup={AUDIT_LOG_MAX_BACKUPS}",
        ]
    return argv


def controller_manager_argv(
    binary: Path, layout: ControlPlaneLayout, node_grace_s: int | None = None
) -> list[str]:
    """`node_grace_s`: the node lifecycle controller's grace for a silent node (its
    `--node-monitor-grace-period`; the default, 50 s, when None)."""
    pki = layout.pki
    grace = [f"--node-monitor-grace-period={node_grace_s}s"] if node_grace_s else []
    return [
        str(binary),
        f"--kubeconfig={layout.controller_manager_kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={layout.ports.controller_manager}",
        f"--cert-dir={layout.directory / 'controller-manager-certs'}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        "--use-service-account-credentials=true",
        "--controllers=*",
        # One instance only: skipping the Lease election saves seconds at every start.
        "--leader-elect=false",
        # New nodes carry the not-ready taint until the node lifecycle controller's next
        # pass sees them Ready: every 1 s instead of 5 s shortens tier-b start-up by ~4 s.
        "--node-monitor-period=1s",
        # With per-controller credentials, start-up creates ~40 ServiceAccounts and tokens;
        # the default client rate limit (20 qps) stretches that to seconds.
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        *grace,
    ]


def scheduler_argv(binary: Path, layout: ControlPlaneLayout) -> list[str]:
    pki = layout.pki
    return [
        str(binary),
        f"--kubeconfig={layout.scheduler_kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={layout.ports.scheduler}",
        f"--cert-dir={layout.directory / 'scheduler-certs'}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        "--leader-elect=false",
    ]


def kwok_argv(
    binary: Path, layout: ControlPlaneLayout, node_lease_s: int = NODE_LEASE_DURATION_S
) -> list[str]:
    # No --server-address and no --node-port: kwok then serves nothing at all (its
    # logs/exec/metrics server would otherwise bind 0.0.0.0 by default).
    return [
        str(binary),
        f"--kubeconfig={layout.admin_kubeconfig}",
        f"--config={layout.kwok_stages}",
        f"--manage-nodes-with-annotation-selector={KWOK_MANAGED_NODES}",
        f"--cidr={layout.pod_cidr}",
        f"--node-ip={FAKE_NODE_IP}",
        f"--node-lease-duration-seconds={node_lease_s}",
    ]
