"""A real Kubernetes control plane on loopback, started and stopped as one object.

Owns the life cycle of one local cluster in one directory:

- tier ``a``: etcd + kube-apiserver (integration tests create Pods and patch their status
  themselves), with an audit log of the requests ServiceAccounts make
  (:meth:`LocalCluster.audit_events`); ready when ``/readyz`` answers 200.
- tier ``b``: + kube-controller-manager, kube-scheduler and kwok with a few fake Nodes, so
  Deployments really roll out; ready when those components report healthy, every fake Node
  is Ready and schedulable, and the ``default`` ServiceAccount exists in ``default``.
- tier ``c``: tier b + one real node (:mod:`kvtopo.cluster.real_node`: containerd, a CNI
  bridge, a kubelet) running the images :mod:`kvtopo.cluster.images` builds from docker/;
  ready when that Node is Ready and untainted. Needs root; one per machine; ``down`` puts
  the machine's network, mounts and kernel settings back as they were.

The directory holds the certificates, kubeconfigs, one log per component and
``state.json`` (pids, ports, kubeconfig path), so :func:`stop_cluster` from another process
(``kvtopo cluster down``) stops what ``kvtopo cluster up`` left running. etcd keeps its data
on tmpfs (``/dev/shm``). Whatever goes wrong during :meth:`LocalCluster.up` (a component
exiting, a deadline, Ctrl-C) stops everything already started before the error propagates.

Used by :mod:`kvtopo.cluster.cli` and :mod:`kvtopo.cluster.pytest_fixtures`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast
from urllib.parse import quote

from kvtopo import ports
from kvtopo.cluster import components, real_node
from kvtopo.cluster.admin_api import AdminApi
from kvtopo.cluster.binaries import ControlPlaneBinaries, cache_root
from kvtopo.cluster.components import ControlPlaneLayout, ControlPlanePorts
from kvtopo.cluster.deadlines import wait_until
from kvtopo.cluster.fake_nodes import (
    DEFAULT_FAKE_NODES,
    FAKE_NODE_LABEL,
    FAKE_NODE_PLACEMENT,
    fake_node_manifest,
    fake_node_name,
    kwok_stages_yaml,
    node_is_schedulable,
)
from kvtopo.cluster.host_state import HostSnapshot
from kvtopo.cluster.images import ImageBuilder, ImageSet, load_images
from kvtopo.cluster.pki import (
    ClusterPki,
    issue_cluster_pki,
    write_admin_kubeconfig,
    write_client_kubeconfig,
)
from kvtopo.cluster.processes import (
    ComponentProcess,
    ControlPlaneProcessError,
    ProcessRecord,
    log_tail,
    stop_processes,
)

Tier = Literal["a", "b", "c"]
TIERS: tuple[Tier, ...] = ("a", "b", "c")

STATE_FILE = "state.json"
TMPFS = Path("/dev/shm")  # noqa: S108 - etcd data goes into a private mkdtemp() folder
ETCD_DATA_PREFIX = "kvtopo-etcd-"
ORPHAN_MIN_AGE_S = 300.0
# Deadlines for readiness: far above the warm start times (seconds) so a loaded 2-core
# machine does not fail spuriously, far below pytest's per-test timeout.
# Tier c's clock starts once its images are built (that takes minutes the first time only).
READY_TIMEOUT_S: dict[Tier, float] = {"a": 90.0, "b": 150.0, "c": 240.0}
# The real node's kubelet, from its launch to its Node Ready and untainted. Loading the images
# into containerd comes before it and is not counted against READY_TIMEOUT_S: on a cold machine
# the first load copies gigabytes (the locked dependencies' layer) and took 3.5 minutes in CI,
# leaving the kubelet no time at all ("timed out after 0 s").
KUBELET_READY_TIMEOUT_S = 120.0
KUBECTL_TIMEOUT_S = 60.0
PORT_CLASH = "address already in use"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class ClusterAlreadyRunningError(RuntimeError):
    """``up`` found live processes of an earlier cluster in the same directory."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; unlike its base class, the message includes kubectl's stderr."""

    def __str__(self) -> str:
        stderr = (self.stderr or "").strip()
        return f"{super().__str__()}\n{stderr}" if stderr else super().__str__()


def default_cluster_dir() -> Path:
    """Where ``kvtopo cluster up`` keeps its cluster: ``$KVTOPO_CACHE/cluster``."""
    return cache_root() / "cluster"


