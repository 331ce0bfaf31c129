"""The "xla" attention, computed by blocks of queries, against jax.nn.dot_product_attention
(the full (T, T) scores with a causal or sliding-window mask): values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.model import layers


def attend_and_grads(attend, q, k, v):
    """attend's output and the gradients wrt q, k, v of a random projection of it."""

    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(jax.random.normal(jax.random.key(7), out.shape, out.dtype))

    return run(q, k, v)


def reference(q, k, v, window):
    seq = q.shape[1]
    local = None if window >= seq - 1 else (window, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=local, implementation="xla"
    )


@pytest.mark.parametrize(
    ("seq", "window", "blocks"),
    [
        (64, 63, 4),  # causal: blocks see 16, 32, 48, 64 keys
        (64, 10, 4),  # window shorter than a block: each block starts 10 keys back
        (64, 20, 4),  # window longer than a block
        (64, 0, 4),  # each query sees itself only
        (60, 20, 8),  # T not divisible: one block
        (64, 20, 1),  # one block: the default below MIN_QUERY_BLOCK queries a block
    ],
)
def test_blocked_attention_equals_full_masked_attention(seq, window, blocks):
    q, k, v = (
        jax.random.normal(key, (2, seq, 3, 16)) for key in jax.random.split(jax.random.key(0), 3)
    )
    blocked = attend_and_grads(
        lambda q, k, v: layers.blocked_attention(q, k, v, window=window, blocks=blocks), q, k, v
    )
    full = attend_and_grads(lambda q, k, v: reference(q, k, v, window), q, k, v)
    for got, want in zip(jax.tree.leaves(blocked), jax.tree.leaves(full), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_blocked_attention_in_bf16_scores_in_fp32_like_the_reference():
    q, k, v = (
        jax.random.normal(key, (2, 64, 2, 32), jnp.bfloat16)
        for key in jax.random.split(jax.random.key(1), 3)
    )
    out = layers.attention(q, k, v, window=20, implementation="xla")
    want = reference(q, k, v, 20)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        out.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2
    )


def test_default_plan_keeps_blocks_of_at_least_min_queries():
    assert layers.query_blocks(512, 511) == [
        (0, 128, 0),
        (128, 256, 0),
        (256, 384, 0),
        (384, 512, 0),
    ]
    assert layers.query_blocks(256, 63) == [(0, 128, 0), (128, 256, 65)]
    assert layers.query_blocks(64, 63) == [(0, 64, 0)]
    assert layers.scored_pairs(512, 511) == 512 * 512 * 5 // 8
