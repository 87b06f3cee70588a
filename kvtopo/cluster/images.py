"""The real node's container images, built locally with buildah and loaded into its containerd.

Owns every image tier c runs, each tagged by a hash of what goes into it, so a second build of
the same tree finds them all and takes seconds:

- ``debian-python``: a Debian bookworm made by ``debootstrap`` with python3.11 (the stand-in
  for ``python:3.11-slim-bookworm``: no registry is reachable here), imported ``FROM scratch``;
- ``uv``: the uv binary the Makefile bootstraps, at ``/uv`` (the stand-in for
  ``ghcr.io/astral-sh/uv``);
- ``pause``: the pod sandbox, ``toolchain/pause`` built static, ``FROM scratch``;
- ``operator`` and ``worker``: ``docker/*.Dockerfile`` as users build them, on those two, with
  uv's download cache mounted (the wheels ``make venv`` fetched) and the machine's CA bundle.

Storage is private (``$KVTOPO_CACHE/images/storage``, overlay). :func:`load_images` copies
the images a containerd lacks into it (``buildah push`` to an OCI layout kept per image, so
unchanged layers are neither written nor unpacked again, then ``ctr import``),
and :func:`prune_images` keeps one tag per repository on both sides. Used by
:mod:`kvtopo.cluster.real_node` and ``python -m kvtopo.cluster.images`` (``make images``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtopo.cluster.binaries import cache_root, find_binary

Progress = Callable[[str], None]

REPOSITORY = "localhost/kvtopo"
NAMES = ("debian-python", "uv", "pause", "operator", "worker")
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What the images need of Debian beyond minbase: the interpreter the venv runs on, OpenMP's
# runtime (nixl's UCX plugins link it), CA certificates.
DEBIAN_PACKAGES = ("python3.11", "libgomp1", "ca-certificates")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
VAR_TMP = Path("/var/tmp")  # noqa: S108 - where buildah stages blobs; swept under the lock
STEPS_FILE = "steps.json"  # ref -> the image ids of its build steps
CONTAINERD_NAMESPACE = "k8s.io"  # the CRI plugin's namespace: images the kubelet can run
HASH_LENGTH = 16
BUILD_TIMEOUT_S = 1800.0
# What a Dockerfile's context may hold (its .dockerignore keeps the rest out).
CONTEXT_SKIP = re.compile(r"(^|/)(__pycache__|\.mypy_cache|\.pytest_cache)(/|$)|\.pyc$")


def _quiet(_: str) -> None:
    pass


class ImageBuildError(RuntimeError):
    """A build step failed; the message carries the command's output tail."""


def images_root() -> Path:
    return cache_root() / "images"


def repo_root() -> Path:
    """The source tree the Dockerfiles build (this file lives in ``kvtopo/cluster``)."""
    return Path(__file__).resolve().parents[2]


