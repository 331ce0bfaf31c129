"""Archives as untrusted input: digests, and extraction that never writes outside its target.

An archive is checked against a pinned sha256 (`verify_sha256`) before anything reads it.
Extraction (`extract_tar`, `extract_zip`) writes only the regular files whose names match the
requested patterns, each under the destination. It refuses, with a DataError naming the archive
and the member, any member whose name is absolute, contains `..` or resolves outside the
destination, and any selected member that is a link (symbolic or hard) or a special file:
a text corpus needs none, and a link can point at a host file.
"""

import fnmatch
import hashlib
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from bov_jax.data.errors import DataError


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_sha256(path: Path, pinned: str) -> None:
    """Raises DataError naming `path` unless its sha256 is `pinned`."""
    actual = file_sha256(path)
    if actual != pinned:
        raise DataError(f"archive {path} has sha256 {actual}, but {pinned} is pinned for it")


def _selected(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _target(archive: str, name: str, dest: Path) -> Path:
    """Where member `name` would be written under `dest`; DataError if anywhere else."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise DataError(f"{archive}: refusing member {name!r}: absolute path or '..' in it")
    target = (dest / path).resolve()
    if not target.is_relative_to(dest.resolve()):
        raise DataError(f"{archive}: refusing member {name!r}: it resolves outside {dest}")
    return target


def _refuse_link(archive: str, name: str, kind: str, link_target: str) -> None:
    raise DataError(
        f"{archive}: refusing member {name!r}: a {kind} to {link_target!r} "
        "(links are never extracted; narrow the source's member patterns to regular files)"
    )


def extract_tar(
    tar: tarfile.TarFile, archive: str, dest: Path, patterns: tuple[str, ...] = ("*",)
) -> int:
    """Extracts the regular files of `tar` whose names (without './') match `patterns`.

    Works on streamed archives (mode 'r|'). Every member's name is checked, selected or not;
    extraction itself goes through tarfile's 'data' filter as a second line. Returns the number
    of files written. `archive` names the archive in errors.
    """
    count = 0
    for member in tar:
        name = member.name.removeprefix("./")
        _target(archive, name, dest)
        if member.isdir() or not _selected(name, patterns):
            continue
        if member.issym():
            _refuse_link(archive, name, "symbolic link", member.linkname)
        if member.islnk():
            _refuse_link(archive, name, "hard link", member.linkname)
        if not member.isfile():
            raise DataError(f"{archive}: refusing member {name!r}: not a regular file")
        try:
            tar.extract(member, dest, filter="data")
        except tarfile.FilterError as e:
            raise DataError(f"{archive}: refusing member {name!r}: {e}") from e
        count += 1
    return count


def extract_zip(
    zf: zipfile.ZipFile, archive: str, dest: Path, patterns: tuple[str, ...] = ("*",)
) -> int:
    """Extracts the regular files of `zf` whose names match `patterns`; returns their number.

    Every member's name is checked, selected or not; a member whose Unix mode marks a link or
    special file is refused.
    """
    count = 0
    for info in zf.infolist():
        _target(archive, info.filename, dest)
        if info.is_dir() or not _selected(info.filename, patterns):
            continue
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            _refuse_link(archive, info.filename, "symbolic link", zf.read(info).decode())
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):  # 0: no Unix mode recorded
            raise DataError(f"{archive}: refusing member {info.filename!r}: not a regular file")
        zf.extract(info, dest)
        count += 1
    return count
