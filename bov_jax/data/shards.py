"""Parquet shards in ClimbMix's layout: a `text` column (plus `source`), the last file is `val`.

A data directory holds `*.parquet` files at its top level. Sorted by name, every file but the last
is the train split and the last one is the validation split (spec 5.1). Everything here names the
offending file in its `DataError`.
"""

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bov_jax.errors import DataError
from bov_jax.files import atomic_file

log = logging.getLogger(__name__)

TEXT_COLUMN = "text"
SOURCE_COLUMN = "source"
SPLITS = ("train", "val")
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


@dataclass(frozen=True)
class ShardInfo:
    """A checked shard: its path, the documents in each row group, and an upper bound on its
    text bytes (the uncompressed size of the text column)."""

    path: Path
    row_group_rows: tuple[int, ...]
    text_bytes_bound: int

    @property
    def num_documents(self) -> int:
        return sum(self.row_group_rows)


def list_shards(data_dir: Path) -> list[Path]:
    """Returns the sorted parquet files of `data_dir`; at least two (train and val) must exist."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist (config key data.data_dir)")
    files = sorted(data_dir.glob("*.parquet"))
    if len(files) < 2:
        raise DataError(
            f"data directory {data_dir} holds {len(files)} parquet shard(s); it needs at least 2 "
            "(the last file is the validation split, the others the train split)"
        )
    return files


def split_files(data_dir: Path, split: str) -> list[Path]:
    """The files of `split` ('train': all but the last shard, 'val': the last shard)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    files = list_shards(data_dir)
    return files[:-1] if split == "train" else files[-1:]


def check_shard(path: Path) -> ShardInfo:
    """Reads a shard's footer and checks it: non-empty, readable, a text column, some rows."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard {path} does not exist")
    if path.stat().st_size == 0:
        raise DataError(f"shard {path} is empty (0 bytes)")
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"shard {path} is truncated or not a parquet file: {e}") from e
    schema = parquet.schema_arrow
    if TEXT_COLUMN not in schema.names:
        raise DataError(
            f"shard {path} has no {TEXT_COLUMN!r} column (columns: {', '.join(schema.names)})"
        )
    if schema.field(TEXT_COLUMN).type not in _TEXT_TYPES:
        raise DataError(
            f"shard {path}: column {TEXT_COLUMN!r} has type {schema.field(TEXT_COLUMN).type}, "
            "expected string or binary"
        )
    meta = parquet.metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    rows = tuple(g.num_rows for g in groups)
    if sum(rows) == 0:
        raise DataError(f"shard {path} holds no documents")
    column = schema.get_field_index(TEXT_COLUMN)
    return ShardInfo(path, rows, sum(g.column(column).total_uncompressed_size for g in groups))


def decode_documents(
    raw: Sequence[bytes | None], where: str, skip_bad: bool, first_row: int = 0
) -> tuple[list[str], int]:
    """Decodes raw documents as strict UTF-8. Returns (texts, number skipped).

    A null or undecodable document raises a DataError naming `where` and its row (counted from
    `first_row`), or is skipped and counted when `skip_bad`.
    """
    texts, skipped = [], 0
    for row, blob in enumerate(raw, start=first_row):
        try:
            if blob is None:
                raise ValueError("document is null")
            texts.append(blob.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            if not skip_bad:
                raise DataError(
                    f"{where}, row {row}: document is not valid UTF-8 text ({e}); set "
                    "data.skip_bad_documents=True to skip such documents"
                ) from e
            skipped += 1
    return texts, skipped


def report_skipped(path: Path, skipped: int) -> None:
    """Logs a warning naming shard `path` when `skipped` of its documents were skipped as bad."""
    if skipped:
        log.warning(
            "%s: skipped %d bad document(s), null or not UTF-8 (data.skip_bad_documents=True)",
            path,
            skipped,
        )


class DamagedShardError(DataError):
    """A shard whose footer reads but whose bytes do not decode (zeroed or overwritten pages,
    a failed decompression): names the file and row group. Exit status 1, as a damaged
    checkpoint: nothing is saved from that point."""

    exit_status = 1


def read_text_column(parquet: pq.ParquetFile, row_group: int, path: Path) -> pa.ChunkedArray:
    """The text column of one row group of shard `path`; DamagedShardError naming the file and
    the row group when its pages do not decode."""
    try:
        return parquet.read_row_group(row_group, columns=[TEXT_COLUMN]).column(0)
    except (OSError, pa.ArrowException) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DamagedShardError(
            f"shard {path}, row group {row_group}: cannot be read ({reason}); the file is "
            "damaged: replace it (bov_jax.prepare fetches damaged ClimbMix shards again)"
        ) from err


def read_raw(parquet: pq.ParquetFile, row_group: int, path: Path) -> list[bytes | None]:
    """The text column of one row group of shard `path` as raw bytes (no UTF-8 validation by
    Arrow); DamagedShardError when it does not decode."""
    column = read_text_column(parquet, row_group, path)
    binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
    return column.cast(binary).to_pylist()


def scan_documents(info: ShardInfo, skip_bad: bool) -> int:
    """Checks that every document of a shard is UTF-8 text; returns the number of bad ones."""
    parquet = pq.ParquetFile(info.path)
    bad = 0
    for rg in range(len(info.row_group_rows)):
        column = read_text_column(parquet, rg, info.path)
        try:  # fast path: Arrow validates UTF-8 when casting binary to string
            column.cast(pa.large_binary()).cast(pa.large_string())
            clean = column.null_count == 0
        except pa.ArrowInvalid:
            clean = False
        if not clean:
            where = f"{info.path}: row group {rg}"
            bad += decode_documents(read_raw(parquet, rg, info.path), where, skip_bad)[1]
    return bad


def write_shard(
    path: Path, texts: Sequence[str], sources: Sequence[str], row_group_size: int
) -> str:
    """Writes one zstd parquet shard atomically; returns its sha256."""
    table = pa.table(
        {TEXT_COLUMN: pa.array(texts, pa.string()), SOURCE_COLUMN: pa.array(sources, pa.string())}
    )
    with atomic_file(path) as out:
        pq.write_table(
            table,
            out,
            row_group_size=row_group_size,
            compression="zstd",
            compression_level=3,
            use_dictionary=[SOURCE_COLUMN],
            write_statistics=False,
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()
