"""Where the control-plane binaries come from.

Owns the pinned versions and the lookup order the design's "Commands" section fixes:

1. ``KUBEBUILDER_ASSETS``: the controller-runtime envtest convention, a folder holding
   ``etcd``, ``kube-apiserver``, ``kubectl`` ... (what ``setup-envtest`` installs, or release
   binaries). A binary missing there is looked up in the cache instead: envtest never ships
   kwok, the scheduler or the controller manager.
2. The version-keyed cache ``$KVTOPO_CACHE/bin/<product>-<version>/`` that
   ``toolchain/build.sh`` fills; a product folder counts only once its ``.stamp`` exists,
   so a half-finished build is never trusted.

Nothing here builds anything: a missing binary is a :class:`BinariesMissingError` telling
the user to run ``make toolchain``. Called by :mod:`kvtopo.cluster.local_cluster`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"
PAUSE_VERSION = "1.0"

ASSETS_ENV = "KUBEBUILDER_ASSETS"
CACHE_ENV = "KVTOPO_CACHE"

# binary name -> (product folder prefix, version), mirroring toolchain/build.sh
PRODUCT_OF_BINARY: dict[str, tuple[str, str]] = {
    "etcd": ("etcd", ETCD_VERSION),
    "kube-apiserver": ("k8s", K8S_VERSION),
    "kube-controller-manager": ("k8s", K8S_VERSION),
    "kube-scheduler": ("k8s", K8S_VERSION),
    "kubectl": ("k8s", K8S_VERSION),
    "kubelet": ("kubelet", K8S_VERSION),
    "pause": ("pause", PAUSE_VERSION),
    "kwok": ("kwok", KWOK_VERSION),
    "helm": ("helm", HELM_VERSION),
}

TIER_A_BINARIES = ("etcd", "kube-apiserver", "kubectl")
TIER_B_BINARIES = (*TIER_A_BINARIES, "kube-controller-manager", "kube-scheduler", "kwok")


class BinariesMissingError(RuntimeError):
    """Some control-plane binary is neither in ``KUBEBUILDER_ASSETS`` nor in the cache."""


def cache_root() -> Path:
    """``$KVTOPO_CACHE``, default ``~/.cache/kvtopo`` (the Makefile's default too)."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvtopo"


def cached_product_dir(binary: str) -> Path:
    """The cache folder ``toolchain/build.sh`` writes ``binary`` into."""
    product, version = PRODUCT_OF_BINARY[binary]
    return cache_root() / "bin" / f"{product}-{version}"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def locate_binary(binary: str) -> Path | None:
    """The path of ``binary`` by the documented lookup order, or None when nowhere."""
    if binary not in PRODUCT_OF_BINARY:
        raise ValueError(f"unknown control-plane binary {binary!r}")
    assets = os.environ.get(ASSETS_ENV)
    if assets and _executable(Path(assets) / binary):
        return Path(assets) / binary
    product_dir = cached_product_dir(binary)
    if (product_dir / ".stamp").is_file() and _executable(product_dir / binary):
        return product_dir / binary
    return None


def find_binary(binary: str) -> Path:
    """Like :func:`locate_binary`, raising :class:`BinariesMissingError` when missing."""
    return find_binaries((binary,))[binary]


def find_binaries(names: tuple[str, ...]) -> dict[str, Path]:
    """Every binary in ``names``, or one error listing all the missing ones at once."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        path = locate_binary(name)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        assets = os.environ.get(ASSETS_ENV)
        looked_in = [f"${ASSETS_ENV}={assets}"] if assets else []
        looked_in += sorted({str(cached_product_dir(name)) for name in missing})
        raise BinariesMissingError(
            f"control-plane binaries not found: {', '.join(missing)} "
            f"(looked in: {'; '.join(looked_in)}). Build them once with `make toolchain` "
            f"(or `toolchain/build.sh`), or point {ASSETS_ENV} at a folder holding them."
        )
    return found


@dataclass(frozen=True)
class ControlPlaneBinaries:
    """Resolved paths of the binaries one tier needs (kwok and friends only for tier b)."""

    etcd: Path
    kube_apiserver: Path
    kubectl: Path
    kube_controller_manager: Path | None = None
    kube_scheduler: Path | None = None
    kwok: Path | None = None

    @classmethod
    def for_tier(cls, tier: str) -> ControlPlaneBinaries:
        if tier == "a":
            paths = find_binaries(TIER_A_BINARIES)
            return cls(paths["etcd"], paths["kube-apiserver"], paths["kubectl"])
        if tier in ("b", "c"):  # tier c's node binaries: kvtopo.cluster.real_node
            paths = find_binaries(TIER_B_BINARIES)
            return cls(
                paths["etcd"],
                paths["kube-apiserver"],
                paths["kubectl"],
                paths["kube-controller-manager"],
                paths["kube-scheduler"],
                paths["kwok"],
            )
        raise ValueError(f"unknown tier {tier!r} (known: a, b, c)")
