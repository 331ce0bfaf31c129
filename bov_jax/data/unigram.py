"""The unigram reference line: bits per byte of a unigram model on the val split."""

import ml_collections
import numpy as np

from bov_jax.data.pipeline import split_documents
from bov_jax.data.tokenizer import Tokenizer


def token_counts(
    data_cfg: ml_collections.ConfigDict, split: str, tokenizer: Tokenizer, max_tokens: int = 0
) -> np.ndarray:
    """int64 (vocab_size,): how often each id occurs in the split's documents (BOS included).

    With `max_tokens` > 0, counting stops after the first unit that reaches that many tokens.
    """
    counts = np.zeros(tokenizer.vocab_size, np.int64)
    for element in split_documents(data_cfg, split, tokenizer):
        counts += np.bincount(element["tokens"], minlength=tokenizer.vocab_size)
        if 0 < max_tokens <= counts.sum():
            break
    return counts


def unigram_bpb(
    data_cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, *, max_train_tokens: int = 50_000_000
) -> float:
    """Bits per byte on the val split of an add-one-smoothed unigram fit on the train split.

    The fit reads the train split in file order up to `max_train_tokens` (all of the embedded
    corpus and debmix; unigram frequencies have long converged by then on ClimbMix). Only ids
    that stand for text (token_bytes > 0) are modelled and scored, as in the BPB evaluation
    (spec 6.3): BOS and other specials count neither nats nor bytes.
    """
    token_bytes = tokenizer.token_bytes()
    scored = token_bytes > 0
    train_counts = token_counts(data_cfg, "train", tokenizer, max_train_tokens)
    train = np.where(scored, train_counts, 0)
    val = np.where(scored, token_counts(data_cfg, "val", tokenizer), 0)
    log2_p = np.log2((train[scored] + 1) / (train.sum() + scored.sum()))
    return float(-(val[scored] * log2_p).sum() / (val * token_bytes).sum())
