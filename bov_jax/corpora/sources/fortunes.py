"""The `fortunes` quote files ('%'-separated), grouped into documents of ~target_bytes."""

from collections.abc import Iterator
from pathlib import Path

from bov_jax.corpora.sources.files import matching, read_text
from bov_jax.corpora.sources.text import group_entries

DIRECTORY = "usr/share/games/fortunes"


def extract(root: Path, target_bytes: int = 4096) -> Iterator[str]:
    """Quotes of every fortune file (not the `.dat` indexes), in file order."""
    for path in matching(root, (f"{DIRECTORY}/*",), ("*.dat", "*.u8")):
        quotes = (q.strip() for q in read_text(path).split("\n%\n"))
        yield from group_entries((q for q in quotes if q), target_bytes)
