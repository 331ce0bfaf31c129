"""Model behaviour on tiny widths: shapes, causality, windows, value-path equivalences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_config, tiny_model, tokens

from bov_jax.model import layers
from bov_jax.model.gpt import GPT, ValueContext, cross_entropy, learned_coefficients
from bov_jax.model.spec import ModelSpec, window_sizes
from bov_jax.presets import PRESETS, config_for


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_and_gives_logits(preset):
    model = tiny_model(preset)
    logits = model(tokens(2, 32))
    assert logits.shape == (2, 32, 200)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.abs(logits) <= 15.0))
    assert np.isfinite(float(cross_entropy(logits, tokens(2, 32, seed=2))))
    # the logged coefficients: one per learned scalar of the value path, plus smear_lambda
    spec = PRESETS[preset].value_path
    coefficients = learned_coefficients(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    expected = {
        f"{name}/{layer}"
        for layer in model.spec.targets
        for name in spec.coefficient_names(is_target=True)
    }
    assert set(coefficients) == expected | {"smear_lambda"}


@pytest.mark.parametrize("preset", ["d12", "d12_bov", "d12_v1", "d12_add_x0_learn", "d24_ve_gated"])
def test_causal_future_tokens_change_no_earlier_logit(preset):
    model = tiny_model(preset, depth=4)
    randomize(model, seed=3)  # live output projections and smear
    ids = tokens(1, 48)
    changed = ids.at[0, 30].set((ids[0, 30] + 7) % 200)
    a, b = model(ids), model(changed)
    np.testing.assert_array_equal(np.asarray(a[0, :30]), np.asarray(b[0, :30]))
    assert float(jnp.max(jnp.abs(a[0, 30:] - b[0, 30:]))) > 1e-4


def test_short_window_layer_ignores_tokens_beyond_its_window():
    model = tiny_model("d12", depth=4, short_window=8)
    randomize(model, seed=4)
    attn = model.blocks[0].attn
    assert attn.window == 8
    x = jax.random.normal(jax.random.key(0), (1, 40, 64))
    ctx = ValueContext(token_ids=tokens(1, 40), x0n=layers.rms_norm(x), v1=None)
    cos, sin = layers.rotary_tables(40, 32, 1e5)
    base, _ = attn(x, ctx, cos, sin)
    moved, _ = attn(x.at[0, 10].add(1.0), ctx, cos, sin)
    diff = jnp.max(jnp.abs(base - moved), axis=-1)[0]
    assert float(jnp.max(diff[19:])) == 0.0  # 19 - 10 > 8: outside the window
    assert float(jnp.min(diff[10:19])) > 0.0  # within 8 positions: inside it
    long_attn = model.blocks[3].attn  # the last layer is always long
    base, _ = long_attn(x, ctx, cos, sin)
    moved, _ = long_attn(x.at[0, 10].add(1.0), ctx, cos, sin)
    assert float(jnp.max(jnp.abs(base - moved)[0, 39])) > 0.0


def test_target_layers_and_windows_match_the_reference():
    def spec(name):
        return ModelSpec.from_config(config_for(name).model)

    assert spec("d12_bov").targets == (8, 9, 10, 11)
    assert spec("d24_bov").targets == tuple(range(16, 24))
    assert spec("d12_v1_every_layer").targets == tuple(range(1, 12))
    assert spec("d12_bov_every_layer").targets == tuple(range(12))
    assert spec("d12_x0_learn_every2").targets == (1, 3, 5, 7, 9, 11)
    assert spec("d24_ve_gated").targets == tuple(range(1, 24, 2))
    assert spec("d12").targets == ()
    d12 = spec("d12")
    assert (d12.d_model, d12.n_head, d12.padded_vocab) == (768, 6, 32768)
    assert d12.windows == (512, 512, 512, 2048) * 3
    d24 = spec("d24")
    assert (d24.d_model, d24.n_head) == (1536, 12)
    assert [i for i, w in enumerate(d24.windows) if w == 2048] == [3, 7, 11, 15, 19, 23]
    assert window_sizes(6, "SSSL", 2048)[-1] == 2048  # last layer forced long


def _values_at_targets(model: GPT, ids: jax.Array) -> dict[int, jax.Array]:
    """Each target layer's value vectors (B, T, K), recomputed from the forward."""
    x = model.smear(model.embed(ids))
    ctx = ValueContext(token_ids=ids, x0n=layers.rms_norm(x), v1=None)
    cos, sin = layers.rotary_tables(ids.shape[1], 32, 1e5)
    out = {}
    for i, block in enumerate(model.blocks):
        if block.attn.value.is_target:
            out[i] = block.attn.value(layers.rms_norm(x), ctx)
        x, v = block(x, ctx, cos, sin)
        if i == 0:
            ctx = ctx._replace(v1=v)
    return out


