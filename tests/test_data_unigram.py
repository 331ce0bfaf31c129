"""The unigram BPB reference line, recomputed directly from the shards."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from bov_jax.data import shards
from bov_jax.data.config import default_data_config
from bov_jax.data.testing import corpus_with_tokenizer
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.data.unigram import unigram_bpb


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_with_tokenizer(tmp_path_factory.mktemp("unigram"), docs_per_shard=30)


def direct_bpb(corpus, tokenizer):
    """Counts over every document's ids; add-one smoothing over ids that carry bytes."""
    token_bytes = tokenizer.token_bytes()
    counts = {}
    for split in ("train", "val"):
        ids = [
            i
            for path in shards.split_files(corpus, split)
            for text in pq.read_table(path).column("text").to_pylist()
            for i in tokenizer.encode_one(text)
        ]
        counts[split] = np.bincount(ids, minlength=tokenizer.vocab_size)
    scored = token_bytes > 0
    total = counts["train"][scored].sum() + scored.sum()
    bits = sum(
        -n * np.log2((counts["train"][i] + 1) / total)
        for i, n in enumerate(counts["val"])
        if scored[i] and n
    )
    return bits / (counts["val"] * token_bytes).sum()


@pytest.mark.parametrize("use_cache", [True, False])
def test_unigram_bpb_matches_a_direct_computation(corpus, tmp_path, use_cache):
    cfg = default_data_config()
    cfg.data_dir = str(corpus)
    cfg.cache_dir = str(tmp_path)
    cfg.use_cache = use_cache
    tokenizer = load_tokenizer(corpus / "tokenizer")
    assert unigram_bpb(cfg, tokenizer) == pytest.approx(direct_bpb(corpus, tokenizer), rel=1e-9)
