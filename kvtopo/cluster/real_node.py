"""One real Kubernetes node on this machine (tier c): containerd, a CNI bridge and a kubelet.

Owns the node's set-up and its complete teardown:

- **the machine claim**: one real node per machine. ``/run/kvtopo-node/owner.json`` names the
  cluster directory that holds it; a claim whose processes are all dead is a crashed run's,
  torn down before a new one starts. Before anything changes, a :class:`HostSnapshot` of the
  machine is saved next to it; teardown puts the machine back to that snapshot.
- **the pod network**: the bridge ``kvtopo0`` at :data:`NODE_IP` (the node's InternalIP) on
  :data:`POD_SUBNET`; containerd's CNI bridge and host-local plugins attach pods to it. Pods
  reach the API server (bound to 127.0.0.1) through a DNAT of the ``kubernetes`` Service
  address to it (``route_localnet`` on the bridge only); FORWARD drops every packet that
  would be routed between the bridge and any other link, so nothing leaves the machine.
- **containerd** (Debian's 1.6, runc): a private socket and state under the node's folder; its
  root (images, layers) in ``$KVTOPO_CACHE/node/containerd`` so images survive from one
  cluster to the next; ``restrict_oom_score_adj`` (this VM's bounding set lacks
  CAP_SYS_RESOURCE) and cgroupfs.
- **the kubelet** (built from Go modules): cgroup v1 allowed, cgroupfs, its API on the node IP
  (client certificates of the cluster's CA only), probes, pod logs and volumes under the
  node's folder; registers itself as :data:`NODE_NAME` with :data:`NODE_LABEL`, untainted, so
  pods without kwok's toleration land here.

Teardown (:func:`teardown_node`, from any process): the kubelet stopped, every container
killed and deleted through containerd (what is left killed through the ``kubepods``
cgroups), containerd's shims and containerd stopped, every new
mount under the node's folders unmounted, the cgroups, the bridge and the firewall rules
removed, the sysctls and the folders the kubelet and containerd made outside their roots put
back. :class:`~kvtopo.cluster.host_state.HostSnapshot` compares the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtopo.cluster.binaries import cache_root, find_binaries
from kvtopo.cluster.host_state import HostSnapshot, mount_points, write_sysctl
from kvtopo.cluster.pki import ClusterPki, write_client_kubeconfig
from kvtopo.cluster.processes import ProcessRecord, stop_processes

NODE_NAME = "kvtopo-node"
NODE_LABEL = ("kvtopo.dev/node", "real")
BRIDGE = "kvtopo0"
POD_SUBNET = "10.244.0.0/24"
NODE_IP = "10.244.0.1"
KUBERNETES_SERVICE_IP = "10.0.0.1"  # the first address of components.SERVICE_CLUSTER_IP_RANGE
CHAIN = "KVTOPO-NODE"
MACHINE_DIR = Path("/run/kvtopo-node")
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
HOST_TOOLS = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "ip": "iproute2",
    "buildah": "buildah",
    "debootstrap": "debootstrap",
}
NODE_BINARIES = ("kubelet", "pause")
KILL_TIMEOUT_S = 30.0

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class RealNodeError(RuntimeError):
    """The machine cannot run a real node (not root, a tool missing, another node on it)."""


def containerd_root() -> Path:
    """containerd's root (content, snapshots, metadata): cached across clusters."""
    return cache_root() / "node" / "containerd"


@dataclass(frozen=True)
class NodeLayout:
    """The real node's files, under ``<cluster directory>/node``."""

    directory: Path

    @property
    def containerd_config(self) -> Path:
        return self.directory / "containerd.toml"

    @property
    def containerd_state(self) -> Path:
        return self.directory / "containerd-state"

    @property
    def containerd_socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.directory / "cni"

    @property
    def ipam_dir(self) -> Path:
        return self.directory / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.directory / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.directory / "kubelet.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.directory / "kubelet.kubeconfig"

    @property
    def resolv_conf(self) -> Path:
        return self.directory / "resolv.conf"

    @property
    def pod_logs(self) -> Path:
        return self.directory / "pod-logs"


