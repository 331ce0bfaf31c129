"""Each bad input stops with a DataError naming the file (or key) and the problem."""

import errno
import os
import shutil
from pathlib import Path

import ml_collections
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bov_jax.data import pipeline
from bov_jax.data.config import default_data_config, validate_data_config
from bov_jax.data.packing import packing_stats
from bov_jax.data.testing import corpus_with_tokenizer
from bov_jax.errors import DataError

VOCAB, SEQ = 512, 64


@pytest.fixture(scope="module")
def good_corpus(tmp_path_factory):
    return corpus_with_tokenizer(
        tmp_path_factory.mktemp("good"), vocab_size=VOCAB, docs_per_shard=24
    )


@pytest.fixture
def corpus(good_corpus, tmp_path):
    """A fresh copy to break."""
    return shutil.copytree(good_corpus, tmp_path / "corpus")


def config(corpus, **overrides):
    c = default_data_config()
    c.data_dir = str(corpus)
    c.buffer_size = 16
    c.tokenizer_batch_size = 8
    for key, value in overrides.items():
        c[key] = value
    return c


def write_bad_utf8(path, column_type):
    texts = [b"fine text", b"caf\xe9 in Latin-1, not UTF-8", b"more fine text"]
    column = pa.array(texts, pa.binary())
    if column_type == "string":
        column = column.view(pa.string())  # as a sloppy writer would store it
    pq.write_table(pa.table({"text": column}), path)


def test_good_corpus_validates(corpus):
    validate_data_config(config(corpus, use_cache=False), VOCAB, SEQ)


def test_missing_data_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"data directory {missing} does not exist"):
        validate_data_config(config(missing), VOCAB, SEQ)
    with pytest.raises(DataError, match=f"data directory {missing} does not exist"):
        pipeline.make_batch_iterator(
            config(missing), split="train", seq_len=SEQ, batch_size=2, seed=0
        )


def test_too_few_shards(corpus):
    for path in sorted(corpus.glob("*.parquet"))[1:]:
        path.unlink()
    with pytest.raises(DataError, match="holds 1 parquet shard.*needs at least 2"):
        validate_data_config(config(corpus), VOCAB, SEQ)


def test_empty_shard(corpus):
    (corpus / "shard_00001.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"shard .*shard_00001.parquet is empty \(0 bytes\)"):
        validate_data_config(config(corpus), VOCAB, SEQ)


def test_shard_without_documents(corpus):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), corpus / "shard_00001.parquet")
    with pytest.raises(DataError, match=r"shard .*shard_00001.parquet holds no documents"):
        validate_data_config(config(corpus), VOCAB, SEQ)


def test_truncated_shard(corpus):
    path = corpus / "shard_00002.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        DataError, match=r"shard .*shard_00002.parquet is truncated or not a parquet file"
    ):
        validate_data_config(config(corpus), VOCAB, SEQ)
    with pytest.raises(DataError, match="shard_00002.parquet is truncated"):
        pipeline.make_batch_iterator(
            config(corpus), split="train", seq_len=SEQ, batch_size=2, seed=0
        )


def test_shard_without_text_column(corpus):
    pq.write_table(
        pa.table({"body": ["a", "b"], "source": ["x", "y"]}), corpus / "shard_00000.parquet"
    )
    with pytest.raises(
        DataError, match=r"shard_00000.parquet has no 'text' column \(columns: body, source\)"
    ):
        validate_data_config(config(corpus), VOCAB, SEQ)


@pytest.mark.parametrize("column_type", ["binary", "string"])
def test_non_utf8_document_stops_validation(corpus, column_type):
    write_bad_utf8(corpus / "shard_00001.parquet", column_type)
    message = r"shard_00001.parquet: row group 0, row 1: document is not valid UTF-8 text"
    with pytest.raises(DataError, match=message):
        validate_data_config(config(corpus, use_cache=False), VOCAB, SEQ)
    with pytest.raises(DataError, match=message):  # the cache build reads every document first
        pipeline.make_batch_iterator(
            config(corpus), split="train", seq_len=SEQ, batch_size=2, seed=0
        )


