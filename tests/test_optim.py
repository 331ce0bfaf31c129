"""Optimizer groups, the Muon step against a NumPy port of the reference, AdamW, LR scaling."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bov_jax.config import default_config
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.train import optim

# ---------------------------------------------------------------------------------------------
# Reference hyper-parameters (spec 3.1 CLI defaults, 3.2, 3.5), independent of bov_jax/config.py.

REFERENCE_OPTIM = dict(
    embedding_lr=0.3,
    unembedding_lr=0.008,
    matrix_lr=0.02,
    scalar_lr=0.5,
    smear_lr=0.2,
    value_table_lr_mult=0.5,
    alpha_lr_mult=0.01,
    adam_eps=1e-10,
    embedding_betas=(0.8, 0.995),
    unembedding_betas=(0.8, 0.96),
    value_table_betas=(0.8, 0.995),
    smear_betas=(0.8, 0.95),
    alpha_betas=(0.8, 0.95),
    beta_betas=(0.96, 0.95),
    embedding_wd=0.001,
    unembedding_wd=0.01,
    value_table_wd=0.01,
    alpha_wd=0.05,
    muon_ns_steps=5,
    muon_beta2=0.9,
    muon_momentum_start=0.85,
    muon_momentum=0.97,
    muon_momentum_end=0.90,
    muon_momentum_warmup_steps=400,
    warmup_steps=40,
    warmdown_ratio=0.65,
    final_lr_frac=0.05,
    reference_d_model=768,
)


def reference_cfg() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(REFERENCE_OPTIM)


def test_default_config_optim_is_the_reference():
    optim_cfg = default_config().optim
    assert {key: optim_cfg[key] for key in REFERENCE_OPTIM} == REFERENCE_OPTIM


# ---------------------------------------------------------------------------------------------
# Parameter trees with the model's paths and Flax (in, out) shapes.

D, KV, V, H = 32, 32, 50, 2


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


def gpt_tree(
    depth: int = 4,
    targets: tuple[int, ...] = (),
    *,
    target_c_v: bool = True,
    bank: bool = False,
    shared_bank: bool = False,
    coeffs: tuple[str, ...] = (),
    ve_gate: bool = False,
) -> dict:
    """A parameter tree as from nnx.to_pure_dict(nnx.state(GPT, nnx.Param))."""
    blocks = {}
    for i in range(depth):
        value = {}
        if i not in targets or target_c_v:
            value["c_v"] = {"kernel": zeros(D, KV)}
        if i in targets:
            for name in coeffs:
                value[name] = zeros(1)
            if bank and (not shared_bank or i == targets[0]):
                value["bank"] = {"embedding": zeros(V, KV)}
            if ve_gate:
                value["ve_gate"] = {"kernel": zeros(12, H)}
        blocks[i] = {
            "attn": {
                "c_q": {"kernel": zeros(D, KV)},
                "c_k": {"kernel": zeros(D, KV)},
                "c_proj": {"kernel": zeros(KV, D)},
                "value": value,
            },
            "mlp": {
                "c_fc": {"kernel": zeros(D, 4 * D)},
                "c_proj": {"kernel": zeros(4 * D, D)},
            },
        }
    return {
        "wte": {"embedding": zeros(V, D)},
        "smear_gate": {"kernel": zeros(24, 1)},
        "smear_lambda": zeros(1),
        "blocks": blocks,
        "lm_head": {"kernel": zeros(D, V)},
    }


TREES = {
    "baseline": gpt_tree(),
    "bov": gpt_tree(targets=(2, 3), target_c_v=False, bank=True, coeffs=("gamma",)),
    "bov_shared": gpt_tree(
        targets=(2, 3), target_c_v=False, bank=True, shared_bank=True, coeffs=("gamma",)
    ),
    "add_value_emb_learn": gpt_tree(targets=(2, 3), bank=True, coeffs=("alpha", "beta")),
    "nanogpt_every2": gpt_tree(targets=(1, 3), bank=True, ve_gate=True),
}

EXPECTED_COUNTS = {  # group -> number of parameters, per tree
    "baseline": dict(muon=24, embedding=1, unembedding=1, smear=2),
    "bov": dict(muon=22, embedding=1, unembedding=1, smear=2, value_table=2, beta=2),
    "bov_shared": dict(muon=22, embedding=1, unembedding=1, smear=2, value_table=1, beta=2),
    "add_value_emb_learn": dict(
        muon=24, embedding=1, unembedding=1, smear=2, value_table=2, alpha=2, beta=2
    ),
    "nanogpt_every2": dict(muon=26, embedding=1, unembedding=1, smear=2, value_table=2),
}


def flat_labels(tree: dict) -> dict[str, str]:
    labels = optim.param_labels(tree)
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): label
        for path, label in jax.tree_util.tree_leaves_with_path(labels)
    }


@pytest.mark.parametrize("name", TREES)
def test_every_parameter_gets_exactly_one_expected_label(name):
    labels = flat_labels(TREES[name])
    assert len(labels) == len(jax.tree.leaves(TREES[name]))
    counts = {group: list(labels.values()).count(group) for group in optim.GROUPS}
    assert {g: n for g, n in counts.items() if n} == EXPECTED_COUNTS[name]
    for path, label in labels.items():
        if "/bank/" in path:
            assert label == "value_table", path
        if path.endswith("/kernel") and path.startswith("blocks/"):
            assert label == "muon", path
    assert labels["wte/embedding"] == "embedding"
    assert labels["lm_head/kernel"] == "unembedding"


REAL_MODEL_COUNTS = {  # the model's own trees for a few presets (depth 12 or 24, tiny width)
    "d12": dict(muon=72, embedding=1, unembedding=1, smear=2),
    "d12_bov": dict(muon=68, embedding=1, unembedding=1, smear=2, value_table=4, beta=4),
    "d12_bov_shared": dict(muon=68, embedding=1, unembedding=1, smear=2, value_table=1, beta=4),
    "d12_add_v1_learn": dict(muon=72, embedding=1, unembedding=1, smear=2, alpha=4, beta=4),
    "d24_ve_gated": dict(muon=156, embedding=1, unembedding=1, smear=2, value_table=12),
}


@pytest.mark.parametrize("preset", REAL_MODEL_COUNTS)
def test_real_model_parameters_are_all_labelled(preset):
    spec = ModelSpec.from_config(tiny_config(preset).model)
    abstract = nnx.eval_shape(lambda: GPT(spec, seed=0))
    labels = flat_labels(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    counts = {group: list(labels.values()).count(group) for group in optim.GROUPS}
    assert {g: n for g, n in counts.items() if n} == REAL_MODEL_COUNTS[preset]


def test_labels_of_each_coefficient_and_nnx_state_paths():
    assert optim.param_label("blocks/9/attn/value/alpha") == "alpha"
    assert optim.param_label("blocks/9/attn/value/beta") == "beta"
    assert optim.param_label("blocks/9/attn/value/gamma") == "beta"
    assert optim.param_label("blocks/11/attn/value/ve_gate/kernel") == "muon"
    # An nnx.State of Variables flattens with a trailing '/value'.
    assert optim.param_label("blocks/0/attn/value/bank/embedding/value") == "value_table"


@pytest.mark.parametrize(
    "path",
    [
        "blocks/0/attn/value/lambda_v",
        "blocks/0/attn/c_q/bias",
        "blocks/x/mlp/c_fc/kernel",
        "wte/kernel",
        "bank/embedding",
        "blocks/0/attn/value",
    ],
)
def test_unknown_paths_raise_naming_the_path(path):
    with pytest.raises(ValueError, match=path):
        optim.param_label(path)


def test_unknown_parameter_fails_when_building_the_optimizer():
    tree = gpt_tree()
    tree["blocks"][1]["attn"]["q_norm"] = {"scale": np.ones((D,), np.float32)}
    with pytest.raises(ValueError, match="blocks/1/attn/q_norm/scale"):
        build(tree)


# ---------------------------------------------------------------------------------------------
# Learning rates (spec 3.1).


@pytest.mark.parametrize(
    "d_model, batch_scale, expected",
    [
        (
            768,
            1.0,
            dict(
                muon=0.02,
                embedding=0.3,
                unembedding=0.008,
                value_table=0.15,
                smear=0.2,
                alpha=0.005,
                beta=0.5,
            ),
        ),
        (
            1536,
            math.sqrt(2),
            dict(
                muon=0.028284,
                embedding=0.3,
                unembedding=0.008,
                value_table=0.15,
                smear=0.2,
                alpha=0.0070711,
                beta=0.70711,
            ),
        ),
    ],
    ids=["d12", "d24"],
)
def test_effective_learning_rates_match_spec(d_model, batch_scale, expected):
    lrs = optim.effective_learning_rates(
        reference_cfg(), d_model=d_model, batch_lr_scale=batch_scale
    )
    assert lrs == pytest.approx(expected, rel=2e-5)
    # c_fc, (d, 4d) in Flax: 0.04 at d12, 0.056569 at d24.
    c_fc = lrs["muon"] * optim.muon_lr_factor((d_model, 4 * d_model))
    assert c_fc == pytest.approx(2 * expected["muon"], rel=2e-5)
    assert optim.muon_lr_factor((4 * d_model, d_model)) == 1.0


# ---------------------------------------------------------------------------------------------
# Muon against a NumPy port of `muon_step_fused`, written in torch (out, in) orientation.


def bf16(x) -> np.ndarray:
    """Round to bf16, keep as float32 (the reference's bf16 tensors)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def reference_polar_express(g: np.ndarray, ns_steps: int = 5) -> np.ndarray:
    """g: (out, in) torch orientation; bf16 operands and matmul outputs, fp32 accumulation."""
    x = bf16(g)
    x = bf16(x / (np.linalg.norm(x) * 1.01 + 1e-6))
    tall = x.shape[0] > x.shape[1]
    for a, b, c in optim.POLAR_EXPRESS_COEFFS[:ns_steps]:
        if tall:
            gram = bf16(x.T @ x)
            x = bf16(a * x + bf16(x @ bf16(b * gram + c * bf16(gram @ gram))))
        else:
            gram = bf16(x @ x.T)
            x = bf16(a * x + bf16(bf16(b * gram + c * bf16(gram @ gram)) @ x))
    return x


def reference_muon_step(w, g, buf, buf2, *, momentum, lr, wd, beta2):
    """One `muon_step_fused` for a single (out, in) matrix. Returns (w, buf, buf2)."""
    m = np.float32(momentum)
    buf = buf + (1 - m) * (g - buf)
    g = g + m * (buf - g)
    x = reference_polar_express(g)
    out_dim, in_dim = x.shape
    red_dim = -1 if out_dim >= in_dim else -2
    v_mean = np.mean(x * x, axis=red_dim, keepdims=True)
    size = x.shape[red_dim]
    v_norm = np.sqrt(v_mean.sum() * size)
    buf2 = buf2 + (1 - bf16(beta2)) * (v_mean - buf2)
    step = 1 / np.sqrt(np.maximum(buf2, 1e-10))
    v_norm_new = np.sqrt(np.sum(v_mean * size * step**2))
    x = x * bf16(step * (v_norm / max(v_norm_new, 1e-10)))
    lr = bf16(np.float32(lr) * np.float32(math.sqrt(max(1, out_dim / in_dim))))
    mask = (x * w) >= 0
    return w - (lr * x + lr * bf16(wd) * w * mask), buf, buf2


MUON_HYPER = dict(momentum=0.9, lr=0.02, wd=0.2, beta2=0.9)


def muon_tx():
    return optim.nanochat_muon(
        lambda step: jnp.float32(MUON_HYPER["lr"]),
        lambda step: jnp.float32(MUON_HYPER["momentum"]),
        lambda step: jnp.float32(MUON_HYPER["wd"]),
        beta2=MUON_HYPER["beta2"],
        ns_steps=5,
    )


def run_muon_steps(kernel, grads, buf, *, jit):
    """Muon steps on one Flax (in, out) kernel, starting from momentum buffer `buf`."""
    tx = muon_tx()
    update = jax.jit(tx.update) if jit else tx.update
    params = {"w": jnp.asarray(kernel)}
    state = tx.init(params)._replace(momentum={"w": jnp.asarray(buf)})
    for grad in grads:
        updates, state = update({"w": jnp.asarray(grad)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return np.asarray(params["w"]), state


def reference_steps(kernel, grads, buf):
    """The NumPy reference on the transposed (torch) matrices; returns Flax orientation."""
    w, b = kernel.T, buf.T
    out_dim, in_dim = w.shape
    b2 = np.zeros((out_dim, 1) if out_dim >= in_dim else (1, in_dim), np.float32)
    for grad in grads:
        w, b, b2 = reference_muon_step(w, grad.T, b, b2, **MUON_HYPER)
    return w.T, b.T, b2.T


def random_case(fan_in, fan_out, n_steps, seed=0):
    rng = np.random.default_rng(seed)
    kernel = (0.05 * rng.standard_normal((fan_in, fan_out))).astype(np.float32)
    grads = [rng.standard_normal((fan_in, fan_out)).astype(np.float32) for _ in range(n_steps)]
    buf = (0.5 * rng.standard_normal((fan_in, fan_out))).astype(np.float32)
    return kernel, grads, buf


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


SHAPES = [(64, 128), (128, 64), (96, 96), (12, 4)]  # (in, out): wide, tall, square, ve_gate


@pytest.mark.parametrize("fan_in, fan_out", SHAPES)
def test_muon_steps_match_numpy_reference_op_by_op(fan_in, fan_out):
    """Eager dispatch rounds every bf16 intermediate as the reference does: near bit-exact."""
    kernel, grads, buf = random_case(fan_in, fan_out, n_steps=2)
    new_kernel, state = run_muon_steps(kernel, grads, buf, jit=False)
    ref_kernel, ref_buf, ref_buf2 = reference_steps(kernel, grads, buf)
    assert rel_err(new_kernel - kernel, ref_kernel - kernel) < 1e-2
    np.testing.assert_allclose(state.momentum["w"], ref_buf, rtol=1e-5, atol=1e-6)
    assert state.second_moment["w"].shape == ref_buf2.shape
    assert rel_err(np.asarray(state.second_moment["w"]), ref_buf2) < 1e-2


@pytest.mark.parametrize("fan_in, fan_out", SHAPES[:3])
def test_one_jitted_muon_step_matches_numpy_reference(fan_in, fan_out):
    """Under jit XLA may keep excess precision in the bf16 Polar Express (the reference's
    torch.compile kernels do likewise), so compare at bf16 orthogonalisation noise (~3 % for
    these shapes; up to ~15 % for a 12 x 4 matrix, which the op-by-op test covers)."""
    kernel, grads, buf = random_case(fan_in, fan_out, n_steps=1, seed=1)
    new_kernel, _ = run_muon_steps(kernel, grads, buf, jit=True)
    ref_kernel, _, _ = reference_steps(kernel, grads, buf)
    assert rel_err(new_kernel - kernel, ref_kernel - kernel) < 0.1


def polar_express_band(lowest: float) -> tuple[float, float]:
    """Range of the 5-step Polar Express polynomial over singular values in [lowest, 1]."""
    s = np.geomspace(lowest, 1.0, 100_001)
    for a, b, c in optim.POLAR_EXPRESS_COEFFS:
        s = a * s + b * s**3 + c * s**5
    return float(s.min()), float(s.max())


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (192, 768)])
def test_polar_express_singular_values_in_reference_band(shape):
    g = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    sv = np.linalg.svd(np.asarray(g, np.float64), compute_uv=False)
    lo, hi = polar_express_band(sv.min() / (1.01 * np.linalg.norm(sv)))
    # The band of these coefficients is about [0.859, 1.141] for any singular value
    # above 1e-3 of the Frobenius norm.
    assert 0.85 < lo < 0.87 and 1.13 < hi < 1.15
    x = jax.jit(optim.polar_express, static_argnums=1)(g, 5)
    assert x.dtype == jnp.bfloat16 and x.shape == shape
    out = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    assert lo - 0.02 < out.min() and out.max() < hi + 0.02
    assert out.min() > 0.7 and out.max() < 1.2


def test_polar_express_matches_numpy_port():
    g = np.asarray(jax.random.normal(jax.random.key(1), (48, 80), jnp.float32))
    x = np.asarray(optim.polar_express(jnp.asarray(g), 5), np.float32)
    assert rel_err(x, reference_polar_express(g.T).T) < 1e-2


@pytest.mark.parametrize("jit", [False, True])
def test_muon_stacked_by_shape_equals_muon_matrix_by_matrix(jit):
    """Same-shape matrices share one batched Polar Express; each gets its own update."""
    shapes = [(64, 128), (96, 96), (64, 128), (128, 64), (96, 96), (64, 128)]
    cases = [random_case(*shape, n_steps=2, seed=10 + i) for i, shape in enumerate(shapes)]
    tx = muon_tx()
    update = jax.jit(tx.update) if jit else tx.update
    params = {f"w{i}": jnp.asarray(kernel) for i, (kernel, _, _) in enumerate(cases)}
    state = tx.init(params)._replace(
        momentum={f"w{i}": jnp.asarray(buf) for i, (_, _, buf) in enumerate(cases)}
    )
    for step in range(2):
        grads = {f"w{i}": jnp.asarray(g[step]) for i, (_, g, _) in enumerate(cases)}
        updates, state = update(grads, state, params)
        params = jax.tree.map(jnp.add, params, updates)
    # The Polar Express runs in bf16 and XLA's CPU kernels for batched and single bf16
    # matmuls round differently (under jit also with excess precision), so the two agree at
    # bf16 orthogonalisation noise (as the tests against the reference), not bit for bit;
    # the fp32 momentum, computed before, agrees exactly.
    tolerance = 5e-2 if jit else 2e-2
    for i, (kernel, grads, buf) in enumerate(cases):
        alone, alone_state = run_muon_steps(kernel, grads, buf, jit=jit)
        assert rel_err(np.asarray(params[f"w{i}"]) - kernel, alone - kernel) < tolerance
        np.testing.assert_array_equal(state.momentum[f"w{i}"], alone_state.momentum["w"])
        second = np.asarray(state.second_moment[f"w{i}"])
        assert rel_err(second, np.asarray(alone_state.second_moment["w"])) < tolerance


@pytest.mark.parametrize("dim", [0, 1])
def test_muon_on_fsdp_orthogonalises_whole_matrices_split_over_devices(dim):
    """Matrices split over fsdp along either dimension: the stack goes to the devices whole
    by an all-to-all (no all-gather) and the update equals the unsharded one (bf16 noise)."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("fsdp",))
    size = 16 * len(devices)
    shapes = {"a": (size, 48), "b": (size, 48), "c": (size, 48)}  # 3 matrices on 8 devices
    if dim == 1:
        shapes = {k: (48, size) for k in shapes}
    cases = {
        k: random_case(*shape, n_steps=1, seed=i) for i, (k, shape) in enumerate(shapes.items())
    }
    spec = PartitionSpec(*(("fsdp" if i == dim else None) for i in range(2)))

    def step(layout):
        tx = optim.nanochat_muon(
            lambda s: jnp.float32(0.02),
            lambda s: jnp.float32(0.9),
            lambda s: jnp.float32(0.2),
            beta2=0.9,
            ns_steps=5,
            layout=layout,
        )
        put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        params = {k: put(kernel) for k, (kernel, _, _) in cases.items()}
        grads = {k: put(g[0]) for k, (_, g, _) in cases.items()}
        state = tx.init(params)
        update = jax.jit(tx.update)
        text = update.lower(grads, state, params).compile().as_text()
        updates, _ = update(grads, state, params)
        return {k: np.asarray(v) for k, v in updates.items()}, text

    split, hlo = step(optim.FsdpMatrices(mesh, {k: dim for k in shapes}))
    assert "all-to-all" in hlo and "all-gather" not in hlo
    whole, _ = step(None)
    for key in shapes:
        assert rel_err(split[key], whole[key]) < 0.05


# ---------------------------------------------------------------------------------------------
# The full optimizer: AdamW groups against `adamw_step_fused`, Muon schedules, all groups.


def build(tree, num_steps=100, **kwargs):
    return optim.build_optimizer(
        reference_cfg(),
        tree,
        num_steps=num_steps,
        d_model=D,
        batch_lr_scale=1.0,
        muon_weight_decay=0.28,
        **kwargs,
    )


def reference_adamw(p, grads, *, lrs, betas, wd, eps=1e-10):
    """`adamw_step_fused` for successive grads, lrs[t] being the scheduled lr of step t."""
    b1, b2 = betas
    m1, m2 = np.zeros_like(p), np.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        p = p * (1 - lr * wd)
        m1 = m1 + (1 - b1) * (g - m1)
        m2 = m2 + (1 - b2) * (g * g - m2)
        p = p - (lr / (1 - b1**t)) * m1 / (np.sqrt(m2 / (1 - b2**t)) + eps)
    return p


def test_full_optimizer_groups_step_like_the_reference():
    tree = TREES["add_value_emb_learn"]
    rng = np.random.default_rng(3)

    def random_like(scale):
        return jax.tree.map(lambda x: scale * rng.standard_normal(x.shape, np.float32), tree)

    params = random_like(0.1)
    grads = [random_like(1.0) for _ in range(3)]
    num_steps = 100
    tx = build(params, num_steps=num_steps)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grad):
        updates, state = tx.update(grad, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    new = params
    for grad in grads:
        new, state = step(new, state, grad)

    lrs = optim.effective_learning_rates(reference_cfg(), d_model=D, batch_lr_scale=1.0)
    dmodel = (D / 768) ** -0.5
    assert lrs["embedding"] == pytest.approx(0.3 * dmodel)
    lrm = [(t + 1) / 40 for t in range(3)]  # warmup
    cases = {
        ("wte", "embedding"): ("embedding", (0.8, 0.995), 0.001),
        ("lm_head", "kernel"): ("unembedding", (0.8, 0.96), 0.01),
        ("blocks", 2, "attn", "value", "bank", "embedding"): ("value_table", (0.8, 0.995), 0.01),
        ("smear_lambda",): ("smear", (0.8, 0.95), 0.0),
        ("blocks", 3, "attn", "value", "alpha"): ("alpha", (0.8, 0.95), 0.05),
        ("blocks", 3, "attn", "value", "beta"): ("beta", (0.96, 0.95), 0.0),
    }

    def at(tree, keys):
        for k in keys:
            tree = tree[k]
        return np.asarray(tree, np.float64)

    for keys, (group, betas, wd) in cases.items():
        expected = reference_adamw(
            at(params, keys),
            [at(g, keys) for g in grads],
            lrs=[lrs[group] * m for m in lrm],
            betas=betas,
            wd=wd,
        )
        np.testing.assert_allclose(at(new, keys), expected, rtol=2e-5, atol=1e-7, err_msg=group)

    # Muon state: the schedules advance with the shared step count.
    muon_state = state.inner_states["muon"].inner_state
    assert int(muon_state.count) == 3
    c_fc = at(new, ("blocks", 0, "mlp", "c_fc", "kernel")) - at(
        params, ("blocks", 0, "mlp", "c_fc", "kernel")
    )
    assert np.all(np.isfinite(c_fc)) and np.abs(c_fc).max() > 0