def preflight() -> list[str]:
    """What this machine lacks for a real node, one line each (empty: nothing)."""
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("a real node needs root (containerd, the kubelet, the pod network)")
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not all((CNI_BIN_DIR / plugin).is_file() for plugin in CNI_PLUGINS):
        missing.append("containernetworking-plugins")
    if missing:
        problems.append(f"missing Debian packages: apt-get install {' '.join(missing)}")
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").exists():
        problems.append(f"no cgroup hierarchy under {CGROUP_ROOT}")
    return problems


# -- the machine claim ----------------------------------------------------------------------


def _owner_file() -> Path:
    return MACHINE_DIR / "owner.json"


def _snapshot_file() -> Path:
    return MACHINE_DIR / "host-before.json"


def node_owner() -> dict[str, Any] | None:
    """The claim on this machine's real node: ``{"directory": ..., "processes": [...]}``."""
    try:
        data = json.loads(_owner_file().read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _owner_records(owner: dict[str, Any]) -> list[ProcessRecord]:
    return [ProcessRecord.from_json(p) for p in owner.get("processes", [])]


def claim_machine(directory: Path, progress: Progress = _quiet) -> HostSnapshot:
    """Claim the machine's one real node for the cluster in ``directory``: a crashed claim is
    torn down first, a live one refused. Returns the snapshot teardown restores."""
    owner = node_owner()
    if owner is not None:
        alive = [r for r in _owner_records(owner) if r.is_alive()]
        if alive and Path(owner.get("directory", "")) != directory:
            raise RealNodeError(
                f"a real node already runs on this machine for the cluster in "
                f"{owner.get('directory')} (pids {', '.join(str(r.pid) for r in alive)}); "
                f"stop it with `kvtopo cluster down --dir {owner.get('directory')}`"
            )
        progress(f"tearing down a real node left by {owner.get('directory')}")
        teardown_node(Path(owner.get("directory", directory)) / "node", progress)
    MACHINE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    snapshot = HostSnapshot.capture()
    snapshot.save(_snapshot_file())
    _write_owner({"directory": str(directory), "processes": []})
    return snapshot


def _write_owner(owner: dict[str, Any]) -> None:
    tmp = _owner_file().with_name(".owner.json.tmp")
    tmp.write_text(json.dumps(owner, indent=1) + "\n")
    tmp.replace(_owner_file())


def record_node_processes(records: list[ProcessRecord]) -> None:
    """Note the node's processes in the claim, so a later ``up`` can tell it is alive."""
    owner = node_owner() or {}
    owner["processes"] = [record.to_json() for record in records]
    _write_owner(owner)


# -- set-up -------------------------------------------------------------------------------


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if check and result.returncode != 0:
        raise RealNodeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def setup_network(apiserver_port: int) -> None:
    """The bridge, its address, and the firewall rules of the module docstring."""
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    write_sysctl(f"net.ipv4.conf.{BRIDGE}.route_localnet", "1")
    _sh("iptables", "-t", "nat", "-N", CHAIN)
    _sh(
        "iptables", "-t", "nat", "-A", CHAIN,
        "-d", f"{KUBERNETES_SERVICE_IP}/32", "-p", "tcp", "--dport", "443",
        "-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver_port}",
    )  # fmt: skip
    _sh("iptables", "-t", "nat", "-I", "PREROUTING", "-i", BRIDGE, "-j", CHAIN)
    _sh("iptables", "-N", CHAIN)
    _sh("iptables", "-A", CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP")
    _sh("iptables", "-A", CHAIN, "!", "-i", BRIDGE, "-o", BRIDGE, "-j", "DROP")
    _sh("iptables", "-I", "FORWARD", "-j", CHAIN)


def containerd_config(layout: NodeLayout, pause_image: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    disabled = [
        f"io.containerd.snapshotter.v1.{name}" for name in ("aufs", "btrfs", "devmapper", "zfs")
    ]
    return f"""\
version = 2
root = "{containerd_root()}"
state = "{layout.containerd_state}"
disabled_plugins = {json.dumps(disabled)}

[grpc]
  address = "{layout.containerd_socket}"
[ttrpc]
  address = "{layout.containerd_socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{layout.directory / "opt"}"
[{cri}]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{layout.cni_conf_dir}"
"""


def cni_config(layout: NodeLayout) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": "kvtopo",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(layout.ipam_dir),
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "loopback"},
        ],
    }


