"""The grain pipeline: batches, determinism, process split, splits, checkpoints, workers."""

import shutil
import threading

import grain
import numpy as np
import orbax.checkpoint as ocp
import pyarrow.parquet as pq
import pytest

from bov_jax.data import pipeline, shards, token_cache
from bov_jax.data.config import default_data_config
from bov_jax.data.documents import split_unit
from bov_jax.data.packing import packing_stats
from bov_jax.data.testing import corpus_with_tokenizer
from bov_jax.data.tokenizer import load_tokenizer

SEQ, BATCH = 64, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_with_tokenizer(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def cfg(corpus, tmp_path):
    c = default_data_config()
    c.data_dir = str(corpus)
    c.cache_dir = str(tmp_path / "cache")
    c.buffer_size = 40
    c.tokenizer_batch_size = 8
    return c


def take(cfg, n, split="train", seed=0, process_index=0, process_count=1, state=None):
    iterator = pipeline.make_batch_iterator(
        cfg,
        split=split,
        seq_len=SEQ,
        batch_size=BATCH,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    if state is not None:
        iterator.set_state(state)
    batches = [next(iterator) for _ in range(n)]
    iterator.close()
    return batches


def same(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x["inputs"], y["inputs"]) and np.array_equal(x["targets"], y["targets"])
        for x, y in zip(a, b)
    )


def test_batches_are_shifted_int32_rows_starting_with_bos(cfg):
    bos = load_tokenizer(pipeline.tokenizer_path(cfg)).bos_id
    for batch in take(cfg, 5):
        assert set(batch) == {"inputs", "targets"}
        for x in batch.values():
            assert x.dtype == np.int32 and x.shape == (BATCH, SEQ)
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        assert (batch["inputs"][:, 0] == bos).all()


def test_cache_and_on_the_fly_encoding_give_the_same_stream(cfg):
    cached = take(cfg, 20)
    cfg.use_cache = False
    assert same(cached, take(cfg, 20))


def test_processes_starting_together_build_the_cache_once(cfg):
    """Two builders racing on an empty cache directory (a sweep's jobs starting at once): one
    builds, the other waits and reads the same cache."""
    tokenizer = load_tokenizer(pipeline.tokenizer_path(cfg))
    start = threading.Barrier(2)
    built, errors = [], []

    def build():
        start.wait()
        try:
            built.append(token_cache.ensure_cache(cfg, tokenizer))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(built) == 2 and built[0] == built[1]
    cached = take(cfg, 8)
    cfg.use_cache = False
    assert same(cached, take(cfg, 8))


def test_stream_is_a_function_of_seed_and_process(cfg):
    assert same(take(cfg, 8, seed=3), take(cfg, 8, seed=3))
    assert not same(take(cfg, 8, seed=3), take(cfg, 8, seed=4))
    assert not same(
        take(cfg, 8, process_index=0, process_count=2),
        take(cfg, 8, process_index=1, process_count=2),
    )


def documents_of_epoch(cfg, tokenizer, process_index, process_count):
    """Documents (as token tuples) a process reads in its share of the first epoch(s)."""
    units, reader = pipeline.unit_dataset(
        cfg,
        split="train",
        seed=5,
        process_index=process_index,
        process_count=process_count,
        tokenizer=tokenizer,
    )
    total = len(pipeline.split_units(cfg, "train", tokenizer)[0])
    share = range(process_index, total, process_count)  # positions of the first epoch
    return [tuple(d.tolist()) for i in range(len(share)) for d in split_unit(reader(units[i]))]


def test_processes_together_read_what_one_process_reads(cfg):
    tokenizer = load_tokenizer(pipeline.tokenizer_path(cfg))
    one = documents_of_epoch(cfg, tokenizer, 0, 1)
    for count in (2, 3):
        parts = [documents_of_epoch(cfg, tokenizer, p, count) for p in range(count)]
        merged = [d for part in parts for d in part]
        assert sorted(merged) == sorted(one)  # same documents, each exactly once
        assert len(set(merged)) == len(merged) == len(one)


def test_val_split_is_fixed_and_never_mixes_with_train(cfg):
    tokenizer = load_tokenizer(pipeline.tokenizer_path(cfg))
    val = take(cfg, 10, split="val", seed=1)
    assert same(val, take(cfg, 10, split="val", seed=2))  # the seed does not move val
    for split, batches in (("val", val), ("train", take(cfg, 10))):
        for row in np.concatenate([b["inputs"] for b in batches]):
            for segment in np.split(row, np.flatnonzero(row == tokenizer.bos_id)[1:]):
                marker = tokenizer.decode(segment.tolist()).split("-")[0]
                assert marker in (split, split[: len(marker)]), marker  # a crop may cut the marker


@pytest.mark.parametrize("use_cache", [True, False])
def test_restore_continues_the_exact_stream(cfg, use_cache):
    cfg.use_cache = use_cache
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=7
    )
    for _ in range(25):  # past the first epoch, so the buffer spans epochs
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(15)]
    stats = packing_stats(iterator)
    iterator.close()
    restored = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=7
    )
    restored.set_state(state)
    assert same(expected, [next(restored) for _ in range(15)])
    assert packing_stats(restored) == stats
    restored.close()


