"""A bank layer's table as the serving step holds it: each row in 32-bit words, (R, 1, K).

A TPU kernel copies one bank row per slot by DMA, and a DMA starts at a block of the array's
tiled layout. A (R, 1, K) 32-bit array is laid out a row per (1, 128) tile, as compact as the
table, and it is in the layout Mosaic takes its operands in; the (R, H x hd) bf16 table is
not (eight or sixteen rows share a tile), nor is a (R, 1, H x hd) bf16 view of it (XLA lays
it out otherwise, and would copy every bank into Mosaic's layout each step). So the engine
serves the banks of the layers that read them by id as words (`pack`), and every reader
unpacks the words it reads: the kernels where they weigh them, the XLA path after its gather.

Words of a row: head h's K / H words are consecutive (a head's columns are read together).
A 32-bit table's word is one value. A 16-bit table's word k of head h holds that head's
column k in its low half and column k + hd/2 in its high half, so that each half of a head's
words is a run of hd/2 columns, in order. Packing is exact (a bit copy) for both.

Shapes: R bank rows, H heads, hd head width, K = H x hd / halves words a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WORD = jnp.uint32


def halves(dtype: jnp.dtype) -> int:
    """Values of `dtype` a word holds: 2 of a 16-bit float, 1 of a 32-bit one."""
    size = jnp.dtype(dtype).itemsize
    if size not in (2, 4) or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"a bank of dtype {jnp.dtype(dtype).name}; expected a 16- or 32-bit float")
    return 4 // size


def pack(table: jax.Array, heads: int) -> jax.Array:
    """The table (R, H x hd) as words (R, 1, K) uint32 (module doc)."""
    rows = table.shape[0]
    if halves(table.dtype) == 1:
        return jax.lax.bitcast_convert_type(table, WORD).reshape(rows, 1, -1)
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16).astype(WORD)
    bits = bits.reshape(rows, heads, 2, -1)  # (R, H, half, hd/2)
    return (bits[:, :, 0] | (bits[:, :, 1] << 16)).reshape(rows, 1, -1)


def half(words: jax.Array, which: int, dtype: jnp.dtype) -> jax.Array:
    """The values that half `which` (0: low, 1: high; 0 for a 32-bit table) of each word
    holds, in fp32: words' shape. Shifts and bit casts only, as Pallas kernels take them."""
    if halves(dtype) == 1:
        return jax.lax.bitcast_convert_type(words, jnp.float32)
    bits = (words >> (16 * which)) & 0xFFFF
    if jnp.dtype(dtype) == jnp.bfloat16:  # a bf16's bits are the top half of its fp32's
        return jax.lax.bitcast_convert_type(bits << 16, jnp.float32)
    value = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
    return value.astype(jnp.float32)


def unpack(words: jax.Array, heads: int, dtype: jnp.dtype) -> jax.Array:
    """Rows of words (..., K) back as table rows (..., H x hd) in dtype."""
    per_head = words.reshape(*words.shape[:-1], heads, -1)  # (..., H, K / H)
    parts = [half(per_head, which, dtype) for which in range(halves(dtype))]
    return jnp.concatenate(parts, axis=-1).reshape(*words.shape[:-1], -1).astype(dtype)