def kubelet_config(layout: NodeLayout, pki: ClusterPki, port: int, healthz_port: int) -> str:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        # Only clients with a certificate of the cluster's CA get past authentication.
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "resolvConf": str(layout.resolv_conf),
        "podLogsDir": str(layout.pod_logs),
        # No registry to pull from: the loaded images must never be collected.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "maxPods": 64,
        "registerNode": True,
        "nodeStatusReportFrequency": "10s",
    }
    return json.dumps(config, indent=1) + "\n"


def write_node_files(
    layout: NodeLayout,
    pki: ClusterPki,
    server_url: str,
    pause_image: str,
    kubelet_port: int,
    healthz_port: int,
) -> None:
    for folder in (layout.directory, layout.cni_conf_dir, layout.ipam_dir, layout.pod_logs):
        folder.mkdir(parents=True, exist_ok=True)
    containerd_root().mkdir(parents=True, exist_ok=True)
    layout.containerd_config.write_text(containerd_config(layout, pause_image))
    (layout.cni_conf_dir / "10-kvtopo.conflist").write_text(json.dumps(cni_config(layout)))
    layout.kubelet_config.write_text(kubelet_config(layout, pki, kubelet_port, healthz_port))
    # No cluster DNS: pods reach the API server by the Service address, peers by pod IP.
    layout.resolv_conf.write_text("# kvtopo real node: no DNS\n")
    write_client_kubeconfig(
        pki, layout.kubelet_kubeconfig, server_url, f"system:node:{NODE_NAME}", ("system:nodes",)
    )


def containerd_argv(layout: NodeLayout) -> list[str]:
    return [shutil.which("containerd") or "containerd", f"--config={layout.containerd_config}"]


def kubelet_argv(layout: NodeLayout) -> list[str]:
    kubelet = find_binaries(("kubelet",))["kubelet"]
    return [
        str(kubelet),
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={layout.kubelet_kubeconfig}",
        f"--root-dir={layout.kubelet_root}",
        f"--cert-dir={layout.kubelet_root / 'pki'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={NODE_IP}",
        f"--node-labels={NODE_LABEL[0]}={NODE_LABEL[1]}",
    ]


