"""model.table_dtype: bf16 tables with the reference's bf16 AdamW, and their checkpoints.

The NumPy transcription below is the reference's `adamw_step_fused` (spec 3.3) as its
compiled kernel runs it on bf16 tables: fp32 scalars, elements upcast to fp32, one rounding
to bf16 per stored buffer (exp_avg, exp_avg_sq, the parameter). Parameters must agree bit
for bit; moments bit for bit up to FMA contraction (see the first test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tiny_config, tiny_model

from bov_jax.model.spec import ModelSpec, resolve_auto
from bov_jax.train import optim
from bov_jax.train.checkpoint import Checkpoints
from bov_jax.train.state import TrainState

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def reference_bf16_adamw(p, grads, lrs, *, betas, wd, eps=1e-10):
    """(p, exp_avg, exp_avg_sq) after `adamw_step_fused` on bf16 p for each (grad, lr)."""
    b1, b2 = F32(betas[0]), F32(betas[1])
    m1, m2 = np.zeros_like(p), np.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        lr, g32 = F32(lr), g.astype(F32)
        decayed = p.astype(F32) * (F32(1) - lr * F32(wd))
        m1_32 = m1.astype(F32) + (F32(1) - b1) * (g32 - m1.astype(F32))
        m2_32 = m2.astype(F32) + (F32(1) - b2) * (g32 * g32 - m2.astype(F32))
        bias1, bias2 = F32(1) - b1 ** F32(t), F32(1) - b2 ** F32(t)
        denom = np.sqrt(m2_32 / bias2) + F32(eps)
        p = (decayed - (lr / bias1) * (m1_32 / denom)).astype(BF16)
        m1, m2 = m1_32.astype(BF16), m2_32.astype(BF16)
    return p, m1, m2


def run_adamw(p, grads, lrs, *, betas, wd):
    """Our `nanochat_adamw` (jitted, as in training) on the same inputs."""
    lr_table = jnp.asarray(lrs, jnp.float32)
    tx = optim.nanochat_adamw(
        lambda step: lr_table[step], b1=betas[0], b2=betas[1], eps=1e-10, weight_decay=wd
    )
    params = {"table": jnp.asarray(p)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, grad):
        updates, state = tx.update({"table": grad}, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, jnp.asarray(g))
    return params["table"], state


def bits(x) -> np.ndarray:
    return np.asarray(x).astype(BF16).view(np.uint16)


def test_bf16_adamw_steps_equal_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    shape = (64, 48)
    p = (0.8 * rng.standard_normal(shape)).astype(BF16)
    grads = [(1e-3 * rng.standard_normal(shape)).astype(BF16) for _ in range(4)]
    lrs = [0.15, 0.3, 0.3, 0.02]  # warmup, peak, warmdown-sized steps
    betas, wd = (0.8, 0.995), 0.01
    ours, state = run_adamw(p, grads, lrs, betas=betas, wd=wd)
    want_p, want_m1, want_m2 = reference_bf16_adamw(p, grads, lrs, betas=betas, wd=wd)
    assert ours.dtype == jnp.bfloat16
    assert state.mu["table"].dtype == jnp.bfloat16 and state.nu["table"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(ours), bits(want_p))
    # The moments' fp32 lerp may be contracted to an FMA (by XLA here, by Triton in the
    # reference): a rare element then rounds one bf16 ulp apart, or differs at the fp32
    # cancellation floor of m + w (g - m) (|m| ~ 1e-11 against gradients ~ 1e-3).
    floor = 2.0**-20 * max(float(np.abs(g.astype(F32)).max()) for g in grads)
    for name, got, want in (("exp_avg", state.mu, want_m1), ("exp_avg_sq", state.nu, want_m2)):
        got_bits, want_bits = bits(got["table"]), bits(want)
        assert np.mean(got_bits == want_bits) > 0.999, name
        apart = np.abs(got_bits.astype(np.int32) - want_bits.astype(np.int32))
        diff = np.abs(np.asarray(got["table"]).astype(F32) - want.astype(F32))
        assert np.all((apart <= 1) | (diff < floor)), name
    assert np.mean(bits(ours) != bits(p)) > 0.5  # the steps did move the table


def test_tiny_updates_are_swallowed_exactly_where_the_reference_swallows_them():
    """Steps below half a bf16 ulp of |p| leave p unchanged; fp32 tables keep them."""
    rng = np.random.default_rng(1)
    magnitudes = np.logspace(-3, 1, 64)
    p = (magnitudes * rng.choice([-1.0, 1.0], 64)).astype(BF16)[None, :].repeat(16, 0)
    grads = [rng.standard_normal(p.shape).astype(BF16)]
    betas = (0.8, 0.995)
    for lr in (1e-3, 1e-2, 3e-2):
        ours, _ = run_adamw(p, grads, [lr], betas=betas, wd=0.0)
        want, _, _ = reference_bf16_adamw(p, grads, [lr], betas=betas, wd=0.0)
        kept, want_kept = bits(ours) == bits(p), bits(want) == bits(p)
        np.testing.assert_array_equal(kept, want_kept, err_msg=f"lr={lr}")
        assert 0 < kept.mean() < 1, f"lr={lr}: both regimes must occur"
        # The first Adam step moves each entry by about lr: kept only where lr < ulp(|p|)/2.
        half_ulp = np.spacing(np.abs(p.astype(F32)).astype(BF16)).astype(F32) / 2
        assert np.all(kept[lr < 0.9 * half_ulp]) and not np.any(kept[lr > 1.1 * half_ulp])
        fp32, _ = run_adamw(p.astype(F32), grads, [lr], betas=betas, wd=0.0)
        assert not np.any(np.asarray(fp32) == p.astype(F32))
    # The value tables' decay alone, p (1 - 0.15 x 0.01), is under half an ulp everywhere.
    zero = [np.zeros_like(p)]
    ours, _ = run_adamw(p, zero, [0.15], betas=betas, wd=0.01)
    np.testing.assert_array_equal(bits(ours), bits(p))
    fp32, _ = run_adamw(p.astype(F32), zero, [0.15], betas=betas, wd=0.01)
    assert not np.any(np.asarray(fp32) == p.astype(F32))


def test_table_dtype_applies_to_wte_and_banks_only():
    model = tiny_model("d12_bov", table_dtype="bfloat16")
    assert model.wte.embedding.dtype == jnp.bfloat16
    banks = [b.attn.value.bank for b in model.blocks if hasattr(b.attn.value, "bank")]
    assert banks and all(b.embedding.dtype == jnp.bfloat16 for b in banks)
    assert model.lm_head.kernel.dtype == jnp.float32
    assert model.blocks[0].attn.c_q.kernel.dtype == jnp.float32
    assert tiny_model("d12_bov").wte.embedding.dtype == jnp.float32  # auto on CPU


def test_table_dtype_auto_resolution_and_bad_values():
    assert resolve_auto("table_dtype", "auto") == "float32"  # the tests run on CPU
    assert resolve_auto("table_dtype", "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match=r"model.table_dtype='float16'"):
        ModelSpec.from_config(tiny_config(table_dtype="float16").model)


def test_checkpoint_restores_bf16_tables_and_their_adamw_state(tmp_path):
    model = tiny_model("d12_bov", table_dtype="bfloat16")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    adamw = optim.nanochat_adamw(lambda step: 0.1, b1=0.8, b2=0.995, eps=1e-10, weight_decay=0)
    opt_state = adamw.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    _, opt_state = adamw.update(grads, opt_state, params)
    state = TrainState(jnp.asarray(1, jnp.int32), params, opt_state, jnp.zeros(2, jnp.uint32))

    class NoStreams:
        count, iterators = 0, {}

    checkpoints = Checkpoints(tmp_path, keep=1, async_save=False)
    try:
        checkpoints.save(1, state, NoStreams(), {})
        restored = checkpoints.restore(1, state)
    finally:
        checkpoints.close()
    for tree, want in ((restored.params, params), (restored.opt_state.mu, opt_state.mu)):
        wte = tree["wte"]["embedding"]
        assert wte.dtype == jnp.bfloat16
        np.testing.assert_array_equal(bits(wte), bits(want["wte"]["embedding"]))
        assert tree["lm_head"]["kernel"].dtype == jnp.float32
