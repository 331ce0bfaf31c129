"""Files written whole or not at all, and the check that a directory takes new files.

Every file this project writes for a user to keep (config.json, status.json, eval results,
reports, figures, exported checkpoints, data shards) goes through `atomic_file`: readers see
the old file or the new one, never a part, and a failed write leaves the old one untouched.
A directory made in one go (an imported workdir) goes through `atomic_directory`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def current_umask() -> int:
    """The process umask (read by setting it: call it before other threads create files)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~current_umask()  # what open() gives a new file, read once at import
DIR_MODE = 0o777 & ~current_umask()  # what mkdir() gives a new directory


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Yields a temporary file beside `path`, opened with `mode` ("wb" or "w").

    On a clean exit the file gets the mode a plain open() would give it (0o666 minus the
    umask, not tempfile's 0o600) and replaces `path` in one rename; on an exception it is
    removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = tempfile.NamedTemporaryFile(
        mode, dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
    )
    try:
        with tmp:
            yield tmp
        os.chmod(tmp.name, FILE_MODE)
        os.replace(tmp.name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp.name)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary directory beside `path` to fill; on a clean exit it becomes `path`
    in one rename (`path` must not exist, or be empty), on an exception it is removed, so a
    failure leaves nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, DIR_MODE)
        if path.is_dir():
            path.rmdir()  # empty (OSError otherwise): a directory made ahead for us
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` in one rename."""
    with atomic_file(path, "w") as out:
        out.write(text)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Replace `path` with `payload` as indented JSON in one rename."""
    write_text_atomic(path, json.dumps(payload, indent=2))


def check_writable(directory: Path) -> None:
    """Create `directory` (and its parents) and write and remove a file there.

    Raises OSError (read-only mount, permissions, full disk) for the caller to word.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass
