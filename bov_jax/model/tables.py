"""Token-id tables (the embedding wte and the value banks) with their own gradient path.

`gather_rows` gathers the rows of the ids, then casts only those rows to the compute dtype
(nnx.Embed casts the whole table first). Its gradient is `add_rows` into a zero table: each
id's rows summed in fp32 whatever the table and compute dtypes, so a bf16 table does not sum
many tokens' gradients in bf16, and returned in the table's dtype. Rows of absent ids get zero.

The train step adds the same sums into its running gradient sum instead of building a dense
gradient per micro-batch (`add_rows`; bov_jax/train/fsdp.py): it gathers each table's rows
itself and passes them to the model (`Table.__call__`'s `given`), differentiating the rows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx


def add_rows(total: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """total (V, F) + the rows (..., F) of the ids (...) summed per id: each id's rows added
    up in fp32, then added to total's rows of those ids in total's dtype. Only the rows of the
    ids are read and written, not the whole table. Into an fp32 total that is one scatter-add;
    into a bf16 total each id's rows are summed first (a sort of the ids), so that they round
    to bf16 once, as a dense fp32 gradient cast to bf16 and added would."""
    ids, rows = ids.reshape(-1), rows.reshape(-1, rows.shape[-1]).astype(jnp.float32)
    if total.dtype != jnp.float32:
        n = ids.shape[0]  # unique ids padded with one past the table, dropped below
        ids, inverse = jnp.unique(ids, size=n, fill_value=total.shape[0], return_inverse=True)
        rows = jax.ops.segment_sum(rows, inverse.reshape(-1), num_segments=n)
    return total.at[ids].add(rows.astype(total.dtype), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_rows(table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """table (V, F), ids (...) int -> (..., F) rows of the ids, in `dtype`."""
    return jnp.take(table, ids, axis=0).astype(dtype)


def _gather_rows_fwd(table, ids, dtype):
    return gather_rows(table, ids, dtype), (table, ids)


def _gather_rows_bwd(dtype, residuals, g):
    """The table gradient: g's rows added up per id in fp32, in the table's dtype."""
    table, ids = residuals  # the table only for its shape and dtype
    return add_rows(jnp.zeros(table.shape, table.dtype), ids, g), None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


class Table(nnx.Embed):
    """nnx.Embed whose lookup is `gather_rows` (same parameters, same `attend`), named by its
    `role` among the model's tables ("wte", "bank.<layer>", "bank" when shared)."""

    def __init__(self, *args, role: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.role = role

    def __call__(self, ids: jax.Array, given: Mapping[str, jax.Array] | None = None) -> jax.Array:
        """ids (B, T) int -> (B, T, features) in the compute dtype: the table's rows of the
        ids, or `given[role]` where the caller gathered them (the train step's row gradient)."""
        if given is not None and self.role in given:
            return given[self.role]
        dtype = self.dtype or self.embedding.dtype
        return gather_rows(self.embedding[...], ids, dtype)


def iter_tables(module: nnx.Module) -> Iterator[tuple[tuple, Table]]:
    """(path, table) of each Table in `module`, once each (a shared table at its first path)."""
    return ((path, node) for path, node in nnx.iter_graph(module) if isinstance(node, Table))


def embedding_paths(module: nnx.Module) -> dict[str, tuple]:
    """The tables of `module` by role -> the path of each one's embedding in the module's
    parameters (`nnx.to_pure_dict` layout; a shared table's first path)."""
    return {table.role: (*path, "embedding") for path, table in iter_tables(module)}
