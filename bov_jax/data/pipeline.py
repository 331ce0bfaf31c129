"""The grain input pipeline: shards -> units -> tokens -> best-fit packed rows -> batches.

    units of a split (documents.plan_units)
      -> shuffled per epoch with the seed (train only), repeated forever
      -> this process's share: positions process_index, process_index + process_count, ...
      -> read + tokenize (token cache or on-the-fly sentencepiece), in threads or worker processes
      -> BOS best-fit packing into rows of seq_len + 1 tokens (packing.py)
      -> batches {"inputs": int32 (B, T), "targets": int32 (B, T)}

The stream is a pure function of (data, tokenizer, seed, process_index, process_count): worker
processes and threads keep the order. Together the processes read every unit of an epoch once.
"""

from collections.abc import Iterator, Sequence
from pathlib import Path

import grain
import ml_collections
import numpy as np
from absl import flags

from bov_jax.data import mqar, shards, token_cache
from bov_jax.data.config import source, tokenizer_path
from bov_jax.data.documents import ParquetUnitReader, Unit, plan_units, split_unit
from bov_jax.data.packing import BestFitPackIterDataset
from bov_jax.data.tokenizer import Tokenizer, load_tokenizer
from bov_jax.errors import DataError

ReaderType = ParquetUnitReader | token_cache.CachedUnitReader


class _DocumentsAt:
    """Documents of the units at given stream positions (restoring a packing buffer).

    Reads each distinct unit once, however many epochs' positions refer to it.
    """

    def __init__(self, units: grain.MapDataset, reader: ReaderType):
        self._units = units
        self._reader = reader

    def __call__(self, positions: Sequence[int]) -> dict[int, list[np.ndarray]]:
        read: dict[Unit, list[np.ndarray]] = {}
        out = {}
        for position in positions:
            unit = self._units[position]
            if unit not in read:
                read[unit] = split_unit(self._reader(unit))
            out[position] = read[unit]
        return out


class _StreamFrom:
    """Iterates unit elements from a stream position on, reading in threads or processes."""

    def __init__(self, elements: grain.MapDataset, data_cfg: ml_collections.ConfigDict):
        self._elements = elements
        self._read_options = grain.ReadOptions(
            num_threads=data_cfg.read_threads, prefetch_buffer_size=data_cfg.prefetch_buffer_size
        )
        self._num_workers = data_cfg.num_workers

    def __call__(self, position: int) -> grain.DatasetIterator:
        stream = self._elements[position:].to_iter_dataset(self._read_options)
        if self._num_workers > 0:
            # grain's workers read absl flags, which must count as parsed (google/grain#1355)
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            stream = stream.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._num_workers))
        return iter(stream)


class _WithPosition:
    """Map-with-index function: reads a unit and records its position in the stream."""

    def __init__(self, reader: ReaderType):
        self._reader = reader

    def __call__(self, position: int, unit: Unit) -> dict:
        return {**self._reader(unit), "position": position}


def _reader(
    data_cfg: ml_collections.ConfigDict, split: str, tokenizer: Tokenizer, files: list[Path]
) -> ReaderType:
    if data_cfg.use_cache:
        cache = token_cache.ensure_cache(data_cfg, tokenizer)
        return token_cache.CachedUnitReader(cache, split, tokenizer.bos_id, data_cfg.max_doc_tokens)
    return ParquetUnitReader(files, tokenizer, data_cfg.skip_bad_documents, data_cfg.max_doc_tokens)


def split_units(
    data_cfg: ml_collections.ConfigDict, split: str, tokenizer: Tokenizer
) -> tuple[list[Unit], ReaderType]:
    """The units of a split, in order, and the reader that turns each into a unit element."""
    files = shards.split_files(Path(data_cfg.data_dir), split)
    units = plan_units([shards.check_shard(f) for f in files], data_cfg.tokenizer_batch_size)
    return units, _reader(data_cfg, split, tokenizer, files)


def unit_dataset(
    data_cfg: ml_collections.ConfigDict,
    *,
    split: str,
    seed: int,
    process_index: int,
    process_count: int,
    tokenizer: Tokenizer,
) -> tuple[grain.MapDataset, ReaderType]:
    """This process's infinite sequence of units, and the reader that turns a unit into tokens."""
    if not 0 <= process_index < process_count:
        raise DataError(f"process index {process_index} is not in [0, {process_count})")
    units, reader = split_units(data_cfg, split, tokenizer)
    if len(units) < process_count:
        raise DataError(
            f"split {split!r} of {data_cfg.data_dir} has {len(units)} units of reading (row-group "
            f"slices of <= data.tokenizer_batch_size documents), fewer than the {process_count} "
            "processes; use smaller row groups or fewer processes"
        )
    ds = grain.MapDataset.source(units)
    if split == "train" and data_cfg.shuffle:
        ds = ds.shuffle(seed)  # with repeat(), each epoch gets its own permutation
    return ds.repeat(None)[process_index::process_count], reader


def _inputs_targets(rows: np.ndarray) -> dict[str, np.ndarray]:
    """(B, T + 1) rows -> inputs rows[:, :-1] and targets rows[:, 1:], int32 (B, T) each."""
    return {
        "inputs": np.ascontiguousarray(rows[:, :-1], np.int32),
        "targets": np.ascontiguousarray(rows[:, 1:], np.int32),
    }


def make_batch_iterator(
    data_cfg: ml_collections.ConfigDict,
    *,
    split: str,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    tokenizer: Tokenizer | None = None,
) -> grain.DatasetIterator:
    """This process's batches: dicts of "inputs" and "targets", int32 (batch_size, seq_len).

    The iterator is infinite (the val split repeats too, always in the same order, so a fresh
    iterator reproduces the same val batches). `get_state`/`set_state` and grain's orbax
    handlers (grain.checkpoint.CheckpointSave/CheckpointRestore) checkpoint it exactly.
    Close it (`close()`) when data.num_workers > 0. With data.source="mqar" the batches are
    MQAR examples (targets -1 except at the answers).
    """
    if source(data_cfg) == "mqar":
        return mqar.batch_iterator(
            data_cfg.mqar,
            split=split,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )
    shards.list_shards(Path(data_cfg.data_dir))  # a missing data directory is reported first
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_path(data_cfg), num_threads=data_cfg.encode_threads)
    units, reader = unit_dataset(
        data_cfg,
        split=split,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        tokenizer=tokenizer,
    )
    elements = units.map_with_index(_WithPosition(reader))
    rows = BestFitPackIterDataset(
        _StreamFrom(elements, data_cfg),
        _DocumentsAt(units, reader),
        seq_len + 1,
        data_cfg.buffer_size,
    )
    return iter(rows.batch(batch_size, drop_remainder=True).map(_inputs_targets))


def split_documents(
    data_cfg: ml_collections.ConfigDict, split: str, tokenizer: Tokenizer
) -> Iterator[dict]:
    """Every unit element of a split once, in file order (no shuffle, no packing); for MQAR,
    the key-value contexts of the split's first data.mqar.val_examples examples."""
    if source(data_cfg) == "mqar":
        yield from mqar.split_contexts(data_cfg.mqar, split)
        return
    units, reader = split_units(data_cfg, split, tokenizer)
    for unit in units:
        yield reader(unit)


def val_batches(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, rows: int
) -> grain.DatasetIterator:
    """A run's val split as (rows, config.model.seq_len) batches, in the order every eval of
    that config reads them (one process; the seed is the run's)."""
    return make_batch_iterator(
        config.data,
        split="val",
        seq_len=config.model.seq_len,
        batch_size=rows,
        seed=config.seed,
        tokenizer=tokenizer,
    )
