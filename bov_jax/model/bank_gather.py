"""A decoding step's bank values: y[b, h] = sum_s w[b, s, h] * E[ids[b, s], head h's columns].

A BoV layer without a V cache weighs, at each decoding step, the bank rows of the tokens its
window sees. In XLA ops (`weighted_rows_xla`) that is a gather and a multiply-and-reduce over
the gathered rows. XLA on CPUs fuses the two. XLA on GPUs does not: it writes the gathered
rows out, transposed so that the reduction runs along the minor axis, and a second kernel
reads them back. That moves three times the bytes a V cache read moves: for d24's decoding
loop compiled for an H200 at batch 8, 336 MiB a step beyond the V-cache model's ~2.6 GiB
(benchmarks/decode_aot.py). `weighted_rows_kernel` is a Pallas (Triton) kernel that reads each
row once, where it is weighed. `weighted_rows` picks one of the two per platform when it is
lowered (jax.lax.platform_dependent): the kernel on NVIDIA GPUs, XLA ops elsewhere.

Shapes: B rows, H heads, C visible slots, hd head width, table (R, H * hd).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas's Triton backend, deprecated since jax 0.11 (Mosaic GPU replaces it)
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:  # a jax without it: XLA ops everywhere
    pallas_triton = None

SLOT_BLOCK = 64  # slots the kernel gathers and weighs per iteration


def weighted_rows_xla(
    weights: jax.Array, ids: jax.Array, table: jax.Array, heads: int
) -> jax.Array:
    """The sum in XLA ops. weights (B, C, H) fp32, ids (B, C) int -> (B, H, hd) fp32."""
    batch, slots, _ = weights.shape
    rows = jnp.take(table, ids, axis=0).reshape(batch, slots, heads, -1)
    return jnp.sum(weights[..., None] * rows.astype(jnp.float32), axis=1)


def weighted_rows_kernel(
    weights: jax.Array, ids: jax.Array, table: jax.Array, heads: int, interpret: bool = False
) -> jax.Array:
    """The sum as one Pallas kernel, a program per (row, head): SLOT_BLOCK slots at a time it
    loads their ids, gathers head h's columns of their table rows and adds the weighed rows
    to an fp32 accumulator. weights (B, C, H) fp32, ids (B, C) int -> (B, H, hd) fp32; hd a
    power of two. C is padded to a multiple of SLOT_BLOCK with weight 0 (row 0 is read).
    `interpret`: Pallas interpret mode (any platform; for tests)."""
    batch, slots, _ = weights.shape
    head_dim = table.shape[1] // heads
    padded = -(-slots // SLOT_BLOCK) * SLOT_BLOCK
    weights = jnp.pad(weights, ((0, 0), (0, padded - slots), (0, 0)))
    ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, padded - slots)))

    def kernel(w_ref, ids_ref, table_ref, out_ref):  # w (1, Cp, 1), ids (1, Cp), out (1, 1, hd)
        columns = pl.program_id(1) * head_dim + jnp.arange(head_dim)

        def add_block(i: jax.Array, total: jax.Array) -> jax.Array:
            block = pl.ds(pl.multiple_of(i * SLOT_BLOCK, SLOT_BLOCK), SLOT_BLOCK)
            rows = table_ref[ids_ref[0, block][:, None], columns[None, :]]
            return total + jnp.sum(w_ref[0, block, 0][:, None] * rows.astype(jnp.float32), 0)

        zero = jnp.zeros((head_dim,), jnp.float32)
        out_ref[0, 0, :] = jax.lax.fori_loop(0, padded // SLOT_BLOCK, add_block, zero)

    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[
            pl.BlockSpec((1, padded, 1), lambda b, h: (b, 0, h)),
            pl.BlockSpec((1, padded), lambda b, h: (b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),  # the whole table; rows are gathered
        ],
        out_specs=pl.BlockSpec((1, 1, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.float32),
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(weights, ids, table)


def weighted_rows(weights: jax.Array, ids: jax.Array, table: jax.Array, heads: int) -> jax.Array:
    """The sum, by the kernel where the program is lowered for NVIDIA GPUs (head width a power
    of two, a jax with Pallas's Triton backend), else in XLA ops. weights (B, C, H) fp32,
    ids (B, C) int -> (B, H, hd) fp32."""
    xla = functools.partial(weighted_rows_xla, heads=heads)
    head_dim = table.shape[1] // heads
    if head_dim & (head_dim - 1) or pallas_triton is None:
        return xla(weights, ids, table)
    kernel = functools.partial(weighted_rows_kernel, heads=heads)
    return jax.lax.platform_dependent(weights, ids, table, cuda=kernel, default=xla)