@pytest.mark.parametrize("use_cache", [True, False])
def test_non_utf8_document_skipped_counted_and_logged_on_request(corpus, use_cache, caplog):
    write_bad_utf8(corpus / "shard_00001.parquet", "binary")
    cfg = config(corpus, use_cache=use_cache, skip_bad_documents=True, shuffle=False)
    validate_data_config(cfg, VOCAB, SEQ)
    iterator = pipeline.make_batch_iterator(cfg, split="train", seq_len=SEQ, batch_size=2, seed=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"{corpus / 'shard_00001.parquet'}: skipped 1 bad document(s), null or "
        "not UTF-8 (data.skip_bad_documents=True)"
    ]
    for _ in range(30):  # the epoch passes over the bad shard at least once
        next(iterator)
    assert packing_stats(iterator).skipped_documents >= 1
    iterator.close()


def test_read_only_data_dir_without_cache_suggests_cache_dir(corpus, tmp_path, monkeypatch):
    shutil.rmtree(corpus / "token_cache", ignore_errors=True)
    corpus.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse as a read-only mount would
        mkdir = Path.mkdir

        def read_only_mkdir(path, *args, **kwargs):
            if path.is_relative_to(corpus):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return mkdir(path, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only_mkdir)
    kwargs = dict(split="train", seq_len=SEQ, batch_size=2, seed=0)
    try:
        message = (
            rf"cannot build the token cache in {corpus}/token_cache/\w+: Permission denied; "
            "set config key data.cache_dir to a writable directory"
        )
        with pytest.raises(DataError, match=message):
            pipeline.make_batch_iterator(config(corpus), **kwargs)
        cfg = config(corpus, cache_dir=str(tmp_path / "cache"))
        assert next(pipeline.make_batch_iterator(cfg, **kwargs))["inputs"].shape == (2, SEQ)
    finally:
        corpus.chmod(0o755)
    assert not (corpus / "token_cache").exists()


def test_tokenizer_vocab_mismatch(corpus):
    with pytest.raises(
        DataError,
        match=r"tokenizer .*tokenizer.model has vocab size 512 but config.model.vocab_size is 1024",
    ):
        validate_data_config(config(corpus), 1024, SEQ)


def test_missing_tokenizer(corpus):
    shutil.rmtree(corpus / "tokenizer")
    with pytest.raises(
        DataError,
        match=r"tokenizer .*tokenizer.model does not exist \(config key data.tokenizer_dir\)",
    ):
        validate_data_config(config(corpus), VOCAB, SEQ)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5])
def test_sequence_length_that_cannot_be_packed(corpus, seq_len):
    with pytest.raises(DataError, match=f"sequence length {seq_len!r} cannot be packed"):
        validate_data_config(config(corpus), VOCAB, seq_len)


def test_sequence_length_longer_than_a_split(corpus):
    pq.write_table(pa.table({"text": ["a tiny", "val split"]}), corpus / "shard_00003.parquet")
    validate_data_config(config(corpus), VOCAB, 12)
    with pytest.raises(
        DataError,
        match=r"sequence length 200 cannot be packed: .* split 'val' \(.*shard_00003.parquet\)",
    ):
        validate_data_config(config(corpus), VOCAB, 200)


def test_more_processes_than_units(corpus):
    with pytest.raises(
        DataError, match="split 'val' .* has 3 units of reading .* fewer than the 4 processes"
    ):
        pipeline.make_batch_iterator(
            config(corpus),
            split="val",
            seq_len=SEQ,
            batch_size=2,
            seed=0,
            process_index=0,
            process_count=4,
        )


def test_bad_config_keys(corpus):
    cfg = config(corpus, buffer_size=0)
    with pytest.raises(
        DataError, match="config key data.buffer_size must be an integer >= 1, got 0"
    ):
        validate_data_config(cfg, VOCAB, SEQ)
    cfg = config(corpus)
    del cfg["num_workers"]
    with pytest.raises(DataError, match="config key data.num_workers is missing"):
        validate_data_config(cfg, VOCAB, SEQ)
    cfg = ml_collections.ConfigDict({**config(corpus).to_dict(), "use_cache": "yes"})
    with pytest.raises(DataError, match="config key data.use_cache must be True or False"):
        validate_data_config(cfg, VOCAB, SEQ)
    cfg = config(corpus, max_doc_tokens=1)
    with pytest.raises(DataError, match="data.max_doc_tokens must be 0"):
        validate_data_config(cfg, VOCAB, SEQ)