def _sha(parts: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()[:HASH_LENGTH]


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def context_files(root: Path, dockerfile: Path) -> list[Path]:
    """The files of ``root`` a build of ``dockerfile`` sees: its .dockerignore's allow-list
    (``*`` then ``!path`` lines, the only form docker/ uses), minus caches and results."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    allowed = [
        line.strip()[1:].rstrip("/")
        for line in ignore.read_text().splitlines()
        if line.strip().startswith("!")
    ]
    files: list[Path] = []
    for entry in allowed:
        path = root / entry
        candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
        for candidate in candidates:
            rel = candidate.relative_to(root).as_posix()
            wanted = not CONTEXT_SKIP.search(rel) and not rel.startswith("bench/results")
            if candidate.is_file() and wanted:
                files.append(candidate)
    return files


def uv_binary() -> Path:
    """The uv the Makefile bootstrapped, the version the Dockerfiles' ``UV_IMAGE`` names."""
    version = dockerfile_uv_version(repo_root() / "docker" / "worker.Dockerfile")
    path = cache_root() / f"uv-{version}" / "bin" / "uv"
    if not path.is_file():
        raise ImageBuildError(f"uv {version} not found at {path}: run `make venv` first")
    return path


def dockerfile_uv_version(dockerfile: Path) -> str:
    match = re.search(r"^ARG UV_IMAGE=\S+:(\S+)$", dockerfile.read_text(), re.MULTILINE)
    if match is None:
        raise ImageBuildError(f"{dockerfile} names no UV_IMAGE version")
    return match.group(1)


@dataclass(frozen=True)
class ImageSet:
    """The references of one build: ``localhost/kvtopo/<name>:<hash>``."""

    refs: dict[str, str]

    @property
    def pause(self) -> str:
        return self.refs["pause"]

    @property
    def operator(self) -> str:
        return self.refs["operator"]

    @property
    def worker(self) -> str:
        return self.refs["worker"]

    def to_json(self) -> dict[str, str]:
        return dict(self.refs)


class ImageBuilder:
    """Builds :data:`NAMES` into private buildah storage, each only when its tag is missing."""

    def __init__(self, root: Path | None = None, progress: Progress = _quiet) -> None:
        self.root = (root or repo_root()).resolve()
        self.progress = progress
        self.cache = images_root()
        self.storage = self.cache / "storage"
        self.runroot = Path("/run/kvtopo-buildah")
        self.tmp = self.cache / "tmp"
        self.timings: dict[str, float] = {}

    # -- buildah ----------------------------------------------------------------------

    def buildah(self, *args: str, timeout: float = BUILD_TIMEOUT_S) -> str:
        argv = [
            "buildah",
            f"--root={self.storage}",
            f"--runroot={self.runroot}",
            "--storage-driver=overlay",
            *args,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
            raise ImageBuildError(f"`{' '.join(argv[:6])} ...` failed:\n{tail}")
        return result.stdout

    def has_image(self, ref: str) -> bool:
        argv = ["buildah", f"--root={self.storage}", f"--runroot={self.runroot}"]
        argv += ["--storage-driver=overlay", "inspect", "--type=image", ref]
        return subprocess.run(argv, capture_output=True, check=False).returncode == 0

    def tags(self, name: str) -> list[str]:
        out = self.buildah("images", "--json")
        refs: list[str] = []
        for image in json.loads(out or "[]"):
            refs += [n for n in image.get("names") or [] if n.startswith(f"{REPOSITORY}/{name}:")]
        return refs

    def _bud(self, ref: str, context: Path, containerfile: Path, *extra: str) -> None:
        out = self.buildah(
            "bud",
            "--isolation=chroot",
            "--network=host",
            "--layers",
            f"--file={containerfile}",
            f"--tag={ref}",
            *extra,
            str(context),
        )
        # The images of every step (new or a cache hit): the layer cache prune() keeps.
        steps = re.findall(r"^--> (?:Using cache )?([0-9a-f]{11,64})\s*$", out, re.MULTILINE)
        recorded = self._steps()
        recorded[ref] = steps
        self._write_steps(recorded)

    def _steps(self) -> dict[str, list[str]]:
        try:
            data = json.loads((self.cache / STEPS_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {str(k): [str(x) for x in v] for k, v in data.items()}

    def _timed(self, name: str, ref: str, build: Callable[[], None]) -> str:
        if self.has_image(ref):
            return ref
        self.progress(f"building image {ref}")
        t0 = time.monotonic()
        build()
        self.timings[name] = round(time.monotonic() - t0, 1)
        self.progress(f"built {ref} in {self.timings[name]:.0f} s")
        return ref

    # -- the images -------------------------------------------------------------------

    def debian_python(self) -> str:
        inputs = [DEBIAN_SUITE, DEBIAN_MIRROR, *DEBIAN_PACKAGES]
        key = _sha([part.encode() for part in inputs])
        ref = f"{REPOSITORY}/debian-python:{DEBIAN_SUITE}-{key}"

        def build() -> None:
            if shutil.which("debootstrap") is None:
                raise ImageBuildError("debootstrap is missing: apt-get install debootstrap")
            with tempfile.TemporaryDirectory(prefix="kvtopo-debootstrap-") as tmp:
                rootfs = Path(tmp) / "rootfs"
                extra = ", ".join(DEBIAN_PACKAGES)
                self.progress(f"debootstrap {DEBIAN_SUITE} (minbase + {extra})")
                run = subprocess.run(
                    [
                        "debootstrap",
                        "--variant=minbase",
                        f"--include={','.join(DEBIAN_PACKAGES)}",
                        DEBIAN_SUITE,
                        str(rootfs),
                        DEBIAN_MIRROR,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                    check=False,
                )
                if run.returncode != 0:
                    tail = "\n".join((run.stdout + run.stderr).splitlines()[-20:])
                    raise ImageBuildError(f"debootstrap failed:\n{tail}")
                for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                    for path in (rootfs / junk).glob("*"):
                        if path.is_file():
                            path.unlink()
                context = Path(tmp) / "context"
                context.mkdir()
                subprocess.run(
                    [
                        "tar",
                        "-C",
                        str(rootfs),
                        "--numeric-owner",
                        "-cf",
                        str(context / "rootfs.tar"),
                        ".",
                    ],
                    check=True,
                    timeout=BUILD_TIMEOUT_S,
                )
                shutil.rmtree(rootfs, ignore_errors=True)
                containerfile = context / "Containerfile"
                containerfile.write_text('FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n')
                self._bud(ref, context, containerfile)

        return self._timed("debian-python", ref, build)

    def _single_file(self, name: str, binary: Path, tag: str, extra: str = "") -> str:
        ref = f"{REPOSITORY}/{name}:{tag}-{_sha([_file_digest(binary)])}"

        def build() -> None:
            with tempfile.TemporaryDirectory(prefix=f"kvtopo-{name}-") as tmp:
                shutil.copy2(binary, Path(tmp) / name)
                containerfile = Path(tmp) / "Containerfile"
                containerfile.write_text(f"FROM scratch\nCOPY {name} /{name}\n{extra}")
                self._bud(ref, Path(tmp), containerfile)

        return self._timed(name, ref, build)

    def uv(self) -> str:
        binary = uv_binary()
        return self._single_file("uv", binary, binary.parent.parent.name.removeprefix("uv-"))

    def pause(self) -> str:
        binary = find_binary("pause")
        extra = 'USER 65535:65535\nENTRYPOINT ["/pause"]\n'
        return self._single_file("pause", binary, binary.parent.name.removeprefix("pause-"), extra)

    def project(self, name: str, base: str, uv: str) -> str:
        dockerfile = self.root / "docker" / f"{name}.Dockerfile"
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        parts = [base.encode(), uv.encode(), dockerfile.read_bytes(), ignore.read_bytes()]
        for path in context_files(self.root, dockerfile):
            parts += [path.relative_to(self.root).as_posix().encode(), _file_digest(path)]
        ref = f"{REPOSITORY}/{name}:{_sha(parts)}"

        def build() -> None:
            uv_cache = Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv")
            extra = [
                f"--ignorefile={ignore}",
                f"--build-arg=PYTHON_IMAGE={base}",
                f"--build-arg=UV_IMAGE={uv}",
                # The wheels `make venv` downloaded: the build needs no index for them.
                f"--volume={uv_cache}:/root/.cache/uv",
            ]
            if CA_BUNDLE.is_file():
                extra += [
                    f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro",
                    f"--build-arg=SSL_CERT_FILE={CA_BUNDLE}",
                ]
            uv_cache.mkdir(parents=True, exist_ok=True)
            self._bud(ref, self.root, dockerfile, *extra)

        return self._timed(name, ref, build)

    def build_all(self) -> ImageSet:
        """Every image of :data:`NAMES` (those already built are found by their tags). One
        build at a time per machine (a file lock); working containers (and their mounts)
        are removed before and after, those of a killed build included."""
        if shutil.which("buildah") is None:
            raise ImageBuildError("buildah is missing: apt-get install buildah")
        self.cache.mkdir(parents=True, exist_ok=True)
        with (self.cache / ".build.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            shutil.rmtree(self.tmp, ignore_errors=True)
            # What a killed or failed build left in /var/tmp (gigabytes: a layer being
            # committed). Only buildah names folders so, and we hold its one build lock.
            for stale in [*VAR_TMP.glob("buildah[0-9]*"), *VAR_TMP.glob("storage[0-9]*")]:
                shutil.rmtree(stale, ignore_errors=True)
            self.buildah("rm", "--all")
            try:
                return self._build_all()
            finally:
                # A stage used by COPY --from stays mounted as a working container.
                self.buildah("rm", "--all")

    def _build_all(self) -> ImageSet:
        base = self.debian_python()
        uv = self.uv()
        refs = {
            "debian-python": base,
            "uv": uv,
            "pause": self.pause(),
            "operator": self.project("operator", base, uv),
            "worker": self.project("worker", base, uv),
        }
        return ImageSet(refs)

    def prune(self, keep: ImageSet) -> list[str]:
        """Remove every other tag of our repositories from buildah's storage, and every
        untagged image that is not a step of the kept images' builds (their layer cache: the
        locked dependencies stay until uv.lock changes); returns what was removed."""
        removed: list[str] = []
        for name, ref in keep.refs.items():
            for other in self.tags(name):
                if other != ref:
                    with contextlib.suppress(ImageBuildError):
                        self.buildah("rmi", other)
                        removed.append(other)
        recorded = self._steps()
        wanted = [step for ref in keep.refs.values() for step in recorded.get(ref, [])]
        self._write_steps({ref: recorded[ref] for ref in keep.refs.values() if ref in recorded})
        for image in json.loads(self.buildah("images", "--all", "--json") or "[]"):
            image_id = str(image.get("id", ""))
            if image.get("names") or any(image_id.startswith(step) for step in wanted):
                continue
            with contextlib.suppress(ImageBuildError):
                self.buildah("rmi", image_id)
                removed.append(image_id[:12])
        return removed

    def _write_steps(self, steps: dict[str, list[str]]) -> None:
        (self.cache / STEPS_FILE).write_text(json.dumps(steps, indent=1) + "\n")


def ctr(
    address: Path, *args: str, timeout: float = BUILD_TIMEOUT_S, stdin: IO[bytes] | None = None
) -> str:
    argv = ["ctr", f"--address={address}", f"--namespace={CONTAINERD_NAMESPACE}", *args]
    result = subprocess.run(argv, stdin=stdin, capture_output=True, timeout=timeout, check=False)
    stdout, stderr = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    if result.returncode != 0:
        raise ImageBuildError(f"`{' '.join(argv)}` failed: {stderr.strip()[-2000:]}")
    return stdout


def trim_layout(layout: Path, ref: str) -> None:
    """Keep only ``ref`` in an OCI layout: its index entry and the blobs it references."""
    index = json.loads((layout / "index.json").read_text())
    name_key = "org.opencontainers.image.ref.name"
    kept = [m for m in index.get("manifests", []) if m.get("annotations", {}).get(name_key) == ref]
    wanted: set[str] = set()
    for entry in kept:
        wanted.add(entry["digest"])
        manifest = json.loads(_blob(layout, entry["digest"]).read_text())
        wanted.add(manifest["config"]["digest"])
        wanted.update(layer["digest"] for layer in manifest.get("layers", []))
    index["manifests"] = kept
    (layout / "index.json").write_text(json.dumps(index))
    for blob in (layout / "blobs").glob("*/*"):
        if f"{blob.parent.name}:{blob.name}" not in wanted:
            blob.unlink()


def _blob(layout: Path, digest: str) -> Path:
    algorithm, _, value = digest.partition(":")
    return layout / "blobs" / algorithm / value


def containerd_images(address: Path) -> set[str]:
    return {line.strip() for line in ctr(address, "images", "list", "--quiet").splitlines()}


PUBLISHED = "ghcr.io/kvtopo"
"""Where the chart and the examples name kvtopo's images (`image.repository`'s default)."""


def published_names(version: str | None = None) -> dict[str, str]:
    """The names the chart's defaults and the examples give the operator and worker images:
    `ghcr.io/kvtopo/<name>:<the chart's appVersion>`."""
    if version is None:
        chart = (repo_root() / "helm" / "kvtopo" / "Chart.yaml").read_text()
        m = re.search(r'^appVersion:\s*"?([^"\s]+)"?', chart, re.M)
        version = m.group(1) if m else "0.0.0"
    return {name: f"{PUBLISHED}/{name}:{version}" for name in ("operator", "worker")}


def load_images(
    builder: ImageBuilder,
    address: Path,
    images: ImageSet,
    names: Iterable[str] = ("pause", "operator", "worker"),
    progress: Progress = _quiet,
) -> list[str]:
    """Copy the images of ``names`` a containerd (at ``address``) lacks into it, and drop the
    other tags of those repositories there; returns the refs loaded. The operator and worker
    images are tagged there under their published names too (`published_names`), as `kind
    load` does: `helm install kvtopo helm/kvtopo` with the chart's defaults, and the
    examples, run what was built, with no registry."""
    present = containerd_images(address)
    loaded: list[str] = []
    for name in names:
        ref = images.refs[name]
        # The older tags go once the new one is in: until then they keep the layers the two
        # share (and their unpacked snapshots) from containerd's garbage collector.
        stale = [r for r in present if r.startswith(f"{REPOSITORY}/{name}:") and r != ref]
        if ref in present:
            if stale:
                ctr(address, "images", "remove", *stale)
            continue
        progress(f"loading {ref} into the node's containerd")
        t0 = time.monotonic()
        # An OCI layout kept per image: a push skips the blobs it holds (the locked
        # dependencies' layer), and containerd skips unpacking the layers it has.
        layout = builder.cache / "oci" / name
        layout.parent.mkdir(parents=True, exist_ok=True)
        builder.buildah("push", "--disable-compression", ref, f"oci:{layout}:{ref}")
        trim_layout(layout, ref)
        # Only the blobs containerd lacks: importing reads what it is given, gigabytes for
        # the locked dependencies' layer, which it already holds after the first load.
        held = set(ctr(address, "content", "list", "--quiet").split())
        members = ["oci-layout", "index.json"] + [
            str(blob.relative_to(layout))
            for blob in sorted((layout / "blobs").glob("*/*"))
            if f"{blob.parent.name}:{blob.name}" not in held
        ]
        with subprocess.Popen(
            ["tar", "-C", str(layout), "-cf", "-", *members], stdout=subprocess.PIPE
        ) as tar:
            ctr(address, "images", "import", "-", stdin=tar.stdout)
        if tar.returncode:
            raise ImageBuildError(f"reading the OCI layout {layout} failed")
        if stale:
            ctr(address, "images", "remove", *stale)
        loaded.append(ref)
        progress(f"loaded {ref} in {time.monotonic() - t0:.0f} s")
    for name, alias in published_names().items():
        if name in images.refs and name in set(names):
            ctr(address, "images", "tag", "--force", images.refs[name], alias)
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtopo.cluster.images",
        description="Build the real node's images (operator, worker, pause) with buildah from "
        "docker/*.Dockerfile and uv.lock; print their references as JSON.",
    )
    parser.add_argument("--prune", action="store_true", help="drop older tags afterwards")
    parser.add_argument(
        "--push",
        metavar="REGISTRY",
        help="then push the operator and worker images to REGISTRY/kvtopo/<name>:<the chart's "
        "appVersion> (e.g. registry.example.com/team; buildah's own credentials, `buildah "
        "login`): the chart's image.repository is then REGISTRY/kvtopo/operator",
    )
    parser.add_argument(
        "--save",
        metavar="DIR",
        type=Path,
        help="then write the operator and worker images to DIR/<name>.tar (docker-archive, "
        "named as the chart and the examples name them): for `kind load image-archive`, "
        "`ctr -n k8s.io images import` on a node, or `docker load`",
    )
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        sys.stderr.write(f"[images] {line}\n")
        sys.stderr.flush()

    builder = ImageBuilder(progress=say)
    t0 = time.monotonic()
    try:
        images = builder.build_all()
    except ImageBuildError as error:
        say(f"error: {error}")
        return 1
    if args.prune:
        for ref in builder.prune(images):
            say(f"removed older {ref}")
    say(f"ready in {time.monotonic() - t0:.1f} s")
    published = published_names()
    out: dict[str, Any] = {"images": images.to_json(), "built_s": builder.timings}
    try:
        if args.push:
            out["pushed"] = {}
            for name, alias in published.items():
                target = f"{args.push.rstrip('/')}/kvtopo/{alias.rsplit('/', 1)[1]}"
                say(f"pushing {images.refs[name]} to {target}")
                builder.buildah("push", images.refs[name], f"docker://{target}")
                out["pushed"][name] = target
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            out["saved"] = {}
            for name, alias in published.items():
                archive = args.save / f"{name}.tar"
                archive.unlink(missing_ok=True)
                say(f"saving {images.refs[name]} as {alias} to {archive}")
                builder.buildah("push", images.refs[name], f"docker-archive:{archive}:{alias}")
                out["saved"][name] = str(archive)
    except ImageBuildError as error:
        say(f"error: {error}")
        return 1
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
