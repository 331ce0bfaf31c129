"""Small models for CPU tests: the presets' structure at a tiny width."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import jax
import pytest
from flax import nnx

from bov_jax import sharding
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.presets import config_for

TINY = dict(model_dim=64, head_dim=32, vocab_size=200, seq_len=64, short_window=8)


def tiny_config(preset: str = "d12", **model_overrides):
    """A preset's config at width 64, two heads, vocab 200 (padded 256), T = 64, and a fixed
    32 rows per device per micro-batch (a preset's auto rows depend on the chip)."""
    config = config_for(preset)
    config.model.update({**TINY, **model_overrides})
    config.train.device_batch_size = 32
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


@contextlib.contextmanager
def meshes_on_one_device() -> Iterator[None]:
    """Meshes built for all devices (`loop.run`) take the first device only: for in-process runs
    that test something other than sharding, which then compile and step about twice as fast
    as over the 8 fake devices. The config's mesh must then have one device (data=-1 or 1)."""
    make_mesh = sharding.make_mesh
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            sharding,
            "make_mesh",
            lambda mesh_cfg, devices=None: make_mesh(mesh_cfg, devices or jax.devices()[:1]),
        )
        yield
