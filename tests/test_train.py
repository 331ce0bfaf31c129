"""The jitted train step: accumulation, sharded vs single device, labels, validation.

Batches come from an in-memory token source defined here (tests only); the real loop
reads the data pipeline.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_config, tiny_model

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.config import validate_config
from bov_jax.model.tables import embedding_paths
from bov_jax.train import fsdp
from bov_jax.train.optim import param_labels
from bov_jax.train.state import all_finite, create_train_state
from bov_jax.train.step import accumulate_gradients, make_train_step


def in_memory_batches(steps: int, accum: int, rows: int, seq_len: int, vocab: int, seed=0):
    """Random token batches {inputs, targets}: (accum, rows, T) each, targets shifted by one."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, vocab, size=(accum, rows, seq_len + 1), dtype=np.int32)
        yield {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}


def train_config(preset="d12_bov"):
    config = tiny_config(preset, depth=4, seq_len=32)
    config.train.num_steps = 10
    config.train.total_batch_tokens = 16 * 32
    config.train.device_batch_size = 2
    return config


def test_gradient_accumulation_equals_one_big_batch():
    model = tiny_model("d12_bov", depth=4)
    randomize(model, seed=1)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    batch = next(in_memory_batches(1, 1, 8, 64, 200))
    loss_one, grads_one = accumulate_gradients(graphdef, params, batch["inputs"], batch["targets"])
    split = {k: v.reshape(4, 2, 64) for k, v in batch.items()}
    loss_four, grads_four = accumulate_gradients(
        graphdef, params, split["inputs"], split["targets"]
    )
    np.testing.assert_allclose(loss_four, loss_one, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_four), jax.tree.leaves(grads_one)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)


def bf16_casts(jaxpr, in_scan: bool = False) -> list[tuple[bool, tuple[int, ...]]]:
    """(inside a scan?, operand shape) of every f32 -> bf16 cast of a jaxpr, recursively."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            aval = eqn.invars[0].aval
            if aval.dtype == jnp.float32 and eqn.params["new_dtype"] == jnp.bfloat16:
                found.append((in_scan, tuple(aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += bf16_casts(sub, in_scan or eqn.primitive.name == "scan")
    return found


def test_bf16_step_casts_each_kernel_once_with_the_per_use_gradients():
    """In bf16 compute, accumulate_gradients casts the dense kernels before its scan over
    micro-batches, and its gradient equals the per-micro-batch autodiff gradients of the model
    as stored (each nnx.Linear casting its fp32 kernel at use), summed in order."""
    model = tiny_model("d12_bov", depth=4, compute_dtype="bfloat16", vocab_size=300)
    randomize(model, seed=3)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    batch = next(in_memory_batches(1, 4, 2, 64, 300))
    loss, grads = jax.jit(accumulate_gradients, static_argnums=0)(
        graphdef, params, batch["inputs"], batch["targets"]
    )

    def loss_fn(graphdef, params, inputs, targets):  # one micro-batch, plain autodiff
        return nnx.merge(graphdef, params).loss(inputs, targets)

    micro = jax.jit(jax.value_and_grad(loss_fn, argnums=1), static_argnums=0)
    losses, total = [], jax.tree.map(jnp.zeros_like, params)
    for i in range(4):
        loss_i, grads_i = micro(graphdef, params, batch["inputs"][i], batch["targets"][i])
        losses.append(loss_i)
        total = jax.tree.map(jnp.add, total, grads_i)
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-6)
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(total), strict=True
    ):
        assert got.dtype == jnp.float32, jax.tree_util.keystr(path)
        np.testing.assert_allclose(got, want / 4, rtol=1e-5, atol=1e-9, err_msg=str(path))

    jaxpr = jax.make_jaxpr(accumulate_gradients, static_argnums=0)(
        graphdef, params, batch["inputs"], batch["targets"]
    )
    casts = bf16_casts(jaxpr.jaxpr)
    kernels = {(64, 64), (64, 256), (256, 64)}  # attention and MLP; lm_head is (64, 320)
    assert kernels <= {shape for in_scan, shape in casts if not in_scan}
    assert not kernels & {shape for in_scan, shape in casts if in_scan}


def table_writes(jaxpr, shape: tuple[int, ...], in_scan: bool = False) -> list[tuple[bool, str]]:
    """(inside a scan?, primitive) of every op of a jaxpr, recursively, whose result has
    `shape` (a table's)."""
    found = []
    for eqn in jaxpr.eqns:
        if any(tuple(v.aval.shape) == shape for v in eqn.outvars):
            found.append((in_scan, eqn.primitive.name))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += table_writes(sub, shape, in_scan or eqn.primitive.name == "scan")
    return found


@pytest.mark.parametrize("preset", ["d12_bov", "d12_bov_shared"])
def test_tables_gradient_by_rows_equals_autodiffs_dense_gradient(preset):
    """fsdp.accumulate's gradient of the token-id tables, added into the running sum by id,
    equals autodiff's dense per-micro-batch table gradients summed in the tables' dtype
    (bf16 here, to a bf16 rounding), with every other gradient unchanged; and inside the
    scan over micro-batches no op but the in-place scatter-add of each table's rows makes a
    table-sized array."""
    model = tiny_model(
        preset, depth=4, compute_dtype="bfloat16", table_dtype="bfloat16", vocab_size=300
    )  # tables (320, 64): no other parameter has their shape
    randomize(model, seed=5)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    batch = next(in_memory_batches(1, 3, 4, 64, 300))
    shares = jnp.full((3,), 1 / 3, jnp.float32)

    def gradients(by_rows):
        return jax.jit(
            lambda p, i, t: fsdp.accumulate(graphdef, p, i, t, shares, params, by_rows=by_rows)
        )(params, batch["inputs"], batch["targets"])

    loss, grads = gradients(lambda path: True)
    dense_loss, dense = gradients(lambda path: False)
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
    tables = embedding_paths(model)
    banks = {"bank"} if preset.endswith("shared") else {"bank.2", "bank.3"}
    assert set(tables) == {"wte", *banks}
    flat, flat_dense = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads, dense))
    for (path, got), (_, want) in zip(flat, flat_dense, strict=True):
        keys = tuple(getattr(k, "key", None) for k in path)
        assert got.dtype == want.dtype, keys
        if keys in tables.values():
            # the same sums; XLA rounds bf16 intermediates differently in the two programs
            assert got.dtype == jnp.bfloat16, keys
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.abs(want).max() > 0, keys
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=str(keys))

    table_shape = params["wte"]["embedding"].shape

    def writes(by_rows):
        jaxpr = jax.make_jaxpr(
            lambda p, i, t: fsdp.accumulate(graphdef, p, i, t, shares, params, by_rows=by_rows)
        )(params, batch["inputs"], batch["targets"])
        return {name for in_scan, name in table_writes(jaxpr.jaxpr, table_shape) if in_scan}

    assert writes(lambda path: True) == {"scatter-add"}
    assert {"broadcast_in_dim", "add"} <= writes(lambda path: False)  # what rows avoid


