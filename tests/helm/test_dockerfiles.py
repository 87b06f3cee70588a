"""The Dockerfiles in docker/ stay consistent with pyproject.toml and the Helm chart.

The images are built for real by `make images` (tests/node); this checks, without a build,
what one relies on: every COPY source exists and survives the per-Dockerfile .dockerignore,
every package folder pyproject maps is copied (else the project's build fails), both install
exactly uv.lock, every import package ships in the wheel, the entry points are
the project's console scripts, the final stage runs as the same non-root numeric user as
the chart's securityContext, the exposed ports are the chart's, and the operator image
installs neither torch nor nixl.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART, ROOT

DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for name, arg in self.instructions if name == op]


def stages(path: Path) -> list[Stage]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuations joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            out.append(Stage(arg.split()[0]))
        elif out:
            out[-1].instructions.append((op, arg.strip()))
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the patterns used here (last match wins)."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes
        ):
            result = not negate
    return result


def ignore_patterns(dockerfile: Path) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} missing"
    return [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


IMAGES = {
    "operator": ("kvtopo-operator", {VALUES["metrics"]["port"], VALUES["health"]["port"]}),
    "worker": ("kvtopo-worker", {VALUES["workers"]["controlPort"]}),
}


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_is_consistent_with_the_project_and_the_chart(image: str) -> None:
    dockerfile = DOCKER / f"{image}.Dockerfile"
    script, ports = IMAGES[image]
    deps, build, final = stages(dockerfile)[-3:]
    # Multi-stage: the final image copies the locked virtualenv, then the project's files.
    assert final.all("COPY") == [
        "--from=deps /opt/kvtopo /opt/kvtopo",
        "--from=build /project/ /opt/kvtopo/",
    ]
    assert final.all("ENTRYPOINT") == [f'["{script}"]']
    assert script in PYPROJECT["project"]["scripts"]
    # Non-root, numeric, the chart's default uid/gid.
    user = VALUES["securityContext"]
    assert final.all("USER") == [f"{user['runAsUser']}:{user['runAsGroup']}"]
    assert user["runAsUser"] != 0
    exposed = {int(p) for line in final.all("EXPOSE") for p in line.split()}
    assert exposed == ports
    # Every package folder pyproject maps is copied, and survives the .dockerignore.
    patterns = ignore_patterns(dockerfile)
    copied = {
        src.rstrip("/")
        for line in deps.all("COPY") + build.all("COPY")
        if not line.startswith("--from=")  # another stage's files (uv), not the context
        for src in line.split()[:-1]
        if not src.startswith("--")
    }
    needed = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    needed |= {"pyproject.toml", "uv.lock", PYPROJECT["project"]["readme"]}
    # A package folder is copied by itself or with the top-level folder that holds it.
    missing = {n for n in needed if not any(n == c or n.startswith(f"{c}/") for c in copied)}
    assert not missing, f"not copied: {sorted(missing)}"
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not ignored(src, patterns), f"{src} is excluded by the .dockerignore"
        for child in (ROOT / src).rglob("*.py") if (ROOT / src).is_dir() else []:
            rel = child.relative_to(ROOT).as_posix()
            assert not ignored(rel, patterns), f"{rel} is excluded by the .dockerignore"
    for junk in ("tests/helm/chart.py", ".git/HEAD", "worker/__pycache__/x.pyc", "helm"):
        assert ignored(junk, patterns), f"{junk} would be sent to the build"


def uv_syncs(image: str) -> list[str]:
    """The build stage's `uv sync` commands (the only way anything is installed)."""
    deps, build = stages(DOCKER / f"{image}.Dockerfile")[-3:-1]
    runs = deps.all("RUN") + build.all("RUN")
    assert not [r for r in runs if "pip install" in r], "install from uv.lock, not with pip"
    return [r for r in runs if "uv sync" in r]


def test_both_images_install_exactly_the_lock() -> None:
    for image in IMAGES:
        syncs = uv_syncs(image)
        # The locked dependencies first (a layer cached while uv.lock stays), then the project.
        assert len(syncs) == 2 and "--no-install-project" in syncs[0], image
        assert all("--frozen" in sync for sync in syncs), image
        assert "--no-editable" in syncs[1], image


def test_operator_image_has_no_worker_extras() -> None:
    syncs = " ".join(uv_syncs("operator"))
    assert "--extra" not in syncs and "torch" not in syncs.replace('import torch"', "")


def test_worker_image_installs_the_worker_extra() -> None:
    assert all("--extra worker" in sync for sync in uv_syncs("worker"))
    assert "worker" in PYPROJECT["project"]["optional-dependencies"]


def test_chart_and_examples_name_the_documented_images() -> None:
    readme = (DOCKER / "README.md").read_text()
    assert VALUES["image"]["repository"] == "ghcr.io/kvtopo/operator"
    assert "`ghcr.io/kvtopo/operator`" in readme and "`ghcr.io/kvtopo/worker`" in readme
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert f"ghcr.io/kvtopo/operator:{chart['appVersion']}" in readme
    for name in ("prefill-deployment.yaml", "decode-deployment.yaml"):
        pod = yaml.safe_load((ROOT / "examples" / name).read_text())["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"].startswith("ghcr.io/kvtopo/worker:"), name
        assert pod["containers"][0]["command"] == ["kvtopo-worker"], name


def test_every_import_package_is_in_the_wheel() -> None:
    """The images install the project non-editable: only the packages pyproject lists ship.
    A subpackage left out imports fine in the editable dev venv and fails in the image (seen:
    kvtopo_worker.push, so the worker image's `kvtopo-worker` died on import)."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = set()
    for name, folder in setuptools["package-dir"].items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            on_disk.add(".".join((name, *init.parent.relative_to(root).parts)))
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - on_disk == set(), "these listed packages have no __init__.py"
