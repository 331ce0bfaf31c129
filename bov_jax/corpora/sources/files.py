"""Plain-text file trees (reST, POD, asciidoc, ...), one document per file; `.gz` is unpacked."""

import gzip
from collections.abc import Iterator
from pathlib import Path


def matching(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> list[Path]:
    """Sorted files under `root` matching any glob of `patterns` and no glob of `exclude`."""
    paths = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in paths if not any(p.match(e) for e in exclude))


def read_text(path: Path) -> str:
    """A file's text (gunzipped if `.gz`): UTF-8, or else Windows-1252 (older HTML and POD)."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def extract(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[str]:
    """One document per matching file."""
    for path in matching(root, patterns, exclude):
        yield read_text(path)
