"""Plain-text helpers shared by the extractors."""

from collections.abc import Iterable, Iterator


def unwrap_paragraphs(lines: Iterable[str]) -> str:
    """Joins hard-wrapped lines into paragraphs; blank lines separate paragraphs ("\\n\\n")."""
    paragraphs, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def group_entries(
    entries: Iterable[str], target_bytes: int, separator: str = "\n\n"
) -> Iterator[str]:
    """Concatenates entries (dictionary entries, quotes, paragraphs) into documents.

    A document closes before the entry that would take it past `target_bytes`; a single entry
    longer than that forms a document of its own.
    """
    group: list[str] = []
    size = 0
    for entry in entries:
        entry_bytes = len(entry.encode("utf-8")) + len(separator)
        if group and size + entry_bytes > target_bytes:
            yield separator.join(group)
            group, size = [], 0
        group.append(entry)
        size += entry_bytes
    if group:
        yield separator.join(group)


def split_document(text: str, max_bytes: int) -> list[str]:
    """Splits a document longer than `max_bytes` (UTF-8) at paragraph breaks into parts.

    A single paragraph longer than `max_bytes` stays whole: parts never cut inside a paragraph.
    """
    if len(text.encode("utf-8")) <= max_bytes:
        return [text]
    return list(group_entries(text.split("\n\n"), max_bytes))
