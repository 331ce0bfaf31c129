"""The language-model loss without the full logits: lm_head + softcap + cross-entropy over
chunks of tokens.

Shapes: B rows, T time, D width, V vocabulary, Vp the padded vocabulary (lm_head columns),
c the chunk length along T (a divisor of T). Per chunk the fp32 logits (B, c, Vp) exist only
inside one iteration of a `lax.scan`; the (B, T, Vp) logits and their gradient never do.

`token_nll` gives per-token nats (eval, BPB). `mean_nll` is the training loss; its custom VJP
computes the gradient during the forward scan (one pass over the vocabulary instead of a
forward pass and a recomputing backward pass): the loss is a mean, so its cotangent is one
scalar that scales the stored gradients. Both read the same per-chunk math, `_chunk_nll`.

On a device mesh (the ambient one of the train and eval steps) the rows stay split over the
batch axes: the chunk budget counts one device's tokens, the lm_head kernel is gathered once
per call, and the kernel's gradient is summed per batch shard and reduced once, after the
last chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bov_jax import sharding

# exp(cap) must stay finite in fp32 (exp(88.7) overflows): the softmax skips the max shift.
MAX_CAP = 80.0


def chunk_length(rows: int, time: int, chunk_tokens: int, shards: int = 1) -> int:
    """The largest divisor c of `time` with rows / shards * c <= chunk_tokens (at least 1):
    `chunk_tokens` counts one device's tokens when the rows are split over `shards`."""
    best = 1
    for c in range(1, time + 1):
        if time % c == 0 and rows * c <= chunk_tokens * shards:
            best = c
    return best


def _row_shards(rows: int) -> int:
    """How many batch shards of the ambient mesh the rows split over: 1 where there is no
    mesh or the rows do not divide evenly (e.g. a CORE batch of 3 rows on 8 devices)."""
    shards = sharding.ambient_batch_shards()
    return shards if rows % shards == 0 else 1


def _chunks(h: jax.Array, chunk_tokens: int) -> int:
    """The chunk length c for h (B, T, D) under the ambient mesh (the rows' shards)."""
    return chunk_length(h.shape[0], h.shape[1], chunk_tokens, _row_shards(h.shape[0]))


def _gathered(w: jax.Array) -> jax.Array:
    """The lm_head kernel (D, Vp) whole along D (vocab columns stay over tensor): gathered
    once per call, not once per chunk of the scan."""
    return sharding.constrain(w, None, "vocab")