def test_a_state_saved_with_the_cache_continues_without_it(cfg):
    """data.use_cache changes how documents are read, not which: a run resumes across it
    (checkpoint.HARMLESS_PREFIXES)."""
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=5
    )
    for _ in range(7):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(10)]
    iterator.close()
    cfg.use_cache = False
    restored = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=5
    )
    restored.set_state(state)
    assert same(expected, [next(restored) for _ in range(10)])
    restored.close()


def test_orbax_checkpoint_of_the_iterator(cfg, tmp_path):
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=2
    )
    for _ in range(12):
        next(iterator)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(12, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
        manager.wait_until_finished()
        expected = [next(iterator) for _ in range(6)]
        fresh = pipeline.make_batch_iterator(
            cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=2
        )
        manager.restore(12, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    assert same(expected, [next(fresh) for _ in range(6)])
    iterator.close()
    fresh.close()


def test_worker_processes_keep_the_stream(cfg):
    expected = take(cfg, 12)
    cfg.num_workers = 2
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=0
    )
    got = [next(iterator) for _ in range(6)]
    state = iterator.get_state()
    got += [next(iterator) for _ in range(6)]
    iterator.close()
    assert same(expected, got)
    cfg.num_workers = 0
    assert same(expected[6:], take(cfg, 6, state=state))


def test_max_doc_tokens_splits_documents_and_crops_less(cfg):
    tokenizer = load_tokenizer(pipeline.tokenizer_path(cfg))
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=0
    )
    [next(iterator) for _ in range(30)]
    whole = packing_stats(iterator)
    iterator.close()
    cfg.max_doc_tokens = SEQ + 1
    units, reader = pipeline.split_units(cfg, "train", tokenizer)
    for unit in units:
        docs = split_unit(reader(unit))
        assert all(1 <= len(d) <= SEQ + 1 and d[0] == tokenizer.bos_id for d in docs)
    iterator = pipeline.make_batch_iterator(
        cfg, split="train", seq_len=SEQ, batch_size=BATCH, seed=0
    )
    [next(iterator) for _ in range(30)]
    assert packing_stats(iterator).crop_fraction < whole.crop_fraction
    iterator.close()


def test_same_size_shard_edit_rebuilds_the_cache(cfg, corpus, tmp_path):
    """The cache is named by the shards' content: an edit that keeps the file's size and row
    counts (one letter's case) builds a new cache, which holds the edited documents."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data, ignore=shutil.ignore_patterns("token_cache"))
    cfg.data_dir = str(data)
    tokenizer = load_tokenizer(pipeline.tokenizer_path(cfg))
    before = token_cache.ensure_cache(cfg, tokenizer)
    shard = data / "shard_00000.parquet"
    size, table = shard.stat().st_size, pq.read_table(shard)
    texts = table[shards.TEXT_COLUMN].to_pylist()
    for i in range(len(texts[0])):  # the first edit of one letter that keeps the size
        if texts[0][i].islower():
            edited = [texts[0][:i] + texts[0][i].upper() + texts[0][i + 1 :], *texts[1:]]
            shards.write_shard(shard, edited, table[shards.SOURCE_COLUMN].to_pylist(), 16)
            if shard.stat().st_size == size:
                break
    assert shard.stat().st_size == size and pq.read_table(shard).num_rows == len(texts)
    after = token_cache.ensure_cache(cfg, tokenizer)
    assert after != before
    cached = take(cfg, 20)
    cfg.use_cache = False
    assert same(cached, take(cfg, 20))
