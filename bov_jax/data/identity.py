"""The identity of a run's data by content, not by path.

A checkpoint records the fingerprint of every shard and tokenizer file it was trained on:
the file's name, its size and a sha256 (of the whole file up to WHOLE_FILE_LIMIT bytes,
else of the parquet footer, which holds every row group's offsets, sizes and row counts).
A resumed run compares the fingerprints, so the same data under another directory resumes
and data edited or swapped in place is refused, naming the files.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import ml_collections

from bov_jax.data import shards
from bov_jax.data.config import tokenizer_path

WHOLE_FILE_LIMIT = 8 << 20  # larger shards: the footer only, so a resume hashes little
PARQUET_TAIL = 8  # footer length (little-endian uint32) + b"PAR1"


def content_digest(path: Path) -> str:
    """sha256 of a small file, or 'footer:' + sha256 of a large parquet file's footer."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_LIMIT:
            return hashlib.file_digest(f, "sha256").hexdigest()
        f.seek(size - PARQUET_TAIL)
        (footer_len,) = struct.unpack("<I", f.read(4))
        f.seek(max(0, size - PARQUET_TAIL - footer_len))
        return "footer:" + hashlib.sha256(f.read()).hexdigest()


def data_fingerprint(data_cfg: ml_collections.ConfigDict) -> dict[str, dict[str, object]]:
    """{'shard_00000.parquet': {'bytes': n, 'sha256': hex}, ..., 'tokenizer/<file>': ...}:
    the shards of every split and the tokenizer files, by name relative to their directory."""
    files = {
        p.name: p for split in shards.SPLITS for p in shards.split_files(data_cfg.data_dir, split)
    }
    tokenizer = tokenizer_path(data_cfg)
    files.update({f"tokenizer/{p.name}": p for p in sorted(tokenizer.iterdir()) if p.is_file()})
    return {
        name: {"bytes": path.stat().st_size, "sha256": content_digest(path)}
        for name, path in sorted(files.items())
    }


def changed_files(saved: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """'name: what changed' for every file added, removed or with other content."""
    changes = []
    for name in sorted(set(saved) | set(current)):
        before, now = saved.get(name), current.get(name)
        if before == now:
            continue
        if before is None:
            changes.append(f"{name}: not in the checkpoint's data (new file)")
        elif now is None:
            changes.append(f"{name}: missing now")
        elif before["bytes"] != now["bytes"]:
            changes.append(f"{name}: {before['bytes']} bytes then, {now['bytes']} now")
        else:
            changes.append(f"{name}: same size, other content (sha256 differs)")
    return changes
