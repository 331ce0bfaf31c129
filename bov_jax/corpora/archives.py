"""Archives as untrusted input: digests, and extraction that never writes outside its target.

An archive is checked against a pinned sha256 (`verify_sha256`) before anything reads it.
Extraction (`extract_tar`, `extract_zip`) writes only regular files whose names match the
requested patterns, each under the destination, and never creates a link:

* a member whose name is absolute, contains `..` or resolves outside the destination stops the
  extraction with a DataError naming the archive and the member, selected or not;
* a hard link whose target is absolute, contains `..` or resolves outside the destination stops
  it too; one to a file extracted before is written as a copy of that file;
* a selected symbolic link is skipped with a warning naming it (Debian's documentation packages
  link their javascript to other packages' absolute paths), as is a hard link to a member that
  was not extracted;
* a selected special file (device, fifo) stops the extraction.
"""

import fnmatch
import hashlib
import logging
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from bov_jax.errors import DataError

log = logging.getLogger(__name__)


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


def _inside(dest: Path, name: str) -> Path | None:
    """`dest / name` resolved; None if `name` is absolute, has '..' or resolves outside `dest`."""
    path = PurePosixPath(name.removeprefix("./"))
    if path.is_absolute() or ".." in path.parts:
        return None
    target = (dest / path).resolve()
    return target if target.is_relative_to(dest.resolve()) else None


def _target(archive: str, name: str, dest: Path) -> Path:
    """Where member `name` is written under `dest`; DataError if it would land elsewhere."""
    target = _inside(dest, name)
    if target is None:
        raise DataError(
            f"{archive}: refusing member {name!r}: an absolute path, '..' or a path outside {dest}"
        )
    return target


def _skip_link(archive: str, name: str, kind: str, link_target: str) -> None:
    log.warning("%s: skipping member %r, a %s to %r", archive, name, kind, link_target)


def _copy_hard_link(archive: str, member: tarfile.TarInfo, target: Path, dest: Path) -> int:
    """Writes a hard link member as a copy of its (extracted) target; returns files written."""
    source = _inside(dest, member.linkname)
    if source is None:
        raise DataError(
            f"{archive}: refusing member {member.name!r}: a hard link to {member.linkname!r}, "
            f"outside {dest}"
        )
    if not source.is_file():
        _skip_link(archive, member.name, "hard link to a member not extracted", member.linkname)
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return 1


def extract_tar(
    tar: tarfile.TarFile, archive: str, dest: Path, patterns: tuple[str, ...] = ("*",)
) -> int:
    """Extracts the regular files of `tar` whose names (without './') match `patterns`.

    Works on streamed archives (mode 'r|'); regular files go through tarfile's 'data' filter.
    Returns the number of files written. `archive` names the archive in errors.
    """
    count = 0
    for member in tar:
        name = member.name.removeprefix("./")
        target = _target(archive, member.name, dest)
        if member.isdir() or not _selected(name, patterns):
            continue
        if member.issym():
            _skip_link(archive, member.name, "symbolic link", member.linkname)
        elif member.islnk():
            count += _copy_hard_link(archive, member, target, dest)
        elif not member.isfile():
            raise DataError(f"{archive}: refusing member {member.name!r}: not a regular file")
        else:
            try:
                tar.extract(member, dest, filter="data")
            except tarfile.FilterError as e:
                raise DataError(f"{archive}: refusing member {member.name!r}: {e}") from e
            count += 1
    return count


def extract_zip(
    zf: zipfile.ZipFile, archive: str, dest: Path, patterns: tuple[str, ...] = ("*",)
) -> int:
    """Extracts the regular files of `zf` whose names match `patterns`; returns their number.

    A member whose Unix mode marks a symbolic link is skipped, a special file refused.
    """
    count = 0
    for info in zf.infolist():
        _target(archive, info.filename, dest)
        if info.is_dir() or not _selected(info.filename, patterns):
            continue
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            _skip_link(archive, info.filename, "symbolic link", zf.read(info).decode())
        elif kind not in (0, stat.S_IFREG):  # 0: no Unix mode recorded
            raise DataError(f"{archive}: refusing member {info.filename!r}: not a regular file")
        else:
            zf.extract(info, dest)
            count += 1
    return count
