"""Stateless building blocks: RMSNorm, rotary embedding, windowed attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bov_jax import sharding
from bov_jax.model import splash

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
