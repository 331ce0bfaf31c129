"""The language-model loss without the full logits: lm_head + softcap + cross-entropy over
chunks of tokens.

Shapes: B rows, T time, D width, V vocabulary, Vp the padded vocabulary (lm_head columns),
c the chunk length along T (a divisor of T). Per chunk the fp32 logits (B, c, Vp) exist only
inside one iteration of a `lax.scan`; the (B, T, Vp) logits and their gradient never do.

`token_nll` gives per-token nats (eval, BPB). `mean_nll` is the training loss; its custom VJP
computes the gradient during the forward scan (one pass over the vocabulary instead of a
forward pass and a recomputing backward pass): the loss is a mean, so its cotangent is one
scalar that scales the stored gradients. Both read the same per-chunk math, `_chunk_nll`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# exp(cap) must stay finite in fp32 (exp(88.7) overflows): the softmax skips the max shift.
MAX_CAP = 80.0


def chunk_length(rows: int, time: int, chunk_tokens: int) -> int:
    """The largest divisor c of `time` with rows * c <= chunk_tokens (at least 1)."""
    best = 1
    for c in range(1, time + 1):
        if time % c == 0 and rows * c <= chunk_tokens:
            best = c
    return best


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
    logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
    tanh = jnp.tanh(logits / cap)
    live = jnp.arange(w.shape[1]) < vocab_size
    # |cap * tanh| <= cap, so the softmax needs no max subtraction.
    exp = jnp.where(live, jnp.exp(cap * tanh), 0.0)
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
    c = chunk_length(h.shape[0], h.shape[1], chunk_tokens)
    w = w.astype(h.dtype)

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
    c = chunk_length(h.shape[0], h.shape[1], chunk_tokens)
    valid = targets >= 0
    weight = 1.0 / jnp.maximum(valid.sum(), 1).astype(jnp.float32)
    w_compute = w.astype(h.dtype)

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
        dw = dw + jnp.einsum("bcd,bcv->dv", h_c, d_logits, preferred_element_type=jnp.float32)
        return dw, (nll.sum(), dh.astype(h.dtype))

    dw0 = jnp.zeros(w.shape, jnp.float32)
    dw, (sums, dh) = jax.lax.scan(step, dw0, (_by_chunks(h, c), _by_chunks(targets, c)))
    return sums.sum() * weight, (_from_chunks(dh), dw.astype(w.dtype))


def _mean_nll_bwd(vocab_size, cap, chunk_tokens, residuals, g):
    dh, dw = residuals
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), None


mean_nll.defvjp(_mean_nll_fwd, _mean_nll_bwd)
