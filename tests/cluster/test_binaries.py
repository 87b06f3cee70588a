"""Binary lookup order: KUBEBUILDER_ASSETS, then the stamped version-keyed cache, else a
clear error naming `make toolchain` (no binaries needed: fake executables in tmp folders)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtopo.cluster import binaries
from kvtopo.cluster.binaries import (
    BinariesMissingError,
    ControlPlaneBinaries,
    find_binaries,
    locate_binary,
)


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def empty_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root and no KUBEBUILDER_ASSETS."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVTOPO_CACHE", str(cache))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    return cache


def _stamped_cache_binary(cache: Path, name: str) -> Path:
    product, version = binaries.PRODUCT_OF_BINARY[name]
    folder = cache / "bin" / f"{product}-{version}"
    (folder).mkdir(parents=True, exist_ok=True)
    (folder / ".stamp").write_text("2026-01-01T00:00:00Z\n")
    return _executable(folder / name)


def test_cache_folder_is_keyed_by_product_and_version(empty_env: Path) -> None:
    assert binaries.cached_product_dir("kube-apiserver") == (
        empty_env / "bin" / f"k8s-{binaries.K8S_VERSION}"
    )
    assert binaries.cached_product_dir("etcd").name == f"etcd-{binaries.ETCD_VERSION}"
    assert binaries.cached_product_dir("kwok").name == f"kwok-{binaries.KWOK_VERSION}"


def test_assets_folder_wins_over_the_cache(
    empty_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = _stamped_cache_binary(empty_env, "kube-apiserver")
    assets = tmp_path / "assets"
    from_assets = _executable(assets / "kube-apiserver")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    assert locate_binary("kube-apiserver") == from_assets
    monkeypatch.delenv("KUBEBUILDER_ASSETS")
    assert locate_binary("kube-apiserver") == cached


def test_binary_missing_from_assets_falls_back_to_the_cache(
    empty_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # envtest's assets hold etcd, kube-apiserver and kubectl, never kwok.
    kwok = _stamped_cache_binary(empty_env, "kwok")
    _executable(tmp_path / "assets" / "etcd")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path / "assets"))
    assert locate_binary("kwok") == kwok
    assert locate_binary("etcd") == tmp_path / "assets" / "etcd"


def test_unstamped_cache_folder_is_not_trusted(empty_env: Path) -> None:
    path = _stamped_cache_binary(empty_env, "etcd")
    (path.parent / ".stamp").unlink()  # an interrupted build
    assert locate_binary("etcd") is None


def test_missing_binaries_raise_one_error_naming_all_and_the_fix(empty_env: Path) -> None:
    _stamped_cache_binary(empty_env, "etcd")
    with pytest.raises(BinariesMissingError) as raised:
        find_binaries(binaries.TIER_B_BINARIES)
    message = str(raised.value)
    for name in ("kube-apiserver", "kubectl", "kube-scheduler", "kwok"):
        assert name in message
    assert "etcd," not in message  # found, so not listed as missing
    assert "make toolchain" in message
    assert "KUBEBUILDER_ASSETS" in message


def test_tier_a_needs_only_etcd_apiserver_kubectl(empty_env: Path) -> None:
    for name in binaries.TIER_A_BINARIES:
        _stamped_cache_binary(empty_env, name)
    tier_a = ControlPlaneBinaries.for_tier("a")
    assert tier_a.kube_apiserver.name == "kube-apiserver"
    assert tier_a.kwok is None
    with pytest.raises(BinariesMissingError, match="kwok"):
        ControlPlaneBinaries.for_tier("b")