@dataclass(frozen=True)
class ClusterState:
    """What ``state.json`` records about a (possibly detached) cluster."""

    tier: Tier
    directory: str
    kubeconfig: str
    server_url: str
    etcd_data: str
    ports: dict[str, int]
    processes: list[ProcessRecord] = field(default_factory=list)
    ready_s: float | None = None
    images: dict[str, str] = field(default_factory=dict)  # tier c: name -> reference

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "directory": self.directory,
            "kubeconfig": self.kubeconfig,
            "server_url": self.server_url,
            "etcd_data": self.etcd_data,
            "ports": self.ports,
            "processes": [record.to_json() for record in self.processes],
            "ready_s": self.ready_s,
            "images": self.images,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        tier = data["tier"]
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r} in state file")
        return cls(
            tier=cast(Tier, tier),
            directory=str(data["directory"]),
            kubeconfig=str(data["kubeconfig"]),
            server_url=str(data["server_url"]),
            etcd_data=str(data["etcd_data"]),
            ports={str(k): int(v) for k, v in data["ports"].items()},
            processes=[ProcessRecord.from_json(p) for p in data["processes"]],
            ready_s=None if data.get("ready_s") is None else float(data["ready_s"]),
            images={str(k): str(v) for k, v in (data.get("images") or {}).items()},
        )

    def save(self, directory: Path) -> None:
        tmp = directory / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(directory / STATE_FILE)

    @classmethod
    def load(cls, directory: Path) -> ClusterState | None:
        try:
            return cls.from_json(json.loads((directory / STATE_FILE).read_text()))
        except FileNotFoundError:
            return None

    def alive(self) -> list[ProcessRecord]:
        return [record for record in self.processes if record.is_alive()]


def running_cluster(directory: Path) -> ClusterState | None:
    """The state of a cluster in ``directory`` that is up (all its processes alive)."""
    state = ClusterState.load(directory)
    if state is None or state.ready_s is None or not state.processes:
        return None
    return state if len(state.alive()) == len(state.processes) else None


def _remove_etcd_data(path: str) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


