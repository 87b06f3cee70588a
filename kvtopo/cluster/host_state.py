"""What a real node changes on this machine, captured before and compared after.

Owns :class:`HostSnapshot`: the network links (``ip link``), the firewall (``iptables-save``
and ``ip6tables-save``, counters dropped), the mount points, the kernel settings the kubelet
and the node's network set (:data:`SYSCTLS`) and whether the folders the kubelet, containerd
and CNI create outside their configured roots exist (:data:`HOST_PATHS`). The real node
(:mod:`kvtopo.cluster.real_node`) saves one before it touches anything and puts the machine
back to it on teardown; ``diff`` says what still differs, so a test can assert nothing does.

Reading needs root only for the firewall; everything here shells out to ``ip``, the
``iptables`` tools and reads ``/proc``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The kubelet sets the first six at start (setupKernelTunables); the node's network needs
# forwarding off to stay off (pods reach the API server by DNAT, not by routing out).
SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
)
# Created by the kubelet (device plugins, pod logs), containerd (shim sockets, runc state) or
# CNI (its result cache) whatever roots they are given.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/run/containerd",
    "/run/netns",
    "/etc/cni",
    "/opt/cni",
)
FIREWALL_TOOLS = {"ipv4": "iptables-save", "ipv6": "ip6tables-save"}
_COUNTERS = re.compile(r"\[\d+:\d+\]")


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str:
    return " ".join(sysctl_path(name).read_text().split())


def write_sysctl(name: str, value: str) -> None:
    sysctl_path(name).write_text(value + "\n")


def links() -> list[str]:
    """``name kind`` of every network link (addresses and counters change by themselves)."""
    out: list[str] = []
    for link in json.loads(_run("ip", "-details", "-json", "link", "show") or "[]"):
        kind = (link.get("linkinfo") or {}).get("info_kind", "")
        out.append(f"{link['ifname']} {kind}".strip())
    return sorted(out)


def firewall(tool: str) -> list[str]:
    """The rules of every table, counters and comments dropped; a table holding nothing but
    its built-in chains at policy ACCEPT reads as absent (listing a table creates it)."""
    if shutil.which(tool) is None:
        return []
    tables: list[str] = []
    table: list[str] = []
    for raw in _run(tool).splitlines():
        line = _COUNTERS.sub("", raw).strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table = [line]
        elif line == "COMMIT":
            empty = all(
                entry.startswith("*") or re.fullmatch(r":\S+ ACCEPT", entry) for entry in table
            )
            if not empty:
                tables += [*table, "COMMIT"]
        else:
            table.append(line)
    return tables


def mount_points() -> list[str]:
    """``mount-point fstype`` of every mount this process sees."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        out.append(f"{before.split()[4]} {after.split()[0]}")
    return sorted(out)


@dataclass(frozen=True)
class HostSnapshot:
    """The host settings a real node may change (see the module docstring)."""

    links: list[str]
    firewall: dict[str, list[str]]
    mounts: list[str]
    sysctls: dict[str, str]
    paths: dict[str, bool] = field(default_factory=dict)
    # The tools' own output, what restore_firewall puts back.
    firewall_raw: dict[str, str] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> HostSnapshot:
        sysctls: dict[str, str] = {}
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                sysctls[name] = read_sysctl(name)
        return cls(
            links=links(),
            firewall={family: firewall(tool) for family, tool in FIREWALL_TOOLS.items()},
            mounts=mount_points(),
            sysctls=sysctls,
            paths={path: Path(path).exists() for path in HOST_PATHS},
            firewall_raw={
                family: _run(tool) if shutil.which(tool) else ""
                for family, tool in FIREWALL_TOOLS.items()
            },
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "links": self.links,
            "firewall": self.firewall,
            "mounts": self.mounts,
            "sysctls": self.sysctls,
            "paths": self.paths,
            "firewall_raw": self.firewall_raw,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostSnapshot:
        return cls(
            links=[str(x) for x in data["links"]],
            firewall={str(k): [str(x) for x in v] for k, v in data["firewall"].items()},
            mounts=[str(x) for x in data["mounts"]],
            sysctls={str(k): str(v) for k, v in data["sysctls"].items()},
            paths={str(k): bool(v) for k, v in data.get("paths", {}).items()},
            firewall_raw={str(k): str(v) for k, v in data.get("firewall_raw", {}).items()},
        )

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> HostSnapshot | None:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def diff(self, now: HostSnapshot) -> list[str]:
        """What differs in ``now`` from this snapshot, one line each (empty: nothing)."""
        lines: list[str] = []

        def compare(what: str, before: list[str], after: list[str]) -> None:
            lines.extend(f"{what}: gone {x!r}" for x in before if x not in after)
            lines.extend(f"{what}: new {x!r}" for x in after if x not in before)

        compare("link", self.links, now.links)
        for family in sorted(set(self.firewall) | set(now.firewall)):
            compare(
                f"{family} firewall",
                self.firewall.get(family, []),
                now.firewall.get(family, []),
            )
        compare("mount", self.mounts, now.mounts)
        for name, value in self.sysctls.items():
            if now.sysctls.get(name) != value:
                lines.append(f"sysctl {name}: {value!r} before, {now.sysctls.get(name)!r} now")
        for path, existed in self.paths.items():
            if now.paths.get(path, existed) != existed:
                lines.append(f"path {path}: {'existed' if existed else 'absent'} before")
        return lines

    def restore_sysctls(self) -> list[str]:
        """Write back every setting that differs now; returns their names."""
        restored = []
        for name, value in self.sysctls.items():
            with contextlib.suppress(OSError):
                if read_sysctl(name) != value:
                    write_sysctl(name, value)
                    restored.append(name)
        return restored

    def restore_firewall(self) -> list[str]:
        """Put every table back as saved: the tables saved are restored whole (the restore
        tool flushes each first), those created since are deleted (``nft``; without it they
        are flushed and their chains removed, which :func:`firewall` reads as absent).
        Returns ``family table`` for each table touched."""
        touched: list[str] = []
        nft_family = {"ipv4": "ip", "ipv6": "ip6"}
        for family, tool in FIREWALL_TOOLS.items():
            if shutil.which(tool) is None:
                continue
            saved = self.firewall_raw.get(family, "")
            before = set(re.findall(r"^\*(\S+)", saved, re.MULTILINE))
            now = set(re.findall(r"^\*(\S+)", _run(tool), re.MULTILINE))
            if before:
                restore = tool.replace("-save", "-restore")
                subprocess.run([restore], input=saved, text=True, check=True, timeout=30)
            for table in sorted(now - before):
                deleted = shutil.which("nft") is not None and (
                    subprocess.run(
                        ["nft", "delete", "table", nft_family[family], table],
                        capture_output=True,
                        check=False,
                        timeout=30,
                    ).returncode
                    == 0
                )
                if not deleted:
                    cli = tool.removesuffix("-save")
                    subprocess.run([cli, "-t", table, "-F"], check=False, timeout=30)
                    subprocess.run([cli, "-t", table, "-X"], check=False, timeout=30)
            touched += [f"{family} {table}" for table in sorted(before | now)]
        return touched

    def remove_new_paths(self) -> list[str]:
        """Delete the :data:`HOST_PATHS` that did not exist before (with what they hold;
        called once nothing is mounted under them any more); returns those removed."""
        removed = []
        for path, existed in self.paths.items():
            if not existed and Path(path).exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed
