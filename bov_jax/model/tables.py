"""Token-id tables (the embedding wte and the value banks) with their own gradient path.

`gather_rows` gathers the rows of the ids, then casts only those rows to the compute dtype
(nnx.Embed casts the whole table first). Its custom VJP accumulates the table gradient in
fp32 whatever the table and compute dtypes, so a bf16 table does not sum many tokens'
gradients in bf16, and returns it in the table's dtype. Rows of absent ids get zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_rows(table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """table (V, F), ids (...) int -> (..., F) rows of the ids, in `dtype`."""
    return jnp.take(table, ids, axis=0).astype(dtype)


def _gather_rows_fwd(table, ids, dtype):
    return gather_rows(table, ids, dtype), (table, ids)


def _gather_rows_bwd(dtype, residuals, g):
    """The table gradient: g's rows added up per id in fp32, then cast to the table dtype."""
    table, ids = residuals  # the table only for its shape and dtype
    rows = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    grad = jnp.zeros(table.shape, jnp.float32).at[ids.reshape(-1)].add(rows, mode="drop")
    return grad.astype(table.dtype), None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


class Table(nnx.Embed):
    """nnx.Embed whose lookup is `gather_rows` (same parameters, same `attend`)."""

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids (B, T) int -> (B, T, features) in the compute dtype."""
        dtype = self.dtype or self.embedding.dtype
        return gather_rows(self.embedding[...], ids, dtype)