# Stopped in this order, one wave at a time: the API server's shutdown still writes to
# etcd (its own Lease), and stopping both together makes it wait out etcd timeouts.
STOP_WAVES = (("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))
# A real node's processes, stopped by real_node.teardown_node (before the control plane).
NODE_COMPONENTS = ("kubelet", "containerd")


def stop_components(records: list[ProcessRecord]) -> list[str]:
    """Stop ``records`` wave by wave (:data:`STOP_WAVES`); returns the names killed."""
    killed: list[str] = []
    known = {name for wave in STOP_WAVES for name in wave}
    waves = [[r for r in records if r.name not in known]]
    waves += [[r for r in records if r.name in wave] for wave in STOP_WAVES]
    for wave_records in waves:
        if wave_records:
            killed += stop_processes(wave_records)
    return killed


def stop_cluster(directory: Path, progress: Progress = _quiet) -> bool:
    """Stop the cluster recorded in ``directory`` (from any process); False if none was."""
    state = ClusterState.load(directory)
    if state is None:
        return False
    alive = state.alive()
    if alive:
        progress("stopping " + ", ".join(f"{r.name} (pid {r.pid})" for r in alive))
    if state.tier == "c":
        node = [r for r in state.processes if r.name in NODE_COMPONENTS]
        real_node.teardown_node(Path(state.directory) / "node", progress, node)
        alive = [r for r in alive if r.name not in NODE_COMPONENTS]
    killed = stop_components(alive)
    for name in killed:
        progress(f"{name} ignored SIGTERM and was killed")
    _remove_etcd_data(state.etcd_data)
    (directory / STATE_FILE).unlink(missing_ok=True)
    return True


def _free_loopback_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now, all different, for the components that bind them next:
    chosen below the ephemeral range (`kvtopo.ports`), so nothing connecting out or binding
    port 0 meanwhile takes one first."""
    return [ports.free_port(components.LOOPBACK) for _ in range(count)]


def _in_use_by_live_process(path: Path) -> bool:
    needle = str(path).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    return True
    return False


def sweep_orphaned_etcd_data(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[Path]:
    """Delete tmpfs etcd folders no live process uses: left by runs killed outright (their
    components die with them, but nobody is left to clean up). Folders younger than
    ``min_age_s`` are spared: another cluster may be about to start its etcd there."""
    removed: list[Path] = []
    for path in TMPFS.glob(f"{ETCD_DATA_PREFIX}*"):
        with contextlib.suppress(OSError):
            young = time.time() - path.stat().st_mtime < min_age_s
            if young or _in_use_by_live_process(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _etcd_data_dir(directory: Path) -> Path:
    if TMPFS.is_dir() and os.access(TMPFS, os.W_OK):
        sweep_orphaned_etcd_data()
        return Path(tempfile.mkdtemp(prefix=ETCD_DATA_PREFIX, dir=TMPFS))
    fallback = directory / "etcd-data"
    shutil.rmtree(fallback, ignore_errors=True)
    return fallback


class LocalCluster:
    """One local control plane in ``directory``: ``up(tier)``, ``down()``, or ``with``.

    ``die_with_parent`` ties the components to this Python process (the kernel kills them
    when it dies, even by SIGKILL): right for tests; ``kvtopo cluster up`` turns it off to leave the
    cluster running detached.
    """

    def __init__(
        self,
        directory: Path,
        tier: Tier = "a",
        *,
        fake_nodes: int = DEFAULT_FAKE_NODES,
        die_with_parent: bool = True,
        progress: Progress = _quiet,
        node_grace_s: int | None = None,
    ) -> None:
        """`node_grace_s` (tiers b and c): how long the node lifecycle controller waits for
        a silent fake node before it flips its Ready (kwok's node Leases last as long, and
        are renewed a quarter of it apart); None: Kubernetes' default grace (50 s) and 40 s
        Leases."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r} (known: a, b, c)")
        self.directory = Path(directory).resolve()
        self.tier: Tier = tier
        self.fake_nodes = fake_nodes
        self.node_grace_s = node_grace_s
        self.die_with_parent = die_with_parent
        self.progress = progress
        self.ready_s: float | None = None
        self._layout: ControlPlaneLayout | None = None
        self._binaries: ControlPlaneBinaries | None = None
        self._processes: list[ComponentProcess] = []
        self._logs: dict[str, Path] = {}  # kept after down(), for failure reports
        self._owns_directory = False
        self.images: ImageSet | None = None  # tier c
        self.host_before: HostSnapshot | None = None  # tier c: the machine before the node
        self._builder: ImageBuilder | None = None
        self._node_claimed = False

    # -- what callers use -------------------------------------------------------------

    @property
    def layout(self) -> ControlPlaneLayout:
        if self._layout is None:
            raise RuntimeError("the cluster is not up")
        return self._layout

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (``O=system:masters``)."""
        return self.layout.admin_kubeconfig

    @property
    def server_url(self) -> str:
        """``https://127.0.0.1:<port>`` of the kube-apiserver."""
        return self.layout.server_url

    @property
    def pki(self) -> ClusterPki:
        return self.layout.pki

    @property
    def logs(self) -> dict[str, Path]:
        return dict(self._logs)

    @property
    def fake_node_names(self) -> list[str]:
        count = self.fake_nodes if self.tier in ("b", "c") else 0
        return [fake_node_name(i) for i in range(count)]

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = KUBECTL_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's kubectl against this cluster as the admin."""
        if self._binaries is None:
            raise RuntimeError("the cluster is not up")
        argv = [
            str(self._binaries.kubectl),
            f"--kubeconfig={self.kubeconfig}",
            # Per-cluster discovery cache: ports are reused across clusters.
            f"--cache-dir={self.directory / 'kubectl-cache'}",
            *args,
        ]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def write_client_kubeconfig(self, path: Path, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for ``user`` in ``groups`` (a client certificate from this CA)."""
        return write_client_kubeconfig(self.pki, path, self.server_url, user, groups)

    def audit_events(self, user: str | None = None) -> list[dict[str, Any]]:
        """The API server's audit events so far, oldest first (tier a only: requests of
        ServiceAccounts, metadata level, see :data:`components.AUDIT_POLICY`), optionally
        only those of ``user`` (e.g. ``system:serviceaccount:NS:NAME``). Rotated files are
        read too; a last line still being written is skipped."""
        if self.tier != "a":
            raise RuntimeError("only tier a keeps an audit log")
        current = self.layout.audit_log
        rotated = sorted(current.parent.glob(f"{current.stem}-*{current.suffix}"))
        events: list[dict[str, Any]] = []
        for path in [*rotated, current]:
            with contextlib.suppress(FileNotFoundError):
                for line in path.read_text(errors="replace").splitlines():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if user is None or event.get("user", {}).get("username") == user:
                        events.append(event)
        return events

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of every component's log, for failure reports."""
        parts = []
        for name, log in self.logs.items():
            parts.append(f"----- {name} ({log}) -----\n{log_tail(log, lines) or '(empty)'}")
        return "\n".join(parts)

    def state(self) -> ClusterState:
        layout = self.layout
        ports = {k: v for k, v in vars(layout.ports).items() if v}
        return ClusterState(
            tier=self.tier,
            directory=str(self.directory),
            kubeconfig=str(layout.admin_kubeconfig),
            server_url=layout.server_url,
            etcd_data=str(layout.etcd_data),
            ports=ports,
            processes=[p.record for p in self._processes if p.started],
            ready_s=self.ready_s,
            images=self.images.to_json() if self.images else {},
        )

    def __enter__(self) -> LocalCluster:
        if self.ready_s is None:
            self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.down()

    # -- life cycle -------------------------------------------------------------------

    def up(self, tier: Tier | None = None, timeout_s: float | None = None) -> LocalCluster:
        """Start the control plane and return once it is ready (see the module docstring).

        Raises :class:`~kvtopo.cluster.binaries.BinariesMissingError`,
        :class:`ControlPlaneProcessError` (a component exited: its log tail included),
        :class:`~kvtopo.cluster.deadlines.DeadlineExceededError` or
        :class:`ClusterAlreadyRunningError`; in every case nothing is left running.
        """
        if tier is not None:
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r} (known: a, b, c)")
            self.tier = tier
        if self._processes:
            raise RuntimeError("this LocalCluster is already up; call down() first")
        self._binaries = ControlPlaneBinaries.for_tier(self.tier)
        if self.tier == "c":
            problems = real_node.preflight()
            if problems:
                raise real_node.RealNodeError("; ".join(problems))
            real_node.node_binaries()  # BinariesMissingError now, not half-way
            self._builder = ImageBuilder(progress=self.progress)
            self.images = self._builder.build_all()
        self.directory.mkdir(parents=True, exist_ok=True)
        earlier = ClusterState.load(self.directory)
        if earlier is not None and earlier.alive():
            raise ClusterAlreadyRunningError(
                f"a tier-{earlier.tier} cluster already runs in {self.directory}; stop it "
                f"with `kvtopo cluster down --dir {self.directory}`"
            )
        stop_cluster(self.directory)  # stale state of a crashed run: clean up its tmpfs
        deadline_s = timeout_s if timeout_s is not None else READY_TIMEOUT_S[self.tier]
        try:
            try:
                self._start(deadline_s)
            except ControlPlaneProcessError as error:
                if PORT_CLASH not in str(error):
                    raise
                # Another program took one of the picked ports in between: once more.
                self.progress(f"{error.name}: port taken meanwhile, retrying with new ports")
                self.down()
                self._start(deadline_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every component (process groups: SIGTERM, then SIGKILL), wait for them,
        and delete etcd's tmpfs data. Idempotent."""
        started = [process for process in self._processes if process.started]
        try:
            if self._node_claimed:
                node = [p.record for p in started if p.name in NODE_COMPONENTS]
                real_node.teardown_node(self.node_layout.directory, self.progress, node)
                self._node_claimed = False
            stop_components([p.record for p in started if p.name not in NODE_COMPONENTS])
        finally:
            for process in started:
                process.reap()
            self._processes = []
            if self._layout is not None and self._owns_directory:
                _remove_etcd_data(str(self._layout.etcd_data))
                (self.directory / STATE_FILE).unlink(missing_ok=True)
            self._owns_directory = False
            self.ready_s = None

    # -- start-up ---------------------------------------------------------------------

    def _start(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        binaries = self._binaries
        assert binaries is not None
        ports = _free_loopback_ports({"a": 3, "b": 5, "c": 7}[self.tier])
        layout = ControlPlaneLayout(
            directory=self.directory,
            etcd_data=_etcd_data_dir(self.directory),
            ports=ControlPlanePorts(*ports[:5]),
            pki=ClusterPki(self.directory / "pki"),
        )
        self._layout = layout
        self._owns_directory = True  # until down(): the state file and tmpfs data are ours
        shutil.rmtree(self.directory / "logs", ignore_errors=True)
        shutil.rmtree(self.directory / "kubectl-cache", ignore_errors=True)
        issue_cluster_pki(layout.pki.directory)
        write_admin_kubeconfig(layout.pki, layout.admin_kubeconfig, layout.server_url)
        api = AdminApi(layout.pki, components.LOOPBACK, layout.ports.apiserver)
        self._logs = {}
        if self.tier == "a":
            layout.audit_policy.write_text(components.AUDIT_POLICY)

        self.progress(f"starting etcd and kube-apiserver (tier {self.tier}) in {self.directory}")
        self._launch("etcd", components.etcd_argv(binaries.etcd, layout))
        self._launch(
            "kube-apiserver",
            components.apiserver_argv(binaries.kube_apiserver, layout, self.tier),
        )
        self._wait("kube-apiserver /readyz", deadline, lambda: api.is_healthy("/readyz"))
        elapsed = time.monotonic() - t0
        self.progress(f"kube-apiserver ready at {layout.server_url} ({elapsed:.1f} s)")

        if self.tier in ("b", "c"):
            self._start_tier_b(binaries, layout, api, deadline)
            self.progress(
                f"{self.fake_nodes} fake nodes Ready, default ServiceAccount present "
                f"({time.monotonic() - t0:.1f} s)"
            )
        if self.tier == "c":
            self._start_real_node(layout, api, deadline, ports[5], ports[6])
            self.progress(f"real node {real_node.NODE_NAME} Ready ({time.monotonic() - t0:.1f} s)")
        self.ready_s = round(time.monotonic() - t0, 2)
        self.state().save(self.directory)

    def _start_tier_b(
        self,
        binaries: ControlPlaneBinaries,
        layout: ControlPlaneLayout,
        api: AdminApi,
        deadline: float,
    ) -> None:
        assert binaries.kube_controller_manager and binaries.kube_scheduler and binaries.kwok
        server = layout.server_url
        # The components' own identities, which the bootstrap RBAC policy grants their rights.
        write_client_kubeconfig(
            layout.pki,
            layout.controller_manager_kubeconfig,
            server,
            "system:kube-controller-manager",
        )
        write_client_kubeconfig(
            layout.pki, layout.scheduler_kubeconfig, server, "system:kube-scheduler"
        )
        layout.kwok_stages.write_text(kwok_stages_yaml())
        self.progress("starting kube-controller-manager, kube-scheduler and kwok")
        self._launch(
            "kube-controller-manager",
            components.controller_manager_argv(
                binaries.kube_controller_manager, layout, self.node_grace_s
            ),
        )
        self._launch("kube-scheduler", components.scheduler_argv(binaries.kube_scheduler, layout))
        lease = self.node_grace_s or components.NODE_LEASE_DURATION_S
        self._launch("kwok", components.kwok_argv(binaries.kwok, layout, lease))
        for name in self.fake_node_names:
            api.create("/api/v1/nodes", fake_node_manifest(name))

        kcm_port, scheduler_port = layout.ports.controller_manager, layout.ports.scheduler
        self._wait(
            "kube-controller-manager and kube-scheduler /healthz",
            deadline,
            lambda: (
                api.is_healthy("/healthz", port=kcm_port)
                and api.is_healthy("/healthz", port=scheduler_port)
            ),
        )
        selector = quote(f"{FAKE_NODE_LABEL[0]}={FAKE_NODE_LABEL[1]}")

        def nodes_schedulable() -> bool:
            nodes = api.get_json(f"/api/v1/nodes?labelSelector={selector}")["items"]
            ready = [node for node in nodes if node_is_schedulable(node)]
            return len(ready) == self.fake_nodes

        self._wait(f"{self.fake_nodes} fake nodes Ready and untainted", deadline, nodes_schedulable)
        self._wait(
            "the default ServiceAccount in namespace default",
            deadline,
            lambda: (
                api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default").status
                == 200
            ),
        )
        self._warm_kwok_ip_pool(api, deadline)

    @property
    def node_layout(self) -> real_node.NodeLayout:
        """The real node's files (tier c)."""
        return real_node.NodeLayout(self.directory / "node")

    def _start_real_node(
        self,
        layout: ControlPlaneLayout,
        api: AdminApi,
        deadline: float,
        kubelet_port: int,
        healthz_port: int,
    ) -> None:
        assert self.images is not None
        node = self.node_layout
        shutil.rmtree(node.directory, ignore_errors=True)
        self.host_before = real_node.claim_machine(self.directory, self.progress)
        self._node_claimed = True
        self.progress(f"real node: bridge {real_node.BRIDGE} at {real_node.NODE_IP}, containerd")
        real_node.setup_network(layout.ports.apiserver)
        real_node.write_node_files(
            node, layout.pki, layout.server_url, self.images.pause, kubelet_port, healthz_port
        )
        self._launch("containerd", real_node.containerd_argv(node))
        self._record_node()
        self._wait("containerd", deadline, lambda: real_node.containerd_ready(node))
        swept = real_node.remove_containers(node)  # left by a node that crashed
        if swept:
            self.progress(f"removed {swept} containers an earlier node left in containerd")
        assert self._builder is not None
        load_images(self._builder, node.containerd_socket, self.images, progress=self.progress)
        # The kubelet's own budget, however long the images took (`KUBELET_READY_TIMEOUT_S`).
        deadline = max(deadline, time.monotonic() + KUBELET_READY_TIMEOUT_S)
        self._launch("kubelet", real_node.kubelet_argv(node))
        self._record_node()

        def node_ready() -> bool:
            response = api.request("GET", f"/api/v1/nodes/{real_node.NODE_NAME}")
            return response.status == 200 and real_node.node_is_ready(response.json())

        self._wait(f"node {real_node.NODE_NAME} Ready and untainted", deadline, node_ready)

    def _record_node(self) -> None:
        real_node.record_node_processes(
            [p.record for p in self._processes if p.started and p.name in NODE_COMPONENTS]
        )

    def _warm_kwok_ip_pool(self, api: AdminApi, deadline: float) -> None:
        """kwok creates its pod IP pool on first use, unlocked: pods started at once on a
        fresh kwok may each create a pool and be given the same first address (seen: a
        prefill and a decode pod both at 127.N.0.1, one of them never served). One pod,
        given its IP before any other pod exists, creates the pool; it is then deleted and
        its address goes back to the pool."""
        pods = "/api/v1/namespaces/default/pods"
        name = "kvtopo-kwok-ip-pool"
        api.create(
            pods,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    **FAKE_NODE_PLACEMENT,
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}],
                },
            },
        )
        self._wait(
            "kwok's pod IP pool (a first pod given its IP)",
            deadline,
            lambda: bool((api.get_json(f"{pods}/{name}").get("status") or {}).get("podIP")),
        )
        api.request("DELETE", f"{pods}/{name}")

    def restart_apiserver(self, timeout_s: float = 60.0) -> float:
        """Stops kube-apiserver and starts it again on the same port (a chaos drill's fault);
        returns the seconds until it was ready again."""
        binaries = self._binaries
        assert binaries is not None, "the cluster is not up"
        old = next(p for p in self._processes if p.name == "kube-apiserver")
        t0 = time.monotonic()
        stop_processes([old.record])
        old.reap()
        self._processes.remove(old)
        self._launch(
            "kube-apiserver",
            components.apiserver_argv(binaries.kube_apiserver, self.layout, self.tier),
        )
        api = AdminApi(self.layout.pki, components.LOOPBACK, self.layout.ports.apiserver)
        self._wait(
            "kube-apiserver /readyz after restart",
            time.monotonic() + timeout_s,
            lambda: api.is_healthy("/readyz"),
        )
        return round(time.monotonic() - t0, 2)

    def pause_component(self, name: str, seconds: float) -> float:
        """Freezes component `name` (SIGSTOP) for `seconds`, then lets it go on (SIGCONT):
        a stalled kube-apiserver, as a chaos drill's fault. Its connections stay open and
        unanswered meanwhile. Returns the seconds it was stopped."""
        process = next(p for p in self._processes if p.name == name)
        pid = process.record.pid
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself is a length of time
        finally:
            os.kill(pid, signal.SIGCONT)
        return round(time.monotonic() - t0, 2)

    def _launch(self, name: str, argv: list[str]) -> None:
        process = ComponentProcess(
            name, argv, self.layout.log(name), die_with_parent=self.die_with_parent
        )
        self._processes.append(process)
        self._logs[name] = process.log
        process.start()
        # Recorded at once, so `kvtopo cluster down` elsewhere can stop a half-started cluster.
        self.state().save(self.directory)

    def _check_processes(self) -> None:
        for process in self._processes:
            process.check_running()

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        def probe() -> bool:
            self._check_processes()
            return ready()

        wait_until(
            probe,
            max(0.0, deadline - time.monotonic()),
            what,
            describe_last=lambda: "component logs:\n" + self.log_tails(15),
        )
