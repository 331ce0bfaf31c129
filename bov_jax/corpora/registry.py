"""Fetch and unpack packages from the registries reachable offline-ish: Debian (apt) and npm.

Every package pins the sha256 of its archive. A download, and an archive already in the
download directory from an earlier run, is checked against the pin before anything reads it: a
cached archive that differs is deleted and fetched again, a fresh one that differs is deleted
and refused. Unpacking goes through `archives`, which writes only selected regular files under
the destination. Debian package names that change between releases (`linux-doc-6.1`,
`python3.11-doc`) are reached through their meta-package (`linux-doc`, `python3-doc`): its first
dependency; the pin then names the resolved package's archive.
"""

import json
import logging
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bov_jax.corpora.archives import extract_tar, extract_zip, file_sha256, verify_sha256
from bov_jax.errors import DataError

log = logging.getLogger(__name__)
_COMPLETE = ".complete"


@dataclass(frozen=True)
class Package:
    """A package to fetch. `registry` is 'deb' or 'npm'; npm names may pin '@version'.

    `sha256` is the pinned digest of the archive (for Debian: the SHA256 field of
    `apt-cache show NAME`, NAME resolved through the meta-package when `via_meta_package`).
    """

    registry: str
    name: str
    sha256: str
    via_meta_package: bool = False


@dataclass(frozen=True)
class Fetched:
    """A downloaded archive, verified against its pin, and what it is."""

    path: Path
    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class Registry:
    """How one registry's archives are found in, and downloaded into, a directory.

    `find(name, dir)` returns the archive of `name` already in `dir` (or None), `download(name,
    dir)` fetches it there and returns its path, `describe(path)` reads (name, version) from a
    verified archive.
    """

    find: Callable[[str, Path], Path | None]
    download: Callable[[str, Path], Path]
    describe: Callable[[Path], tuple[str, str]]


def _run(args: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise DataError(f"`{args[0]}` is not installed; it is needed to fetch packages") from e
    except subprocess.CalledProcessError as e:
        raise DataError(f"`{' '.join(args)}` failed: {e.stderr.strip()[-2000:]}") from e
    return done.stdout


def resolve_debian_name(package: Package) -> str:
    """The concrete Debian package name: the meta-package's first dependency if so declared."""
    if not package.via_meta_package:
        return package.name
    for line in _run(["apt-cache", "depends", package.name]).splitlines():
        kind, _, target = line.strip().partition(":")
        if kind == "Depends" and target.strip():
            return target.strip().strip("<>")
    raise DataError(f"Debian meta-package {package.name} has no dependency to resolve it to")


def _find_deb(name: str, download_dir: Path) -> Path | None:
    return max(download_dir.glob(f"{name}_*.deb"), default=None)


def _download_deb(name: str, download_dir: Path) -> Path:
    _run(["apt-get", "download", name], cwd=download_dir)
    path = _find_deb(name, download_dir)
    if path is None:
        raise DataError(f"apt-get download {name} produced no {name}_*.deb in {download_dir}")
    return path


def _describe_deb(path: Path) -> tuple[str, str]:
    fields = _run(["dpkg-deb", "--field", str(path), "Package", "Version"])
    values = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
    return values["Package"], values["Version"]


def _npm_stem(spec: str) -> tuple[str, str]:
    """(file stem, version or '') of an npm spec: '@scope/name@1.2' -> ('scope-name', '1.2')."""
    stem = spec.lstrip("@").replace("/", "-")
    name, _, version = stem.rpartition("@") if "@" in stem else (stem, "", "")
    return name, version


def _find_npm(spec: str, download_dir: Path) -> Path | None:
    name, version = _npm_stem(spec)
    return max(download_dir.glob(f"{name}-{version or '*'}.tgz"), default=None)


def _download_npm(spec: str, download_dir: Path) -> Path:
    out = _run(["npm", "pack", spec, "--json", "--pack-destination", str(download_dir)])
    return download_dir / json.loads(out)[0]["filename"]


def _describe_npm(path: Path) -> tuple[str, str]:
    with tarfile.open(path, "r:gz") as tar:
        manifest = json.load(tar.extractfile("package/package.json"))
    return manifest["name"], manifest["version"]


REGISTRIES: Mapping[str, Registry] = {
    "deb": Registry(_find_deb, _download_deb, _describe_deb),
    "npm": Registry(_find_npm, _download_npm, _describe_npm),
}


def fetch(
    package: Package, download_dir: Path, registries: Mapping[str, Registry] = REGISTRIES
) -> Fetched:
    """The archive of `package` in `download_dir`, downloaded unless a verified one is there.

    Raises DataError naming the archive when a fresh download does not match the pinned sha256.
    """
    if package.registry not in registries:
        raise DataError(f"unknown registry {package.registry!r} for package {package.name}")
    registry = registries[package.registry]
    download_dir.mkdir(parents=True, exist_ok=True)
    name = resolve_debian_name(package) if package.registry == "deb" else package.name
    path = registry.find(name, download_dir)
    if path is not None and file_sha256(path) != package.sha256:
        log.warning("%s does not match its pinned sha256; downloading it again", path)
        path.unlink()
        path = None
    if path is None:
        path = registry.download(name, download_dir)
        try:
            verify_sha256(path, package.sha256)
        except DataError:
            path.unlink()
            raise
    return Fetched(path, *registry.describe(path), package.sha256)


def _extract(fetched: Fetched, dest: Path, patterns: tuple[str, ...]) -> int:
    """Extracts the members of a verified archive matching `patterns`; returns their number."""
    archive = str(fetched.path)
    if fetched.path.suffix == ".deb":
        with subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", archive], stdout=subprocess.PIPE
        ) as proc:
            try:
                with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                    count = extract_tar(tar, archive, dest, patterns)
            except BaseException:
                proc.kill()  # a refused member: stop dpkg-deb rather than wait on its pipe
                raise
            if proc.wait() != 0:
                raise DataError(f"dpkg-deb could not read {archive} (truncated download?)")
        return count
    if fetched.path.suffix in (".zip", ".whl"):
        with zipfile.ZipFile(fetched.path) as zf:
            return extract_zip(zf, archive, dest, patterns)
    with tarfile.open(fetched.path) as tar:
        return extract_tar(tar, archive, dest, patterns)


def unpack(fetched: Fetched, dest: Path, patterns: tuple[str, ...] = ("*",)) -> Path:
    """Unpacks the files of an archive that match `patterns` into `dest`; returns `dest`.

    A tree unpacked earlier from the same archive (same sha256) is reused.
    """
    marker = dest / _COMPLETE
    if marker.exists() and marker.read_text().strip() == fetched.sha256:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    verify_sha256(fetched.path, fetched.sha256)
    if _extract(fetched, dest, patterns) == 0:
        raise DataError(f"{fetched.path} holds no file matching {patterns}")
    marker.write_text(fetched.sha256 + "\n")
    return dest
