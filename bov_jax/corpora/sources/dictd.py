"""dictd dictionaries (`X.index` + `X.dict.dz`), e.g. GCIDE, FOLDOC, Jargon, Devil's Dictionary.

The index has one line per headword: word, offset and length (both in dictd's base64 digits),
tab-separated. Several headwords may share one entry. `.dict.dz` is gzip-compatible (dictzip).
Entries are concatenated, in file order, into documents of about `target_bytes`.
"""

import gzip
from collections.abc import Iterator
from pathlib import Path

from bov_jax.corpora.sources.text import group_entries

_DIGITS = {
    c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
}


def _number(text: str) -> int:
    value = 0
    for c in text:
        value = value * 64 + _DIGITS[c]
    return value


def read_entries(index_path: Path) -> Iterator[str]:
    """Yields each distinct entry of the dictionary in file order (metadata entries skipped)."""
    spans = set()
    for line in index_path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-database"):
            spans.add((_number(parts[1]), _number(parts[2])))
    data = gzip.decompress(index_path.with_suffix(".dict.dz").read_bytes())
    for offset, length in sorted(spans):
        entry = data[offset : offset + length].decode("utf-8", errors="replace").strip()
        if entry:
            yield entry


def extract(root: Path, name: str, target_bytes: int = 8192) -> Iterator[str]:
    """Documents of ~target_bytes of consecutive entries of `usr/share/dictd/<name>.index`."""
    yield from group_entries(read_entries(root / "usr/share/dictd" / f"{name}.index"), target_bytes)
