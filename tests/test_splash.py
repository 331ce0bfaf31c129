"""Splash attention (Pallas, interpret mode on CPU) against XLA attention.

Interpret mode is slow, so the shapes are the smallest the kernel accepts (blocks of 128)
and everything runs jitted with cheap XLA compilation (most of the time is compiling).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_config, tiny_model, tokens

from bov_jax import sharding
from bov_jax.model import layers, spec, splash

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def qkv(batch: int, seq: int, heads: int = 2, head_dim: int = 32, seed: int = 0):
    """Random q, k, v (B, T, H, hd) with the model's QK norm and 1.2 scale."""
    q, k, v = (
        jax.random.normal(key, (batch, seq, heads, head_dim))
        for key in jax.random.split(jax.random.key(seed), 3)
    )
    return 1.2 * layers.rms_norm(q), 1.2 * layers.rms_norm(k), v


def values_and_grads(attend, q, k, v):
    """attend's output and the gradients of a random projection of it wrt q, k, v."""

    @fast_jit
    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(jax.random.normal(jax.random.key(9), out.shape))

    return run(q, k, v)


@pytest.mark.parametrize(
    ("seq", "window", "block"),
    [
        (256, 40, 128),  # window < block: empty, partial and full blocks
        (256, 150, 128),  # a window spanning two blocks
        (100, 8, None),  # short sequence, padded to 128
        (100, 1000, None),  # window past the sequence start: plain causal
    ],
)
def test_splash_matches_xla_values_and_gradients(seq, window, block):
    q, k, v = qkv(2, seq)
    xla_out, xla_grads = values_and_grads(
        lambda q, k, v: layers.attention(q, k, v, window=window, implementation="xla"), q, k, v
    )
    out, grads = values_and_grads(
        lambda q, k, v: splash.attention(q, k, v, window=window, block=block), q, k, v
    )
    np.testing.assert_allclose(out, xla_out, rtol=1e-5, atol=1e-5)
    for name, g, ref in zip("qkv", grads, xla_grads, strict=True):
        assert float(jnp.std(ref)) > 1e-2, name
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize(("seq", "window"), [(10, 3), (10, 9), (10, 20), (300, 128)])
def test_layer_mask_is_the_models_window(seq, window):
    i, j = np.indices((seq, seq))
    expected = (i - j >= 0) & (i - j <= window)
    np.testing.assert_array_equal(splash.layer_mask(seq, window)[:, :], expected)


def forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def test_model_with_splash_matches_xla():
    """A 2-layer model (windows 8 and 64, T = 64 padded to 128) on random weights; the
    kernel's gradients are checked above."""
    logits = {}
    for impl in ("xla", "splash"):
        model = tiny_model("d12_bov", depth=2, attention_impl=impl)
        randomize(model, seed=2)
        assert model.spec.windows == (8, 64)
        logits[impl] = fast_jit(forward, static_argnums=0)(*nnx.split(model), tokens(2, 64))
    assert float(jnp.std(logits["xla"])) > 0.1
    np.testing.assert_allclose(logits["splash"], logits["xla"], rtol=1e-5, atol=2e-5)


def test_sharded_splash_matches_xla_under_a_mesh():
    """Under an ambient mesh, each device runs the kernel on its rows and heads."""
    mesh = jax.make_mesh(
        (2, 1, 2),
        sharding.MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
        devices=jax.devices()[:4],
    )
    q, k, v = qkv(2, 100)
    expected = layers.attention(q, k, v, window=8, implementation="xla")
    with jax.set_mesh(mesh):
        out = fast_jit(lambda q, k, v: splash.attention(q, k, v, window=8))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_auto_attention_is_splash_on_tpu(monkeypatch):
    for backend, impl in (("tpu", "splash"), ("gpu", "cudnn"), ("cpu", "xla")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert spec.resolve_auto("attention_impl", "auto") == impl
    assert spec.resolve_auto("attention_impl", "splash") == "splash"


def test_splash_is_refused_on_gpus(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="attention_impl='splash'.*'cudnn'"):
        spec.ModelSpec.from_config(tiny_config(attention_impl="splash").model)
