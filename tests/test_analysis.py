"""The values analysis: R^2 against a token-id table, on hand-made data and tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_model, tokens

from bov_jax.analysis.values import (
    KINDS,
    r_squared,
    stacked_activations,
    token_table_r_squared,
)
from bov_jax.model import layers


def test_r_squared_by_hand():
    ids = np.array([0, 0, 1, 1])
    acts = np.array([[1.0, 0.0], [3.0, 0.0], [5.0, 2.0], [9.0, -2.0]])
    # per-id means (2, 0) and (7, 0); within 1+1+4+4 + 0+0+4+4 = 18; total 35 + 8 = 43
    assert r_squared(ids, acts) == pytest.approx(1 - 18 / 43, abs=1e-12)
    assert r_squared(np.array([3, 3, 5]), np.array([[1.0], [1.0], [4.0]])) == 1.0


def test_captured_activations_are_the_model_ones():
    model = tiny_model("d12_bov", depth=3)
    randomize(model, seed=2, scale=0.5)
    ids = tokens(2, 32)
    acts = stacked_activations(*nnx.split(model))(ids)
    assert {k: v.shape for k, v in acts.items()} == {k: (3, 2, 32, 64) for k in KINDS}
    bov = model.blocks[2].attn.value  # depth 3: the last third is layer 2
    bank_values = bov.replace_coef() * bov.bank_lookup(ids)  # gamma E_l[ids]
    np.testing.assert_allclose(acts["values"][2], bank_values, rtol=1e-6)
    stream = model.smear(model.embed(ids))
    np.testing.assert_allclose(acts["residual"][0], stream, rtol=1e-5, atol=1e-6)
    keys = model.blocks[0].attn.c_k(layers.rms_norm(stream))
    np.testing.assert_allclose(acts["keys"][0], keys, rtol=1e-4, atol=1e-5)


def test_bov_target_layers_give_exactly_one():
    model = tiny_model("d12_bov", depth=3)
    randomize(model, seed=3, scale=0.5)  # a live smear and attention: context matters
    batches = [np.asarray(tokens(2, 32, vocab=40, seed=s)) for s in (1, 2)]
    r2 = token_table_r_squared(model, batches)
    assert r2["values"][2] == 1.0
    assert max(r2["values"][:2]) < 0.99 and max(r2["keys"]) < 0.99 and max(r2["residual"]) < 0.99
    assert min(r2["values"][:2]) > 0.0  # the token id still explains part of every layer
    baseline = tiny_model("d12", depth=3)
    randomize(baseline, seed=3, scale=0.5)
    assert max(token_table_r_squared(baseline, batches)["values"]) < 0.99
