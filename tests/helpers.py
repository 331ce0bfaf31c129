"""Small models for CPU tests: the presets' structure at a tiny width."""

from __future__ import annotations

import zlib

import jax
from flax import nnx

from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.presets import config_for

TINY = dict(model_dim=64, head_dim=32, vocab_size=200, seq_len=64, short_window=8)


def tiny_config(preset: str = "d12", **model_overrides):
    """A preset's config at width 64, two heads, vocab 200 (padded 256), T = 64."""
    config = config_for(preset)
    config.model.update({**TINY, **model_overrides})
    return config


def tiny_model(preset: str = "d12", seed: int = 0, **model_overrides) -> GPT:
    return GPT(ModelSpec.from_config(tiny_config(preset, **model_overrides).model), seed=seed)


def randomize(model: GPT, seed: int, scale: float = 0.05, only: str = "") -> None:
    """Replace parameters (those whose path contains `only`, if given) with random values.

    The reference init zeroes every output projection (so each block starts as the
    identity) and the smear: equivalence tests need weights where every path is live.
    Parameters are drawn by path, so two models share the values of common paths.
    """
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name = "/".join(map(str, path))
        if only not in name:
            continue
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))
        var.set_value(scale * jax.random.normal(key, var.shape, var.dtype))
    nnx.update(model, state)


def tokens(batch: int = 2, length: int = 64, vocab: int = 200, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)
