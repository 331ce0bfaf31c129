"""Jane Austen's six novels from Debian's `r-cran-janeaustenr`, one document per chapter."""

import re
from collections.abc import Iterator
from pathlib import Path

from bov_jax.corpora.sources.rdata import read_lazyload_db
from bov_jax.corpora.sources.text import unwrap_paragraphs

RDX = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"
_CHAPTER = re.compile(r"^(chapter|volume)\s+[0-9ivxlc]+\.?$", re.IGNORECASE)


def _chapters(lines: list[str]) -> Iterator[list[str]]:
    """Splits a novel's lines at chapter headings; front matter and volume headings are dropped."""
    chapter: list[str] | None = None
    for line in lines:
        if _CHAPTER.match(line.strip()):
            if chapter and any(s.strip() for s in chapter[1:]):
                yield chapter
            chapter = [line.strip()] if line.strip().lower().startswith("chapter") else None
        elif chapter is not None:
            chapter.append(line)
    if chapter and any(s.strip() for s in chapter[1:]):
        yield chapter


def extract(root: Path) -> Iterator[str]:
    """Yields "<Novel title>\\n\\n<Chapter heading>\\n\\n<paragraphs>" per chapter."""
    novels = read_lazyload_db(root / RDX)
    for name in sorted(novels):
        lines = [line or "" for line in novels[name]]
        title = next(line.strip() for line in lines if line.strip()).title()
        for chapter in _chapters(lines):
            yield f"{title}\n\n{chapter[0]}\n\n{unwrap_paragraphs(chapter[1:])}"