def containerd_ready(layout: NodeLayout) -> bool:
    if not layout.containerd_socket.exists():
        return False
    result = subprocess.run(
        ["ctr", f"--address={layout.containerd_socket}", "version"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return result.returncode == 0


def remove_containers(layout: NodeLayout) -> int:
    """Kill and delete every container of the kubelet's namespace in this node's containerd
    (the pods' sandboxes included), so none is left in its cached metadata for the next
    node to find. Returns how many there were; 0 when containerd does not answer."""
    base = ["ctr", f"--address={layout.containerd_socket}", "--namespace=k8s.io"]
    listed = _sh(*base, "containers", "list", "--quiet", check=False).stdout.split()
    for container in listed:
        _sh(*base, "tasks", "kill", "--signal=SIGKILL", container, check=False)
    for container in listed:
        _sh(*base, "tasks", "delete", "--force", container, check=False)
        _sh(*base, "containers", "delete", container, check=False)
    return len(listed)


# -- teardown -----------------------------------------------------------------------------


def _kubepods_dirs() -> list[Path]:
    """Every cgroup folder of pods, in every hierarchy, deepest first."""
    found: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return found
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / KUBEPODS
        if top.is_dir():
            found += [top, *(p for p in top.rglob("*") if p.is_dir())]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _pod_pids() -> set[int]:
    pids: set[int] = set()
    for folder in _kubepods_dirs():
        with contextlib.suppress(OSError):
            pids |= {int(x) for x in (folder / "cgroup.procs").read_text().split()}
    return pids


def kill_pod_processes(timeout_s: float = KILL_TIMEOUT_S) -> int:
    """SIGKILL every process in the pods' cgroups until none is left; returns how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while (pids := _pod_pids()) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)
    return len(killed)


def _processes_mentioning(needle: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def kill_shims(layout: NodeLayout) -> int:
    """SIGKILL the containerd shims that serve this node's containerd."""
    shims = [
        pid
        for pid in _processes_mentioning(str(layout.containerd_socket))
        if b"containerd-shim" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    for pid in shims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(shims)


def unmount_under(prefixes: list[Path], keep: set[str]) -> list[str]:
    """Unmount every mount point under ``prefixes`` that is not in ``keep``, deepest first
    (lazily when busy); returns the mount points."""
    roots = [str(p.resolve()) if p.exists() else str(p) for p in prefixes]
    targets = []
    for entry in mount_points():
        point = entry.rsplit(" ", 1)[0]
        if entry in keep:
            continue
        if any(point == root or point.startswith(root.rstrip("/") + "/") for root in roots):
            targets.append(point)
    for point in sorted(set(targets), key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return targets


def remove_pod_cgroups() -> int:
    removed = 0
    for folder in _kubepods_dirs():
        with contextlib.suppress(OSError):
            folder.rmdir()
            removed += 1
    return removed


def teardown_node(
    node_directory: Path,
    progress: Progress = _quiet,
    records: list[ProcessRecord] | None = None,
) -> list[str]:
    """Stop the real node whose files are in ``node_directory`` and put the machine back as
    the claim's snapshot found it (see the module docstring). Idempotent; returns what
    still differs from the snapshot (empty: nothing)."""
    layout = NodeLayout(node_directory)
    owner = node_owner() or {}
    known = records if records is not None else _owner_records(owner)
    by_name: dict[str, list[ProcessRecord]] = {}
    for record in known:
        by_name.setdefault(record.name, []).append(record)
    stop_processes([r for r in by_name.get("kubelet", []) if r.is_alive()])
    containers = remove_containers(layout) if containerd_ready(layout) else 0
    pods = kill_pod_processes()  # what containerd could not stop (or none was running)
    shims = kill_shims(layout)
    stop_processes([r for r in by_name.get("containerd", []) if r.is_alive()])
    for pid in _processes_mentioning(f"--config={layout.containerd_config}"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a containerd no record names (a crashed up)
    snapshot = HostSnapshot.load(_snapshot_file())
    keep = set(snapshot.mounts) if snapshot else set()
    prefixes = [
        node_directory,
        containerd_root(),
        Path("/run/containerd"),
        Path("/run/netns"),
        Path("/var/lib/kubelet"),
    ]
    unmounted = unmount_under(prefixes, keep)
    cgroups = remove_pod_cgroups()
    _sh("ip", "link", "delete", BRIDGE, check=False)
    leftovers: list[str] = []
    if snapshot is not None:
        snapshot.restore_firewall()
        snapshot.restore_sysctls()
        snapshot.remove_new_paths()
        leftovers = snapshot.diff(HostSnapshot.capture())
    progress(
        f"real node down: {containers} containers removed, {pods} pod processes and "
        f"{shims} shims killed, "
        f"{len(unmounted)} mounts and {cgroups} cgroups removed"
        + (f"; still differing: {leftovers}" if leftovers else "; host settings restored")
    )
    for path in (_owner_file(), _snapshot_file()):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        MACHINE_DIR.rmdir()
    return leftovers


def node_is_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = (node.get("spec") or {}).get("taints") or []
    return ready and not any(t.get("key", "").startswith("node.kubernetes.io/") for t in taints)


def node_binaries() -> dict[str, Path]:
    return find_binaries(NODE_BINARIES)