def run_steps(config, mesh, steps=3):
    plan = training_plan(config)
    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    step = make_train_step(graphdef, tx, shardings, mesh)
    losses = []
    for batch in in_memory_batches(steps, 4, 4, 32, 200):
        state, metrics = step(state, sharding.global_batch(batch, mesh, leading=1))
        losses.append(float(metrics["loss"]))
    return losses, state


def test_sharded_mesh_gives_the_same_losses_as_one_device():
    config = train_config()
    # 16 tokens per device per loss chunk: 16 chunks of 2 positions on one device, 4 of 8 on
    # each of the 4 batch shards (the lm_head gradient summed per shard, then over them).
    config.model.loss_chunk_tokens = 16
    assert len(jax.devices()) >= 8
    config.mesh.update(data=1, fsdp=1, tensor=1)
    single, _ = run_steps(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
    config.mesh.update(data=2, fsdp=2, tensor=2)
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
    sharded, state = run_steps(config, mesh)
    np.testing.assert_allclose(sharded, single, rtol=2e-5)
    assert single[2] != single[0]
    bank = state.params["blocks"][3]["attn"]["value"]["bank"]["embedding"]
    assert bank.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    wte = state.params["wte"]["embedding"]
    assert len({str(s.index) for s in wte.addressable_shards}) == 4  # vocab x embed split 2 x 2

    # Every optimizer buffer shaped like its parameter (AdamW's moments, Muon's momentum) is
    # laid out as the parameter is, not replicated.
    def dict_keys(path):
        return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))

    params = {dict_keys(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    matched = 0
    for path, buffer in jax.tree_util.tree_leaves_with_path(state.opt_state):
        keys = dict_keys(path)
        param = next((params[keys[i:]] for i in range(len(keys)) if keys[i:] in params), None)
        if param is not None and param.shape == buffer.shape:
            assert buffer.sharding.spec == param.sharding.spec, path
            matched += buffer.ndim >= 2 and param.sharding.spec != jax.sharding.PartitionSpec()
    assert matched >= 2 * len(state.params["blocks"])  # at least two sharded buffers per layer


def test_every_parameter_of_every_preset_gets_one_label():
    from bov_jax.presets import PRESETS

    for preset in PRESETS:
        params = nnx.to_pure_dict(nnx.state(tiny_model(preset, depth=3), nnx.Param))
        labels = jax.tree.leaves(param_labels(params))
        assert len(labels) == len(jax.tree.leaves(params))
        if "bov" in preset or "ve_gated" in preset:
            assert "value_table" in labels


def test_unknown_config_key_fails_naming_it():
    config = train_config()
    with config.unlocked():
        config.train.num_stepz = 3
    with pytest.raises(
        ValueError, match=r"unknown config key train.num_stepz \(did you mean train.num_steps\?\)"
    ):
        validate_config(config)


def test_inconsistent_batch_fails_before_compiling():
    from bov_jax.train.layout import BatchLayout

    config = train_config()
    config.train.total_batch_tokens = 100 * 32
    config.train.device_batch_size = 3
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    with pytest.raises(
        ValueError, match="train.total_batch_tokens=3200 .* train.device_batch_size=3"
    ):
        BatchLayout.resolve(config, training_plan(config), mesh)


def test_batch_error_proposes_the_fix():
    """The quickstart on 2 devices (launch/local_multiprocess.sh 2): 8 rows of 512 tokens
    per step are 4 per device, fewer than train.device_batch_size=8."""
    from bov_jax.config import load_config_file
    from bov_jax.train.layout import BatchLayout, divisibility_fix

    config = load_config_file("configs/quickstart.py")
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
    with pytest.raises(
        ValueError,
        match=r"8192 tokens per micro-batch; pass --config.train.device_batch_size=4 \(4 rows",
    ):
        BatchLayout.resolve(config, training_plan(config), mesh)
    config.train.device_batch_size = 4
    assert BatchLayout.resolve(config, training_plan(config), mesh).accum == 1
    assert divisibility_fix(6 * 64, 64, 2, 2) == (
        "pass --config.train.device_batch_size=1 (3 rows per device per step)"
    )
    assert divisibility_fix(3000, 64, 2, 3).startswith(
        "pass --config.train.total_batch_tokens=2944 (a multiple of 128"
    )
    assert divisibility_fix(100, 64, 2, 3).startswith("pass --config.train.total_batch_tokens=128")


def test_bad_model_value_is_named():
    config = train_config()
    config.model.value_path.combine = "multiply"
    with pytest.raises(ValueError, match="model.value_path.combine='multiply'"):
        validate_config(config)
    config = train_config()
    config.model.compute_dtype = "float8"
    with pytest.raises(ValueError, match="model.compute_dtype"):
        validate_config(config)


def test_nonfinite_step_leaves_the_state_unchanged():
    config = train_config()
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    plan = training_plan(config)
    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    step = make_train_step(graphdef, tx, shardings, mesh)
    before = jax.tree.map(np.asarray, state)
    poisoned = jax.tree.map(lambda x: x, state)._replace(
        params={**state.params, "smear_lambda": jnp.full((1,), jnp.nan)}
    )
    batch = next(in_memory_batches(1, 4, 4, 32, 200))
    after, metrics = step(poisoned, sharding.global_batch(batch, mesh, leading=1))
    assert not bool(metrics["finite"])
    assert int(after.step) == int(before.step)
    np.testing.assert_array_equal(
        after.params["wte"]["embedding"], before.params["wte"]["embedding"]
    )


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_finite_finds_one_bad_value_in_any_leaf(bad, dtype):
    big = jnp.finfo(dtype).max  # finite extremes must not count as overflow
    tree = {
        "a": jnp.full((3, 5), big, dtype),
        "b": [jnp.arange(7, dtype=jnp.int32), -jnp.full((4,), big, dtype)],
        "c": jnp.zeros((), dtype),
    }
    check = jax.jit(all_finite)
    assert bool(check(tree))
    leaves, treedef = jax.tree.flatten(tree)
    for i, leaf in enumerate(leaves):
        if leaf.dtype == jnp.int32:
            continue
        poisoned = leaf.reshape(-1).at[-1].set(bad).reshape(leaf.shape)
        changed = jax.tree.unflatten(treedef, [*leaves[:i], poisoned, *leaves[i + 1 :]])
        assert not bool(check(changed)), i


def test_auto_dtype_and_attention_resolve_by_backend():
    from bov_jax.model.spec import ModelSpec

    config = train_config()
    assert config.model.compute_dtype == "auto"
    spec = ModelSpec.from_config(config.model)
    assert jax.default_backend() == "cpu"
    assert (spec.compute_dtype, spec.attention_impl) == (jnp.float32, "xla")
