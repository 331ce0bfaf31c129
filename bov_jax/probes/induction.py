"""Induction: a random span of `span` tokens, then filler, then the span again starting
`distance` positions after the first copy. Scored on the repeat: each of its tokens after the
first is predictable only by copying from the first copy. Per-token accuracy and loss, by
span length and distance.

    BOS a_1 .. a_L  f .. f  a_1 a_2 .. a_L        (second a_1 at position 1 + distance)
                               ^   ^ scored: predict a_2 .. a_L
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bov_jax.probes.model_fns import TokenFn


def induction_batch(
    rng: np.random.Generator, ids: np.ndarray, bos: int, span: int, distance: int, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 (rows, distance + span); targets -1 except the span - 1
    positions of the repeat whose next token is the span's next token. `ids`: the ids the
    spans and filler are drawn from."""
    if not 1 < span <= distance:
        raise ValueError(f"span {span}, distance {distance}: expected 1 < span <= distance")
    length = 1 + distance + span
    rows_ = rng.choice(ids, size=(rows, length))
    rows_[:, 0] = bos
    rows_[:, 1 + distance :] = rows_[:, 1 : 1 + span]
    inputs, following = rows_[:, :-1], rows_[:, 1:]
    targets = np.full_like(inputs, -1)
    scored = slice(1 + distance, distance + span)  # positions holding a_1 .. a_{L-1} again
    targets[:, scored] = following[:, scored]
    return inputs.astype(np.int32), targets.astype(np.int32)


def score(fn: TokenFn, inputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Accuracy (argmax = target) and mean loss over the scored positions."""
    nats, argmax = fn(inputs, targets)
    scored = targets >= 0
    return {
        "accuracy": float((argmax == targets)[scored].mean()),
        "loss": float(nats[scored].mean()),
        "tokens": int(scored.sum()),
    }


def probe(
    fn: TokenFn,
    ids: np.ndarray,
    bos: int,
    seq_len: int,
    spans: tuple[int, ...],
    distances: tuple[int, ...],
    rows: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per (span, distance) that fits the context (1 + distance + span - 1 <=
    seq_len inputs), drawn from `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for span in spans:
        for distance in distances:
            if span > distance or distance + span > seq_len:
                continue
            inputs, targets = induction_batch(rng, ids, bos, span, distance, rows)
            out.append({"span": span, "distance": distance, **score(fn, inputs, targets)})
    return out