def _chunk_nll(
    h: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, cap: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk: h (B, c, D), w (D, Vp) in the compute dtype, targets (B, c) with -1 ignored.

    Raises ValueError if cap > MAX_CAP.
    Returns (nll (B, c) fp32, 0 where ignored; probs (B, c, Vp) fp32 softmax of the capped
    logits, 0 on padded columns; tanh (B, c, Vp) fp32 of logits / cap).
    """
    if not 0 < cap <= MAX_CAP:
        raise ValueError(f"model.logit_softcap={cap}; the chunked loss needs 0 < cap <= {MAX_CAP}")
    h = sharding.constrain(h, "batch", None, None)
    logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
    logits = sharding.constrain(logits, "batch", None, "vocab")
    tanh = jnp.tanh(logits / cap)
    # |cap * tanh| <= cap, so the softmax needs no max subtraction.
    exp = jnp.exp(cap * tanh)
    if w.shape[1] > vocab_size:  # padded columns: out of the softmax (a pass only if any)
        exp = jnp.where(jnp.arange(w.shape[1]) < vocab_size, exp, 0.0)
    total = jnp.sum(exp, axis=-1)
    valid = targets >= 0
    picked = jnp.take_along_axis(tanh, jnp.where(valid, targets, 0)[..., None], axis=-1)
    nll = jnp.where(valid, jnp.log(total) - cap * picked[..., 0], 0.0)
    return nll, exp / total[..., None], tanh


def _by_chunks(x: jax.Array, c: int) -> jax.Array:
    """(B, T, ...) -> (T / c, B, c, ...): the scan axis first, rows kept whole."""
    b, t = x.shape[:2]
    return jnp.swapaxes(x.reshape(b, t // c, c, *x.shape[2:]), 0, 1)


def _from_chunks(x: jax.Array) -> jax.Array:
    """(T / c, B, c, ...) -> (B, T, ...)."""
    n, b, c = x.shape[:3]
    return jnp.swapaxes(x, 0, 1).reshape(b, n * c, *x.shape[3:])


def token_nll(
    h: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, cap: float, chunk_tokens: int
) -> jax.Array:
    """Per-token cross-entropy in nats of the softcapped logits cap * tanh(h @ w / cap).

    h (B, T, D) the normed final hidden state, w (D, Vp) the lm_head kernel (cast to h's
    dtype), targets (B, T) int with -1 ignored -> (B, T) fp32, 0 at ignored positions.
    Columns >= vocab_size (padding) are excluded from the softmax.
    """
    c = _chunks(h, chunk_tokens)
    w = _gathered(w.astype(h.dtype))

    def step(carry, chunk):
        h_c, t_c = chunk
        return carry, _chunk_nll(h_c, w, t_c, vocab_size, cap)[0]

    _, nll = jax.lax.scan(step, None, (_by_chunks(h, c), _by_chunks(targets, c)))
    return _from_chunks(nll)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def mean_nll(
    h: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, cap: float, chunk_tokens: int
) -> jax.Array:
    """Mean of `token_nll` over the valid targets (targets >= 0): a scalar fp32.

    Differentiable in h (B, T, D) and w (D, Vp); the gradient of w has w's dtype, accumulated
    in fp32 over the chunks.
    """
    valid = targets >= 0
    nll = token_nll(h, w, targets, vocab_size, cap, chunk_tokens)
    return nll.sum() / jnp.maximum(valid.sum(), 1)


def _mean_nll_fwd(h, w, targets, vocab_size, cap, chunk_tokens):
    """The loss and its gradients in one scan over the chunks."""
    c = _chunks(h, chunk_tokens)
    valid = targets >= 0
    weight = 1.0 / jnp.maximum(valid.sum(), 1).astype(jnp.float32)
    w_compute = _gathered(w.astype(h.dtype))

    def step(dw, chunk):
        h_c, t_c = chunk
        nll, probs, tanh = _chunk_nll(h_c, w_compute, t_c, vocab_size, cap)
        # d loss / d capped logit = weight * (probs - onehot) at valid targets; through the
        # softcap, d capped / d logit = 1 - tanh^2.
        onehot = jnp.arange(w.shape[1]) == t_c[..., None]
        row_weight = jnp.where(t_c >= 0, weight, 0.0)[..., None]
        d_logits = (row_weight * (probs - onehot)) * (1.0 - tanh * tanh)
        d_logits = d_logits.astype(h.dtype)
        dh = jnp.einsum("bcv,dv->bcd", d_logits, w_compute, preferred_element_type=jnp.float32)
        partial = jnp.einsum(
            "sbcd,sbcv->sdv",
            _by_shards(h_c, shards),
            _by_shards(d_logits, shards),
            preferred_element_type=jnp.float32,
        )
        return dw + partial, (nll.sum(), dh.astype(h.dtype))

    # One fp32 partial sum of the lm_head gradient per batch shard, (S, D, Vp), each on its
    # own devices: the sum over the shards (one reduction) waits for the last chunk instead
    # of costing one all-reduce of (D, Vp) per chunk.
    shards = _row_shards(h.shape[0])
    dw0 = sharding.constrain(jnp.zeros((shards, *w.shape), jnp.float32), "batch", None, "vocab")
    dw, (sums, dh) = jax.lax.scan(step, dw0, (_by_chunks(h, c), _by_chunks(targets, c)))
    return sums.sum() * weight, (_from_chunks(dh), dw.sum(0).astype(w.dtype))


def _by_shards(x: jax.Array, shards: int) -> jax.Array:
    """(B, ...) -> (S, B / S, ...), the leading axis over the batch shards (no data moves)."""
    x = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
    return sharding.constrain(x, "batch", *(None,) * (x.ndim - 1))


def _mean_nll_bwd(vocab_size, cap, chunk_tokens, residuals, g):
    dh, dw = residuals
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None


mean_nll.defvjp(_mean_nll_fwd, _mean_nll_bwd)
