"""The committed quickstart tokenizer, token_bytes, and tokenizer training/loading."""

import json
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest

from bov_jax.data import shards
from bov_jax.data.config import EMBEDDED_DIR
from bov_jax.data.testing import write_corpus
from bov_jax.data.tokenizer import (
    CONFIG_FILE,
    SPECIALS,
    _training_lines,
    load_tokenizer,
    train_tokenizer,
)
from bov_jax.errors import DataError

SAMPLES = [
    "Plain ASCII text.",
    "  leading and  double  spaces\tand tabs\n\nand blank lines\n",
    "café naïve Ünïcödé — “quotes” ‘single’",
    "中文字符 and 日本語",
    "emoji 🎉🚀 and 12345678",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def embedded():
    return load_tokenizer(EMBEDDED_DIR / "tokenizer", expected_vocab_size=8192, num_threads=2)


def test_committed_tokenizer_layout_and_record(embedded):
    assert embedded.vocab_size == 8192 and embedded.vocab_size % 64 == 0
    assert [embedded._sp.id_to_piece(i) for i in range(len(SPECIALS))] == list(SPECIALS)
    assert embedded.bos_id == 0
    record = json.loads((EMBEDDED_DIR / "tokenizer" / CONFIG_FILE).read_text())
    assert record["options"]["vocab_size"] == 8192 and record["options"]["byte_fallback"]
    assert record["train_files"] == [p.name for p in shards.split_files(EMBEDDED_DIR, "train")]


def test_token_bytes_sum_to_utf8_length_of_decoded_text(embedded):
    token_bytes = embedded.token_bytes()
    assert token_bytes.dtype == np.int32 and token_bytes.shape == (8192,)
    assert (token_bytes[: len(SPECIALS) + 1] == 0).all()  # specials and <unk>
    val = pq.read_table(shards.split_files(EMBEDDED_DIR, "val")[0]).column("text").to_pylist()
    texts = SAMPLES + val[:40]
    for text, ids in zip(texts, embedded.encode(texts)):
        decoded = embedded.decode(ids)
        assert decoded == text
        assert token_bytes[ids].sum() == len(decoded.encode("utf-8"))
        with_bos = [embedded.bos_id, *ids]
        assert token_bytes[with_bos].sum() == len(embedded.decode(with_bos).encode("utf-8"))


def test_batch_encoding_equals_single_and_ignores_special_strings(embedded):
    texts = SAMPLES + ["<|bos|> is text here, not a token"]
    assert embedded.encode(texts) == [embedded.encode_one(t) for t in texts]
    assert embedded.bos_id not in embedded.encode_one(texts[-1])


def test_tokenizer_pickles(embedded):
    clone = pickle.loads(pickle.dumps(embedded))
    assert clone.encode(SAMPLES) == embedded.encode(SAMPLES) and clone.sha256 == embedded.sha256


def test_train_tokenizer_on_train_shards_only(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs_per_shard=30)
    model = train_tokenizer(corpus, 384, tmp_path / "tok", num_threads=1)
    tokenizer = load_tokenizer(model.parent, expected_vocab_size=384)
    record = json.loads((tmp_path / "tok" / CONFIG_FILE).read_text())
    assert record["train_files"] == [
        "shard_00000.parquet",
        "shard_00001.parquet",
        "shard_00002.parquet",
    ]
    text = "café 中文 — the people"
    assert tokenizer.decode(tokenizer.encode_one(text)) == text
    with pytest.raises(DataError, match="multiple of 64"):
        train_tokenizer(corpus, 400, tmp_path / "tok2")


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=f"tokenizer {tmp_path}/tokenizer.model does not exist"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="tokenizer.model is not a SentencePiece model"):
        load_tokenizer(tmp_path)
    with pytest.raises(
        DataError, match=r"has vocab size 8192 but config.model.vocab_size is 32768"
    ):
        load_tokenizer(EMBEDDED_DIR / "tokenizer", expected_vocab_size=32768)


def test_training_lines_crop_documents_and_stop_at_the_character_budget(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs_per_shard=30)
    files = shards.split_files(corpus, "train")
    whole = list(_training_lines(files))
    cropped = list(_training_lines(files, doc_chars=40))
    # each document gives its marker line and at most 40 - len(marker) - 2 more characters
    assert len(cropped) < len(whole) and max(map(len, cropped)) <= 40
    budget = list(_training_lines(files, max_chars=5_000))
    assert 0 < len(budget) < len(whole) and budget == whole[: len(budget)]
    longest = max(len(t) for f in files for t in pq.read_table(f).column("text").to_pylist())
    # reading stops at the first document that starts past the budget
    assert 5_000 - longest < sum(map(len, budget)) <= 5_000 + longest
