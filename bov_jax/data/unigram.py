"""The unigram reference line: bits per byte of a unigram model on the val split."""

import ml_collections
import numpy as np

from bov_jax.data.pipeline import split_documents
from bov_jax.data.tokenizer import Tokenizer


def token_counts(data_cfg: ml_collections.ConfigDict, split: str, tokenizer: Tokenizer) -> np.ndarray:
    """int64 (vocab_size,): how often each id occurs in the split's documents (BOS included)."""
    counts = np.zeros(tokenizer.vocab_size, np.int64)
    for element in split_documents(data_cfg, split, tokenizer):
        counts += np.bincount(element["tokens"], minlength=tokenizer.vocab_size)
    return counts


def unigram_bpb(data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> float:
    """Bits per byte on the val split of an add-one-smoothed unigram fit on the train split.

    Only ids that stand for text (token_bytes > 0) are modelled and scored, as in the BPB
    evaluation (spec 6.3): BOS and other specials count neither nats nor bytes.
    """
    token_bytes = tokenizer.token_bytes()
    scored = token_bytes > 0
    train = np.where(scored, token_counts(data_cfg, "train", tokenizer), 0)
    val = np.where(scored, token_counts(data_cfg, "val", tokenizer), 0)
    log2_p = np.log2((train[scored] + 1) / (train.sum() + scored.sum()))
    return float(-(val[scored] * log2_p).sum() / (val * token_bytes).sum())
