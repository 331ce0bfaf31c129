"""Loss by position: mean next-token loss at each position 0..T-1 over the val documents that
are longer than the context (each read from its first token, BOS included, uncut by
data.max_doc_tokens). Averaged over positions it is the plain val loss of the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from bov_jax.probes.model_fns import TokenFn


def long_documents(config: Any, tokenizer: Any, limit: int) -> Iterator[np.ndarray]:
    """The first seq_len + 1 tokens of the first `limit` val documents that have that many."""
    from bov_jax.data.documents import split_unit
    from bov_jax.data.pipeline import split_documents

    data_cfg = config.data.copy_and_resolve_references()
    data_cfg.max_doc_tokens = 0
    need, found = config.model.seq_len + 1, 0
    for element in split_documents(data_cfg, "val", tokenizer):
        for doc in split_unit(element):
            if len(doc) >= need and found < limit:
                found += 1
                yield np.asarray(doc[:need], np.int32)
        if found >= limit:
            return


def loss_by_position(fn: TokenFn, rows: np.ndarray, batch: int = 8) -> np.ndarray:
    """rows int32 (R, T + 1) -> float64 (R, T): each row's loss (nats) at each position."""
    out = []
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        nats, _ = fn(part[:, :-1], part[:, 1:])
        out.append(np.asarray(nats, np.float64))
    return np.concatenate(out)


def summary(losses: np.ndarray, bins: int = 16) -> dict[str, Any]:
    """{"mean": plain loss, "by_position": (T,), "bins": mean per equal slice of positions}."""
    curve = losses.mean(axis=0)
    edges = np.linspace(0, len(curve), bins + 1).astype(int)
    return {
        "documents": int(losses.shape[0]),
        "mean": float(losses.mean()),
        "by_position": curve.tolist(),
        "bins": [
            {"first": int(a), "last": int(b - 1), "loss": float(curve[a:b].mean())}
            for a, b in zip(edges[:-1], edges[1:], strict=True)
        ],
    }
