"""SWORD Bible and commentary modules (zText, zText4, zCom, zCom4), one document per chapter.

A module's `.conf` (under `usr/share/sword/mods.d/`) gives its data path and driver. For each
testament (`ot`, `nt`) the data path holds three files, `?` being `b` (book blocks) or `c`
(chapter blocks): `ot.?zs` lists the zlib blocks as (offset, size, uncompressed size) uint32
triples into `ot.?zz`; `ot.?zv` lists every entry (testament/book/chapter headers and verses) in
versification order as (block, offset, size) with a uint16 size for zText/zCom and a uint32 size
for the `4` drivers. Entries hold OSIS markup; a `<chapter osisID=...>` tag opens each chapter.
"""

import html
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

MODS_D = "usr/share/sword/mods.d"
_CHAPTER = re.compile(r'<chapter\b[^>]*\bosisID="([^"]+)"[^>]*\bsID=')
_NOTE = re.compile(r"<note\b.*?</note>", re.DOTALL)
_NOTE_BEFORE_WORD = re.compile(r"<note\b.*?</note>(?=<w\b)", re.DOTALL)
_BREAK = re.compile(r'<(?:lb|p|/p|title|/title)\b[^>]*>|<div\b[^>]*type="(?:x-p|paragraph)"[^>]*>')
_TAG = re.compile(r"<[^>]*>")


def _conf(path: Path) -> dict[str, str]:
    entries = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            entries.setdefault(key.strip(), value.strip())
    return entries


def osis_to_text(markup: str) -> str:
    """Strips OSIS markup: notes dropped, paragraphs and titles become blank-line breaks."""
    markup = _NOTE.sub("", _NOTE_BEFORE_WORD.sub(" ", markup))  # some notes hold the word gap
    text = _TAG.sub("", _BREAK.sub("\n\n", markup))
    paragraphs = (" ".join(p.split()) for p in html.unescape(text).split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)


def _entries(data_dir: Path, testament: str, wide: bool) -> Iterator[str]:
    """Yields the raw markup of every non-empty entry of one testament, in order.

    Commentaries link several verses to one entry (same block and offset); it is yielded once.

    `wide` (uint32 entry sizes) comes from the conf's driver name, which some modules get wrong:
    an index whose size is not a multiple of 12 bytes is read with uint16 sizes.
    """
    for letter in "bc":
        index = data_dir / f"{testament}.{letter}zv"
        if index.exists() and index.stat().st_size:
            break
    else:
        return
    blob = (data_dir / f"{testament}.{letter}zz").read_bytes()
    block_index = (data_dir / f"{testament}.{letter}zs").read_bytes()
    blocks = [b[:2] for b in struct.iter_unpack("<III", block_index)]
    entries = index.read_bytes()
    entry_format = "<III" if wide and len(entries) % 12 == 0 else "<IIH"
    cache: dict[int, bytes] = {}
    seen: set[tuple[int, int]] = set()
    for block, offset, size in struct.iter_unpack(entry_format, entries):
        if not size or (block, offset) in seen:
            continue
        seen.add((block, offset))
        if block not in cache:
            cache.clear()
            start, length = blocks[block]
            cache[block] = zlib.decompress(blob[start : start + length])
        yield cache[block][offset : offset + size].decode("utf-8", errors="replace")


def read_chapters(root: Path, module: str) -> Iterator[tuple[str, str]]:
    """Yields (osisID, plain text) per chapter of the module named `module` (its conf's stem)."""
    conf = _conf(root / MODS_D / f"{module}.conf")
    data_dir = root / "usr/share/sword" / conf["DataPath"].lstrip("./")
    wide = conf["ModDrv"].endswith("4")
    for testament in ("ot", "nt"):
        chapter_id, parts = None, []
        for markup in _entries(data_dir, testament, wide):
            match = _CHAPTER.search(markup)
            if match:
                if chapter_id and parts:
                    yield chapter_id, osis_to_text(" ".join(parts))
                chapter_id, parts = match.group(1), []
            parts.append(markup)
        if chapter_id and parts:
            yield chapter_id, osis_to_text(" ".join(parts))


def extract_module(root: Path, module: str) -> Iterator[str]:
    """Yields "<Book> <chapter>\\n\\n<text>" for every chapter with text."""
    for osis_id, text in read_chapters(root, module):
        if text:
            book, _, chapter = osis_id.partition(".")
            yield f"{book} {chapter}\n\n{text}"
