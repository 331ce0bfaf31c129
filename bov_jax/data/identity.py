"""The identity of a run's data by content, not by path.

A checkpoint records the fingerprint of every shard and tokenizer file it was trained on: the
file's name, its size and the sha256 of its whole content. A resumed run compares the
fingerprints, so the same data under another directory resumes and data edited or swapped in
place is refused, naming the files; the token cache is named by the same digests.

Hashing a 250 MB ClimbMix shard takes about a second (docs/reliability.md), so digests are
cached by (path, size, mtime, ctime, inode) in DIGEST_CACHE: a resume rehashes only files that
were written since. The ctime counts because a user can set a file's mtime back (`touch -d`, `cp
-p`, `rsync -t`) but not its ctime: an in-place edit whose mtime was reset is hashed again.
Checkpoints of older versions identified files over 8 MiB by their parquet footer
('footer:<sha256>'); those are compared by footer, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path

import ml_collections

from bov_jax.data import shards
from bov_jax.data.config import tokenizer_path
from bov_jax.files import write_json_atomic

log = logging.getLogger("bov_jax")

DIGEST_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bov_jax" / "digests.json"
)
SETTLED_SECONDS = 2.0  # a file younger than this is hashed but its digest not cached
PARQUET_TAIL = 8  # footer length (little-endian uint32) + b"PAR1"
LEGACY_FOOTER = "footer:"


def file_key(path: Path) -> str:
    """What a cached digest is valid for: the file's path, size, mtime, ctime and inode."""
    st = path.stat()
    return f"{path.absolute()} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def read_cache(cache: Path) -> dict[str, str]:
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def content_digests(paths: list[Path], cache: Path | None = None) -> dict[Path, str]:
    """{path: sha256 of its whole content}; digests of unchanged files come from the cache,
    which is rewritten (entries of files gone or changed dropped) when something was hashed.
    An unwritable cache only costs the rehash next time."""
    cache = DIGEST_CACHE if cache is None else cache
    known = read_cache(cache)
    keys = {path: file_key(path) for path in paths}
    digests, hashed = {}, False
    for path, key in keys.items():
        if key in known:
            digests[path] = known[key]
            continue
        with open(path, "rb") as f:
            digests[path] = hashlib.file_digest(f, "sha256").hexdigest()
        # A file written within the last seconds could be written again within the same
        # mtime tick (coarse on most file systems) without its key changing: not cached yet.
        if time.time() - path.stat().st_mtime > SETTLED_SECONDS:
            known[key], hashed = digests[path], True
    if hashed:
        current = {key for key in known if still_current(key)}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cache, {key: known[key] for key in sorted(current)})
        except OSError as err:
            log.debug("digest cache %s not written: %s", cache, err)
    return digests


def still_current(key: str) -> bool:
    """Whether a cache key still describes its file (same size, mtime, ctime and inode)."""
    path = Path(key.rsplit(" ", 4)[0])
    try:
        return file_key(path) == key
    except OSError:
        return False


def footer_digest(path: Path) -> str:
    """'footer:' + sha256 of a parquet file's footer (how older checkpoints named shards over
    8 MiB)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(size - PARQUET_TAIL)
        (footer_len,) = struct.unpack("<I", f.read(4))
        f.seek(max(0, size - PARQUET_TAIL - footer_len))
        return LEGACY_FOOTER + hashlib.sha256(f.read()).hexdigest()


def data_files(data_cfg: ml_collections.ConfigDict) -> dict[str, Path]:
    """{'shard_00000.parquet': path, ..., 'tokenizer/<file>': path}: the shards of every split
    and the tokenizer files, by name relative to their directory."""
    files = {
        p.name: p for split in shards.SPLITS for p in shards.split_files(data_cfg.data_dir, split)
    }
    tokenizer = tokenizer_path(data_cfg)
    files.update({f"tokenizer/{p.name}": p for p in sorted(tokenizer.iterdir()) if p.is_file()})
    return dict(sorted(files.items()))


def data_fingerprint(data_cfg: ml_collections.ConfigDict) -> dict[str, dict[str, object]]:
    """{'shard_00000.parquet': {'bytes': n, 'sha256': hex}, ..., 'tokenizer/<file>': ...}."""
    files = data_files(data_cfg)
    digests = content_digests(list(files.values()))
    return {
        name: {"bytes": path.stat().st_size, "sha256": digests[path]}
        for name, path in files.items()
    }


def as_recorded(
    saved: dict[str, dict], current: dict[str, dict], files: dict[str, Path]
) -> dict[str, dict]:
    """`current` with the files `saved` names by footer (an older checkpoint) named the same
    way, so that they compare."""
    legacy = [
        name
        for name, entry in saved.items()
        if str(entry.get("sha256", "")).startswith(LEGACY_FOOTER) and name in files
    ]
    if not legacy:
        return current
    log.warning(
        "the checkpoint names %d large shard(s) by their parquet footer only (an older "
        "version): those are compared by footer",
        len(legacy),
    )
    return {**current, **{n: {**current[n], "sha256": footer_digest(files[n])} for n in legacy}}


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
