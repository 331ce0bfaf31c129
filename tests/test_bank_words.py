"""A bank table as the serving step holds it (`bank_words`): exact both ways, a head's words
consecutive, each half of a 16-bit head's words a run of its columns."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model

from bov_jax.inference import bank_words
from bov_jax.inference.engine import serving_params
from bov_jax.inference.layout import CacheLayout
from bov_jax.model.tables import embedding_paths

HEADS, HEAD_DIM, ROWS = 3, 8, 5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_packing_is_exact_and_each_half_is_a_run_of_a_heads_columns(dtype):
    table = jax.random.normal(jax.random.key(0), (ROWS, HEADS * HEAD_DIM)).astype(dtype)
    words = bank_words.pack(table, HEADS)
    parts = bank_words.halves(dtype)
    assert words.dtype == jnp.uint32 and words.shape == (ROWS, 1, HEADS * HEAD_DIM // parts)
    np.testing.assert_array_equal(bank_words.unpack(words[:, 0], HEADS, dtype), table)
    per_head = words[:, 0].reshape(ROWS, HEADS, -1)
    columns = table.reshape(ROWS, HEADS, parts, -1).astype(jnp.float32)  # (R, H, half, run)
    for which in range(parts):
        np.testing.assert_array_equal(bank_words.half(per_head, which, dtype), columns[:, :, which])


def test_only_16_and_32_bit_floats_pack():
    for dtype in (jnp.int32, jnp.int8, jnp.uint32):
        with pytest.raises(ValueError, match="expected a 16- or 32-bit float"):
            bank_words.halves(dtype)


@pytest.mark.parametrize("eliminate_bank_v", [True, False])
def test_the_engine_serves_banks_as_words_where_its_layers_read_them_by_id(eliminate_bank_v):
    """BoV without V pages: each bank as words holding its bf16 rows; with V pages (the bank
    then feeds the values written to pages) the table, cast."""
    model = tiny_model("d12_bov", compute_dtype="bfloat16")
    layout = CacheLayout.build(model.spec, 8, None, eliminate_bank_v)
    served = nnx.to_pure_dict(serving_params(model, nnx.state(model), layout))
    trained = nnx.to_pure_dict(nnx.state(model))
    banks = [path for role, path in embedding_paths(model).items() if role != "wte"]
    assert len(banks) == len(model.spec.targets) > 0
    for path in banks:
        table, got = (functools.reduce(dict.get, path, tree) for tree in (trained, served))
        if eliminate_bank_v:
            assert got.dtype == jnp.uint32 and got.ndim == 3
            got = bank_words.unpack(got[:, 0], model.spec.n_head, jnp.bfloat16)
        np.testing.assert_array_equal(got, table.astype(jnp.bfloat16))
