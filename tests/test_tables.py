"""The table lookup's custom VJP against autodiff of a plain gather, and `add_rows`, the
per-id sum that both it and the train step's row gradient use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.model.tables import add_rows, gather_rows

IDS = jnp.array([[5, 9, 9, 17, 5, 100], [3, 9, 42, 5, 5, 0]])  # repeated ids on purpose


def table_and_cotangent(dtype, compute_dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    table = jax.random.normal(k1, (128, 16), jnp.float32)
    cotangent = jax.random.normal(k2, (*IDS.shape, 16), jnp.float32)
    return table.astype(dtype), cotangent.astype(compute_dtype)


def plain_gather(table, ids, dtype):
    return jnp.take(table, ids, axis=0).astype(dtype)


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
def test_fp32_table_gradient_equals_autodiff(compute_dtype):
    table, cotangent = table_and_cotangent(jnp.float32, compute_dtype)
    out, vjp = jax.vjp(lambda t: gather_rows(t, IDS, compute_dtype), table)
    want_out, want_vjp = jax.vjp(lambda t: plain_gather(t, IDS, compute_dtype), table)
    np.testing.assert_array_equal(out, want_out)
    (grad,), (want,) = vjp(cotangent), want_vjp(cotangent)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(128), np.asarray(IDS))
    assert not np.any(np.asarray(grad)[untouched])
    rows = cotangent.astype(jnp.float32)
    np.testing.assert_allclose(grad[9], rows[0, 1] + rows[0, 2] + rows[1, 1], rtol=1e-6)


def test_bf16_table_gradient_is_accumulated_in_fp32():
    table, cotangent = table_and_cotangent(jnp.bfloat16, jnp.bfloat16)
    _, vjp = jax.vjp(lambda t: gather_rows(t, IDS, jnp.bfloat16), table)
    (grad,) = vjp(cotangent)
    assert grad.dtype == jnp.bfloat16
    # Autodiff of the same gather on an fp32 copy of the table sums in fp32: the same
    # gradient, rounded once to bf16.
    _, fp32_vjp = jax.vjp(lambda t: plain_gather(t, IDS, jnp.bfloat16), table.astype(jnp.float32))
    (want,) = fp32_vjp(cotangent)
    np.testing.assert_array_equal(
        np.asarray(grad, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32)
    )


def test_forward_casts_only_the_gathered_rows():
    table, _ = table_and_cotangent(jnp.float32, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda t: gather_rows(t, IDS, jnp.bfloat16))(table)
    converts = [
        e
        for e in jaxpr.eqns[0].params["call_jaxpr"].eqns
        if e.primitive.name == "convert_element_type"
    ]
    assert [tuple(e.outvars[0].aval.shape) for e in converts] == [(*IDS.shape, 16)]


def test_add_rows_sums_each_id_in_fp32_then_adds_in_the_totals_dtype():
    """Four rows of 2**-9 for id 5 onto a bf16 1.0: summed first (2**-7) they reach the
    total; added one by one in bf16 each would round away (1 + 2**-9 is not a bf16)."""
    total = jnp.ones((8, 2), jnp.bfloat16)
    ids = jnp.array([[5, 5], [5, 2], [5, 7]])
    rows = jnp.full((3, 2, 2), 2.0**-9, jnp.bfloat16).at[1, 1].set(0.5).at[2, 1].set(-1.0)
    got = np.asarray(add_rows(total, ids, rows), np.float32)
    want = np.ones((8, 2), np.float32)
    want[5] += 4 * 2.0**-9
    want[2] += 0.5
    want[7] -= 1.0
    np.testing.assert_array_equal(got, want)
    naive = np.asarray(total.at[ids.reshape(-1)].add(rows.reshape(-1, 2)), np.float32)
    assert naive[5, 0] != want[5, 0]  # the order of rounding this guards against


def test_add_rows_touches_only_the_rows_of_the_ids():
    total = jax.random.normal(jax.random.key(1), (128, 16), jnp.float32)
    table, cotangent = table_and_cotangent(jnp.float32, jnp.float32)
    got = np.asarray(add_rows(total, IDS, cotangent))
    want = np.asarray(total).copy()
    np.add.at(want, np.asarray(IDS).reshape(-1), np.asarray(cotangent).reshape(-1, 16))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(128), np.asarray(IDS))
    np.testing.assert_array_equal(got[untouched], np.asarray(total)[untouched])
