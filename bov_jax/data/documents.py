"""Units of work (slices of parquet row groups) and the readers that turn them into tokens.

A unit is at most `tokenizer_batch_size` consecutive documents of one row group (spec 5.2). The
units of a split, in file/row-group order, are what the pipeline shuffles and divides among
processes. A reader maps a unit to its tokenized documents, each prefixed with BOS:

    {"tokens": int32 (sum of lengths,), "lengths": int32 (num documents,), "skipped": int}

`ParquetUnitReader` reads and encodes on the fly; `token_cache.CachedUnitReader` reads the same
documents pre-tokenized. Both give identical output for the same unit.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bov_jax.data import shards
from bov_jax.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Unit:
    """Documents [start, stop) of row group `row_group` of the split's file `file_index`.

    `first_document` is the index of the unit's first document within the whole split.
    """

    file_index: int
    row_group: int
    start: int
    stop: int
    first_document: int


def plan_units(infos: Sequence[shards.ShardInfo], batch_size: int) -> list[Unit]:
    """All units of a split, in file, row-group and row order."""
    units, first = [], 0
    for f, info in enumerate(infos):
        for rg, rows in enumerate(info.row_group_rows):
            for start in range(0, rows, batch_size):
                stop = min(rows, start + batch_size)
                units.append(Unit(f, rg, start, stop, first + start))
            first += rows
    return units


def finish_documents(
    docs: Sequence[np.ndarray], skipped: int, bos_id: int, max_doc_tokens: int
) -> dict:
    """Prefixes each document with BOS and packs them into a unit element (see module doc).

    With `max_doc_tokens` > 0, a document longer than that (BOS included) becomes several
    documents of at most `max_doc_tokens` tokens, each starting with BOS.
    """
    pieces = []
    for doc in docs:
        step = max_doc_tokens - 1 if max_doc_tokens > 0 else max(len(doc), 1)
        for start in range(0, max(len(doc), 1), step):
            pieces.append(np.concatenate([[bos_id], doc[start : start + step]]).astype(np.int32))
    lengths = np.array([len(p) for p in pieces], np.int32)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return {"tokens": tokens, "lengths": lengths, "skipped": skipped}


class ParquetUnitReader:
    """Reads a unit's documents from parquet and encodes them with sentencepiece."""

    def __init__(
        self, paths: Sequence[Path], tokenizer: Tokenizer, skip_bad: bool, max_doc_tokens: int
    ):
        self._paths = [Path(p) for p in paths]
        self._tokenizer = tokenizer
        self._skip_bad = skip_bad
        self._max_doc_tokens = max_doc_tokens
        self._local = threading.local()  # open files, per reading thread

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local())

    def _file(self, index: int) -> pq.ParquetFile:
        files = self._local.__dict__.setdefault("files", {})
        if index not in files:
            files[index] = pq.ParquetFile(self._paths[index])
        return files[index]

    def documents(self, unit: Unit) -> tuple[list[str], int]:
        """The unit's texts and how many bad documents were skipped."""
        path = self._paths[unit.file_index]
        raw = shards.read_raw(self._file(unit.file_index), unit.row_group, path)
        raw = raw[unit.start : unit.stop]
        where = f"{path}: row group {unit.row_group}"
        return shards.decode_documents(raw, where, self._skip_bad, first_row=unit.start)

    def __call__(self, unit: Unit) -> dict:
        texts, skipped = self.documents(unit)
        docs = [np.asarray(ids, np.int32) for ids in self._tokenizer.encode(texts)]
        return finish_documents(docs, skipped, self._tokenizer.bos_id, self._max_doc_tokens)


def split_unit(element: dict) -> list[np.ndarray]:
    """The documents of a unit element, as int32 views into its token array."""
    lengths = element["lengths"]
    if len(lengths) == 0:
        return []
    return np.split(element["tokens"], np.cumsum(lengths)[:-1])
