"""Attention of new queries over a dense decoding cache (`bov_jax.inference.decode`).

Shapes: B rows, Tq new queries, S cache slots, H heads, hd head width. Slot j holds
position j; slots past the cache's length are empty and masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bov_jax.inference import bank_gather


def cache_mask(
    q_positions: jax.Array, slots: int, k_length: jax.Array, window: int, first: jax.Array = 0
) -> jax.Array:
    """Which cache slots each new query sees: (Tq, S) bool, slot j holding position first + j.

    The query at p sees the position j' = first + j iff j' <= p, p - j' <= window and
    j' < k_length.
    """
    j = first + jnp.arange(slots)[None, :]
    p = q_positions[:, None]
    return (j <= p) & (p - j <= window) & (j < k_length)


def visible_slots(q_positions: jax.Array, slots: int, window: int) -> tuple[jax.Array, int]:
    """(first slot, count) of the cache slots that queries at ascending q_positions (Tq,) can
    see through a window: a static count, min(S, window + Tq), so that a decoding step reads
    a window layer's last window + 1 slots, not all S, without a loop of dynamic length."""
    count = min(slots, window + q_positions.shape[0])
    first = jnp.clip(q_positions[0] - window, 0, slots - count)
    return first, count


def _windowed(x: jax.Array, first: jax.Array, count: int) -> jax.Array:
    """Slots [first, first + count) of x (B, S, ...)."""
    return x if count == x.shape[1] else jax.lax.dynamic_slice_in_dim(x, first, count, axis=1)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    k_length: jax.Array,
    window: int,
) -> jax.Array:
    """Attention of new queries over a cache of keys/values (decoding).

    q: (B, Tq, H, hd) at ascending absolute positions q_positions (Tq,); k, v: (B, S, H, hd)
    where slots >= k_length are empty; only the slots the window can reach are read
    (`visible_slots`), masked as `cache_mask`. Returns (B, Tq, H, hd).
    """
    first, count = visible_slots(q_positions, k.shape[1], window)
    mask = cache_mask(q_positions, count, k_length, window, first)
    k, v = _windowed(k, first, count), _windowed(v, first, count)
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="xla")


def cached_table_attention(
    q: jax.Array,
    k: jax.Array,
    table: jax.Array,
    ids: jax.Array,
    *,
    q_positions: jax.Array,
    k_length: jax.Array,
    window: int,
    scale: jax.Array | float = 1.0,
) -> jax.Array:
    """`cached_attention` whose values are scaled table rows: v[b, j] = scale * table[ids[b, j]].

    q: (B, Tq, H, hd) at ascending positions q_positions (Tq,); k: (B, S, H, hd); table:
    (rows, H * hd); ids: (B, S) int. Only the visible slots are read (`visible_slots`, a
    static count). The softmax weights come first; then each visible slot's row is read from
    the table where it is weighed (`weighed_table_rows`). No V cache. The scale multiplies
    the softmax weights, where XLA fuses it. Returns (B, Tq, H, hd), q's dtype.
    """
    slots, head_dim = k.shape[1], k.shape[3]
    first, count = visible_slots(q_positions, slots, window)
    k = _windowed(k, first, count)
    logits = jnp.einsum("bqhd,bshd->bhqs", q, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(head_dim))
    mask = cache_mask(q_positions, count, k_length, window, first)[None, None]
    logits = jnp.where(mask, logits, -jnp.inf)  # each query sees at least its own slot
    weights = jax.nn.softmax(logits, axis=-1) * scale  # (B, H, Tq, count) fp32
    return weighed_table_rows(weights, ids, first, table, q.dtype)


def weighed_table_rows(
    weights: jax.Array, ids: jax.Array, first: jax.Array | int, table: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    """sum_s weights[b, h, q, s] * table[ids[b, first + s]] (head h's columns): the values
    of a table-valued attention, the rows read where they are weighed.

    weights: (B, H, Tq, C) fp32 over C slots from `first`; ids: (B, S) int, S >= first + C;
    table: (rows, H * hd). For one query per row (a decoding step) the weighted sum of the
    gathered rows (`bank_gather.weighted_rows`: one pass, the rows read once and never
    written out as values); for several (a prefill) an einsum over the gathered rows.
    Returns (B, Tq, H, hd) in dtype.
    """
    batch, heads, queries, count = weights.shape
    if queries == 1:
        w = jnp.swapaxes(weights[:, :, 0], 1, 2)  # (B, C, H)
        return bank_gather.weighted_rows(w, ids, first, table, heads=heads, dtype=dtype)[:, None]
    rows = jnp.take(table, _windowed(ids, first, count), axis=0)
    y = jnp.einsum(
        "bhqs,bshd->bqhd",
        weights.astype(dtype),
        rows.reshape(batch, count, heads, -1).astype(dtype),
        preferred_element_type=jnp.float32,
    )
    return y.astype(dtype)
