"""Jitted per-token functions of a GPT, shared by the language-model probes."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from bov_jax.model.gpt import GPT

TokenFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def token_fn(model: GPT) -> TokenFn:
    """(inputs, targets) int32 (B, T), targets -1 where ignored -> (nats (B, T) float32, 0 where
    ignored; argmax (B, T) int32 of the next-token logits)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(p, inputs, targets):
        m = nnx.merge(graphdef, p)
        return m.loss(inputs, targets, reduction="none"), m(inputs).argmax(-1)

    def fn(inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nats, argmax = run(params, np.asarray(inputs, np.int32), np.asarray(targets, np.int32))
        return np.asarray(nats), np.asarray(argmax)

    return fn
