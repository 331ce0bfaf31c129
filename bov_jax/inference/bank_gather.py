"""A decoding step's bank values: y[b, h] = sum_s w[b, s, h] * E[ids[b, first + s], head h].

A BoV layer without a V cache weighs, at each decoding step, the bank rows of the tokens its
window sees. In XLA ops (`weighted_rows_xla`) that is a gather and a weighted sum (an
einsum) over the gathered rows, which stay in the table's dtype (on a v6e the einsum's
workspace was 3/4 of a multiply-and-reduce's in fp32). XLA on CPUs fuses the two. XLA on
GPUs did not (as measured for the multiply-and-reduce): it writes the gathered rows out,
transposed so that the reduction runs along the minor axis, and a second kernel reads them
back. That moves three times the bytes a V cache read moves: for d24's decoding loop
compiled for an H200 at batch 8, 336 MiB a step beyond the V-cache model's ~2.6 GiB
(benchmarks/decode_aot.py, docs/benchmarks.md). `weighted_rows_kernel` is a Pallas (Triton)
kernel that reads each row once, where it is weighed. `weighted_rows` picks one of the two
per platform when it is lowered (jax.lax.platform_dependent): the kernel on NVIDIA GPUs, XLA
ops elsewhere, and everywhere when the environment sets BOV_BANK_KERNEL=0
(benchmarks/h200.sh measures both).

Shapes: B rows, H heads, S cache slots, C visible slots (from `first`), hd head width,
table (R, H * hd).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas's Triton backend, deprecated since jax 0.11 (Mosaic GPU replaces it)
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:  # a jax without it: XLA ops everywhere
    pallas_triton = None

SLOT_BLOCK = 64  # slots the kernel gathers and weighs per iteration


def weighted_rows_xla(
    weights: jax.Array,
    ids: jax.Array,
    first: jax.Array,
    table: jax.Array,
    *,
    heads: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """The sum in XLA ops. weights (B, C, H) fp32, ids (B, S) int, first () int: the slot of
    weights[:, 0] -> (B, H, hd) in dtype, summed in fp32."""
    batch, slots, _ = weights.shape
    window = jax.lax.dynamic_slice_in_dim(ids, first, slots, axis=1)
    rows = jnp.take(table, window, axis=0).reshape(batch, slots, heads, -1)
    y = jnp.einsum("bch,bchd->bhd", weights, rows, preferred_element_type=jnp.float32)
    return y.astype(dtype)


def weighted_rows_kernel(
    weights: jax.Array,
    ids: jax.Array,
    first: jax.Array,
    table: jax.Array,
    *,
    heads: int,
    dtype: jnp.dtype,
    interpret: bool = False,
) -> jax.Array:
    """The sum as one Pallas kernel, a program per (row, head): SLOT_BLOCK slots at a time it
    loads their weights and ids, gathers head h's columns of their table rows and adds the
    weighed rows to an fp32 accumulator; loads past the last slot are masked off. Arguments
    and result as `weighted_rows_xla`'s; hd a power of two, first + C <= S.
    `interpret`: Pallas interpret mode (any platform; for tests)."""
    batch, slots, _ = weights.shape
    head_dim = table.shape[1] // heads

    def kernel(w_ref, ids_ref, first_ref, table_ref, out_ref):  # whole inputs; out (1, 1, hd)
        row, head = pl.program_id(0), pl.program_id(1)
        columns = head * head_dim + jnp.arange(head_dim)
        start = first_ref[0]

        def add_block(i: jax.Array, total: jax.Array) -> jax.Array:
            offset = pl.multiple_of(i * SLOT_BLOCK, SLOT_BLOCK)
            valid = offset + jnp.arange(SLOT_BLOCK) < slots
            w = pallas_triton.load(
                w_ref.at[row, pl.ds(offset, SLOT_BLOCK), head], mask=valid, other=0.0
            )
            index = pallas_triton.load(
                ids_ref.at[row, pl.ds(start + offset, SLOT_BLOCK)], mask=valid, other=0
            )
            cells = table_ref.at[index[:, None], columns[None, :]]
            rows = pallas_triton.load(cells, mask=valid[:, None], other=0)
            return total + jnp.sum(w[:, None] * rows.astype(jnp.float32), axis=0)

        zero = jnp.zeros((head_dim,), jnp.float32)
        total = jax.lax.fori_loop(0, pl.cdiv(slots, SLOT_BLOCK), add_block, zero)
        out_ref[0, 0, :] = total.astype(out_ref.dtype)

    whole = pl.BlockSpec(memory_space=pl.ANY)  # indexed in the kernel
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[whole] * 4,
        out_specs=pl.BlockSpec((1, 1, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(weights.astype(jnp.float32), ids.astype(jnp.int32), jnp.reshape(first, (1,)), table)


def weighted_rows(
    weights: jax.Array,
    ids: jax.Array,
    first: jax.Array,
    table: jax.Array,
    *,
    heads: int,
    dtype: jnp.dtype,
) -> jax.Array:
    """The sum, by the kernel where the program is lowered for NVIDIA GPUs (head width a power
    of two, a jax with Pallas's Triton backend, BOV_BANK_KERNEL not 0), else in XLA ops.
    weights (B, C, H) fp32, ids (B, S) int, first () int -> (B, H, hd) in dtype."""
    options = dict(heads=heads, dtype=dtype)
    xla = functools.partial(weighted_rows_xla, **options)
    head_dim = table.shape[1] // heads
    off = os.environ.get("BOV_BANK_KERNEL") == "0"
    if off or head_dim & (head_dim - 1) or pallas_triton is None:
        return xla(weights, ids, first, table)
    kernel = functools.partial(weighted_rows_kernel, **options)
    first = jnp.asarray(first, jnp.int32)
    return jax.lax.platform_dependent(weights, ids, first, table, cuda=kernel, default=xla)
