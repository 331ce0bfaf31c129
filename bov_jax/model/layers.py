"""Stateless building blocks: RMSNorm, rotary embedding, windowed attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax import sharding
from bov_jax.model import bank_gather, splash

F32_EPS = float(jnp.finfo(jnp.float32).eps)


def rms_norm(x: jax.Array) -> jax.Array:
    """Parameter-free RMSNorm over the last axis, computed in fp32.

    x: (..., D) -> (..., D) in x's dtype; eps = float32 machine epsilon (spec 1.2).
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + F32_EPS)
    return y.astype(x.dtype)


def rotary_tables(length: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of positions 0 .. length - 1: two (length, head_dim // 2) fp32 NumPy arrays.

    NumPy, not jnp: the tables are constants of the compiled program. Computed from traced
    positions, XLA fuses cos and sin into each rotary product and evaluates them once per
    element of q and k (B * H times over; about 4% of the CPU quickstart's step). The
    reference's fp32 formula, inv_freq = 1 / base^(2j / hd) and angles t * inv_freq. Decoding
    indexes the tables at its positions (`rotary_at`): it rotates by the forward's numbers.
    """
    channels = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.float32(base) ** channels  # fp32 throughout (spec 1.3)
    angles = np.outer(np.arange(length, dtype=np.float32), inv_freq)
    return np.cos(angles), np.sin(angles)


def rotary_at(
    tables: tuple[np.ndarray, np.ndarray], positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The rows of `rotary_tables` at positions (T,) or (B, T) int (each < length):
    cos, sin of shape positions.shape + (head_dim // 2,)."""
    return tuple(jnp.take(jnp.asarray(table), positions, axis=0) for table in tables)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split rotary with the reference's sign (a rotation by -theta).

    x: (B, T, H, hd); cos, sin: (T, hd/2) or (B, T, hd/2). Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


# The "xla" attention splits the queries into up to this many blocks of at least
# MIN_QUERY_BLOCK queries (where T divides evenly), each scored only against the keys it can
# see: a causal layer computes 5/8 of the full (T, T) scores at 4 blocks, a windowed one less.
# Shorter sequences stay one block: each block adds ops to compile (the tests' T = 64 model
# compiled 40% slower at 4 blocks) and saves little.
QUERY_BLOCKS = 4
MIN_QUERY_BLOCK = 128


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, implementation: str
) -> jax.Array:
    """Causal self-attention where query i sees keys j with 0 <= i - j <= window.

    q, k, v: (B, T, H, hd) -> (B, T, H, hd). Softmax scale 1/sqrt(hd). implementation:
    "xla" (`blocked_attention`), "cudnn" (jax.nn.dot_product_attention) or "splash" (the
    TPU Pallas kernel).
    """
    if implementation == "splash":
        return splash.attention(q, k, v, window=window)
    if implementation == "xla":
        return blocked_attention(q, k, v, window=window)
    seq = q.shape[1]
    local = None if window >= seq - 1 else (window, 0)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=local, implementation=implementation
        )

    return sharding.per_device_heads(attend)(q, k, v)


def blocked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, blocks: int | None = None
) -> jax.Array:
    """`attention` in XLA ops over `blocks` equal blocks of queries (default `query_blocks`'s;
    one block where T does not divide): the block of queries [a, b) is scored against keys
    [max(0, a - window), b) only, so the masked-out upper triangle (and what lies beyond the
    window) is mostly never computed. Scores and softmax in fp32, as
    jax.nn.dot_product_attention's "xla" path.

    q, k, v: (B, T, H, hd) -> (B, T, H, hd).
    """
    outputs = [
        _masked_attention(
            q[:, start:stop],
            k[:, first_key:stop],
            v[:, first_key:stop],
            offset=start - first_key,
            window=window,
        )
        for start, stop, first_key in query_blocks(q.shape[1], window, blocks)
    ]
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


def query_blocks(seq: int, window: int, blocks: int | None = None) -> list[tuple[int, int, int]]:
    """`blocked_attention`'s plan: (first query, end query, first key) of each block; a
    block's keys end where its queries do. blocks=None: QUERY_BLOCKS, fewer where a block
    would hold under MIN_QUERY_BLOCK queries."""
    if blocks is None:
        blocks = max(1, min(QUERY_BLOCKS, seq // MIN_QUERY_BLOCK))
    size = seq // blocks if seq % blocks == 0 else seq
    return [(start, start + size, max(0, start - window)) for start in range(0, seq, size)]


def scored_pairs(seq: int, window: int, blocks: int | None = None) -> int:
    """(query, key) scores `blocked_attention` computes per row and head (seq^2 at 1 block)."""
    return sum(
        (stop - start) * (stop - first) for start, stop, first in query_blocks(seq, window, blocks)
    )


def _masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, offset: int, window: int
) -> jax.Array:
    """Query i (position offset + i among the keys) sees key j iff 0 <= offset + i - j <= window.

    q: (B, Tq, H, hd), k, v: (B, Tk, H, hd) -> (B, Tq, H, hd).
    """
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(q.shape[-1]))
    distance = jnp.arange(q.shape[1])[:, None] + offset - jnp.arange(k.shape[1])[None, :]
    visible = (distance >= 0) & (distance <= window)
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)


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
    the table where it is weighed: for one query per row (a decoding step) the weighted sum
    of the gathered rows (`bank_gather.weighted_rows`: fused into one pass, the rows read
    once and never written out as values); for several queries (a prefill) an einsum over
    the gathered rows. No V cache either way. The scale multiplies the softmax weights, where
    XLA fuses it. Returns (B, Tq, H, hd), q's dtype.
    """
    batch, slots, heads, head_dim = k.shape
    first, count = visible_slots(q_positions, slots, window)
    k = _windowed(k, first, count)
    logits = jnp.einsum("bqhd,bshd->bhqs", q, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(head_dim))
    mask = cache_mask(q_positions, count, k_length, window, first)[None, None]
    logits = jnp.where(mask, logits, -jnp.inf)  # each query sees at least its own slot
    weights = jax.nn.softmax(logits, axis=-1) * scale  # (B, H, Tq, count) fp32
    if q.shape[1] == 1:
        w = jnp.swapaxes(weights[:, :, 0], 1, 2)  # (B, count, H)
        return bank_gather.weighted_rows(w, ids, first, table, heads=heads, dtype=q.dtype)[:, None]
    rows = jnp.take(table, _windowed(ids, first, count), axis=0)
    y = jnp.einsum(
        "bhqs,bshd->bqhd",
        weights.astype(q.dtype),
        rows.reshape(batch, count, heads, head_dim).astype(q.dtype),
        preferred_element_type=jnp.float32,
    )
    return y.astype(q.dtype)