def test_bov_at_init_equals_x0_learned_at_init():
    ids = tokens(2, 32)
    bov, x0 = tiny_model("d12_bov", depth=6), tiny_model("d12_x0_learn", depth=6)
    v_bov, v_x0 = _values_at_targets(bov, ids), _values_at_targets(x0, ids)
    assert sorted(v_bov) == sorted(v_x0) == [4, 5]
    for layer in v_bov:
        np.testing.assert_allclose(v_bov[layer], v_x0[layer], rtol=1e-5, atol=1e-6)
    for model in (bov, x0):
        randomize(model, seed=5, only="c_proj")  # same random output projections
    np.testing.assert_allclose(bov(ids), x0(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "preset", ["d12_v_learn", "d12_add_v1_learn", "d12_add_x0_learn", "d12_bov_add_v"]
)
def test_learned_add_variants_at_init_equal_the_baseline(preset):
    ids = tokens(2, 32)
    base, variant = tiny_model("d12", depth=6), tiny_model(preset, depth=6)
    for model in (base, variant):
        randomize(model, seed=6, only="c_proj")
    out_base, out_variant = base(ids), variant(ids)
    assert float(jnp.std(out_base)) > 1e-3  # the random projections make every block live
    np.testing.assert_allclose(out_variant, out_base, rtol=1e-5, atol=1e-6)


def test_bank_gradient_touches_only_rows_of_present_tokens():
    model = tiny_model("d12_bov", depth=3)
    randomize(model, seed=7, only="c_proj")
    ids = jnp.array([[5, 9, 9, 17, 5, 100, 3, 42]])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return cross_entropy(nnx.merge(graphdef, p, rest)(ids[:, :-1]), ids[:, 1:])

    grads = jax.grad(loss)(params)
    bank_grad = nnx.to_pure_dict(grads)["blocks"][2]["attn"]["value"]["bank"]["embedding"]
    touched = np.nonzero(np.abs(np.asarray(bank_grad)).sum(axis=1))[0]
    assert set(touched.tolist()) == {5, 9, 17, 100, 3}


def test_shared_bank_is_one_table_and_bov_layers_have_no_value_projection():
    model = tiny_model("d12_bov_shared")
    banks = {id(b.attn.value.bank) for b in model.blocks if b.attn.value.is_target}
    assert len(banks) == 1
    assert not hasattr(model.blocks[8].attn.value, "c_v")
    assert hasattr(model.blocks[7].attn.value, "c_v")
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert sum("bank" in path for path, _ in flat) == 1


def test_model_parameter_count_matches_accounting():
    from bov_jax.accounting import param_counts

    for preset in PRESETS:
        config = tiny_config(preset)
        model = GPT(ModelSpec.from_config(config.model))
        held = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert held == param_counts(model.spec).total, preset


def test_per_token_loss_ignores_minus_one():
    logits = jax.random.normal(jax.random.key(0), (1, 4, 10))
    targets = jnp.array([[1, -1, 3, -1]])
    per_token = cross_entropy(logits, targets, reduction="none")
    assert per_token[0, 1] == 0.0 and per_token[0, 3] == 0.0
    np.testing.assert_allclose(cross_entropy(logits, targets), per_token.sum() / 2, rtol=1e-6)


def test_same_seed_same_model_and_different_seed_differs():
    a, b, c = (
        tiny_model("d12_bov", seed=1),
        tiny_model("d12_bov", seed=1),
        tiny_model("d12_bov", seed=2),
    )
    la = jax.tree.leaves(nnx.state(a, nnx.Param))
    assert all(
        bool(jnp.array_equal(x, y)) for x, y in zip(la, jax.tree.leaves(nnx.state(b, nnx.Param)))
    )
    assert not bool(jnp.array_equal(a.wte.embedding[...], c.wte.embedding[...]))


def test_init_statistics_follow_the_reference():
    model = tiny_model("d12_bov")
    s = (3**0.5) / 8.0  # sqrt(3 / 64)
    attn = model.blocks[0].attn
    assert float(jnp.max(jnp.abs(attn.c_q.kernel[...]))) <= s
    assert float(jnp.max(jnp.abs(model.blocks[0].mlp.c_fc.kernel[...]))) <= 0.4 * s
    assert float(jnp.abs(attn.c_proj.kernel[...]).max()) == 0.0
    assert float(jnp.abs(model.blocks[0].mlp.c_proj.kernel[...]).max()) == 0.0
    assert abs(float(jnp.std(model.wte.embedding[...])) - 0.8) < 0.02
    assert abs(float(jnp.std(model.lm_head.kernel[...])) - 0.001) < 1e-4
    assert float(model.smear_lambda[0]) == 0.0
    assert float(model.blocks[8].attn.value.gamma[0]) == 1.0


def test_rotary_tables_are_exact_constants_shared_by_forward_and_decode():
    cos, sin = layers.rotary_tables(2048, 128, 1e5)
    # the reference's fp32 angles t * inv_freq, inv_freq = 1 / base^(2j / hd); cos in fp64
    inv_freq = 1 / np.float32(1e5) ** (np.arange(0, 128, 2, dtype=np.float32) / np.float32(128))
    angles = (np.arange(2048, dtype=np.float32)[:, None] * inv_freq).astype(np.float64)
    assert cos.shape == sin.shape == (2048, 64) and cos.dtype == np.float32
    assert np.abs(cos - np.cos(angles)).max() < 1e-6
    assert np.abs(sin - np.sin(angles)).max() < 1e-6
    positions = jnp.array([[0, 5, 2047], [7, 8, 9]])
    cos_at, sin_at = layers.rotary_at((cos, sin), positions)
    np.testing.assert_array_equal(np.asarray(cos_at), cos[np.asarray(positions)])
    np.testing.assert_array_equal(np.asarray(sin_at), sin[np.asarray(positions)])


def test_compiled_forward_computes_no_cos_or_sin():
    """The rotary tables are constants: no element of q or k recomputes a cosine."""
    model = tiny_model("d12_bov", depth=4)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    hlo = forward.lower(state, tokens(2, 32)).compile().as_text()
    assert "cosine(" not in hlo and "sine(" not in hlo
