"""Small synthetic corpora and tokenizers for tests (seconds to build, no network)."""

from pathlib import Path

import numpy as np

from bov_jax.data import shards
from bov_jax.data.tokenizer import train_tokenizer

_TEXT = """the of and to in a is that for it as was with be by on not he this are or his from at
which but have an they you were her she there been one all we their has would when if so no will
what can more about them said time these may only other into could new some very people café naïve
façade 中文 ünïcödé — “quoted” 42 1999 3.14"""
_WORDS = _TEXT.split()


def document(rng: np.random.Generator, marker: str, words: int) -> str:
    """A document that starts with `marker` and has `words` pseudo-English words in paragraphs."""
    picks = rng.choice(len(_WORDS), size=words)
    sentences, text = [], []
    for i, w in enumerate(picks):
        text.append(_WORDS[w])
        if i % 12 == 11:
            sentences.append(" ".join(text).capitalize() + ".")
            text = []
    sentences.append(" ".join(text) + ".")
    paragraphs = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)]
    return marker + "\n\n" + "\n\n".join(paragraphs)


def write_corpus(
    out_dir: Path,
    *,
    train_shards: int = 3,
    docs_per_shard: int = 60,
    row_group_size: int = 16,
    seed: int = 0,
    max_words: int = 400,
) -> Path:
    """Writes train shards and one val shard of documents "train-K ..." / "val-K ..." of 1 to
    `max_words` words; returns `out_dir`."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    k = 0
    for s in range(train_shards + 1):
        split = "val" if s == train_shards else "train"
        texts = []
        for _ in range(docs_per_shard):
            texts.append(document(rng, f"{split}-{k}", int(rng.integers(1, max_words))))
            k += 1
        shards.write_shard(
            out_dir / f"shard_{s:05d}.parquet", texts, [split] * len(texts), row_group_size
        )
    return out_dir


def corpus_with_tokenizer(out_dir: Path, vocab_size: int = 512, **corpus_kwargs) -> Path:
    """A synthetic corpus with a tokenizer trained on it in `out_dir/tokenizer`."""
    write_corpus(out_dir, **corpus_kwargs)
    train_tokenizer(out_dir, vocab_size, out_dir / "tokenizer", num_threads=1)
    return out_dir
