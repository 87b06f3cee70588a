"""Helpers for the Helm chart tests: running helm, rendering the chart, finding objects.

Helm runs with its own config, cache and data folders under a temporary directory (so tests
neither read nor write the user's Helm setup) and with an explicit ``--kube-version`` when
rendering: a helm built from source defaults ``helm template`` to Kubernetes v1.20, which the
chart's ``kubeVersion`` refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtopo.cluster.binaries import BinariesMissingError, find_binary
from kvtopo.cluster.fake_nodes import FAKE_NODE_PLACEMENT
from kvtopo.cluster.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvtopo"
FULL_VALUES = Path(__file__).resolve().parent / "values" / "full.yaml"
KUBE_VERSION = "1.36.3"
HELM_TIMEOUT_S = 120.0

# Pods of the operator land on kwok's fake nodes (tier b) only with these.
KWOK_PLACEMENT: dict[str, Any] = FAKE_NODE_PLACEMENT


def binary(name: str) -> Path:
    """The helm or kubectl binary; fails the test (never skips) when it is missing."""
    try:
        return find_binary(name)
    except BinariesMissingError as error:
        pytest.fail(f"{name} is needed by the chart tests: {error}", pytrace=False)


class HelmError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}:\n{self.stderr}"


@dataclass
class Helm:
    """One helm CLI setup; ``kubeconfig`` only for commands that talk to a cluster."""

    home: Path
    kubeconfig: Path | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
        env.update(
            HELM_CONFIG_HOME=str(self.home / "config"),
            HELM_CACHE_HOME=str(self.home / "cache"),
            HELM_DATA_HOME=str(self.home / "data"),
        )
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        else:
            env.pop("KUBECONFIG", None)
        return env

    def run(
        self, *args: str, check: bool = True, timeout: float = HELM_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(binary("helm")), *args]
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self.env(), check=False
        )
        if check and result.returncode != 0:
            raise HelmError(result.returncode, argv, result.stdout, result.stderr)
        return result


def values_args(values: dict[str, Any] | None = None, *files: Path) -> list[str]:
    """``-f`` for each file, then one ``--set-json`` per top-level key of ``values`` (which
    wins; maps merge into the chart's values, lists replace them)."""
    args: list[str] = []
    for f in files:
        args += ["-f", str(f)]
    for key, value in (values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render_text(
    helm: Helm,
    values: dict[str, Any] | None = None,
    *files: Path,
    release: str = "kvtopo",
    namespace: str = "kvtopo-system",
    extra: tuple[str, ...] = (),
) -> str:
    return helm.run(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *values_args(values, *files),
        *extra,
    ).stdout


def parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(
    helm: Helm,
    values: dict[str, Any] | None = None,
    *files: Path,
    release: str = "kvtopo",
    namespace: str = "kvtopo-system",
) -> list[dict[str, Any]]:
    return parse(render_text(helm, values, *files, release=release, namespace=namespace))


def objects(
    docs: list[dict[str, Any]], kind: str, namespace: str | None = None
) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] == kind and (namespace is None or d["metadata"].get("namespace") == namespace)
    ]


def one(docs: list[dict[str, Any]], kind: str, namespace: str | None = None) -> dict[str, Any]:
    found = objects(docs, kind, namespace)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The operator container of the rendered Deployment."""
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def rules_set(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """RBAC rules flattened to (apiGroup, resource, resourceName or '*', verb)."""
    out = set()
    for rule in rules:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for name in rule.get("resourceNames") or ["*"]:
                    for verb in rule["verbs"]:
                        out.add((group, resource, name, verb))
    return out


def can_i(
    cluster: LocalCluster, sa: str, verb: str, resource: str, *where: str, subresource: str = ""
) -> bool:
    """`kubectl auth can-i` as user `sa` (the admin impersonating it): True for "yes"."""
    args = ["auth", "can-i", verb, resource, f"--as={sa}", *where]
    if subresource:
        args.append(f"--subresource={subresource}")
    result = cluster.kubectl(*args, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {result.stdout}{result.stderr}"
    return answer == "yes"
