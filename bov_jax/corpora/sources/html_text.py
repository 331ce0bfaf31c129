"""HTML pages to plain text with the standard library's parser (documentation sites)."""

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

from bov_jax.corpora.sources.files import matching, read_text

_SKIP = {"script", "style", "head", "nav", "footer"}
_BLOCK = {
    "p",
    "div",
    "section",
    "article",
    "br",
    "li",
    "dt",
    "dd",
    "tr",
    "table",
    "blockquote",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "ul",
    "ol",
    "dl",
    "hr",
}


class _TextParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._current: list[str] = []
        self._skip_depth = 0
        self._pre_depth = 0

    def _close_block(self) -> None:
        text = "".join(self._current)
        text = text.strip("\n") if self._pre_depth else " ".join(text.split())
        if text.strip():
            self.blocks.append(text)
        self._current = []

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP:
            self._skip_depth += 1
        elif tag in _BLOCK:
            self._close_block()
            self._pre_depth += tag == "pre"

    def handle_endtag(self, tag):
        if tag in _SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in _BLOCK:
            self._close_block()
            self._pre_depth = max(0, self._pre_depth - (tag == "pre"))

    def handle_data(self, data):
        if not self._skip_depth:
            self._current.append(data)


def html_to_text(markup: str) -> str:
    """Visible text of a page: one paragraph per block element, <pre> kept verbatim."""
    parser = _TextParser()
    parser.feed(markup)
    parser.close()
    parser._close_block()
    return re.sub(r"\n{3,}", "\n\n", "\n\n".join(parser.blocks))


def extract(root: Path, patterns: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Iterator[str]:
    """One document per HTML file under `root` matching `patterns` (globs), minus `exclude`."""
    for path in matching(root, patterns, exclude):
        text = html_to_text(read_text(path))
        if text:
            yield text
