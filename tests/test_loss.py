"""The chunked lm_head + softcap + cross-entropy against the plain loss over full logits."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_config, tiny_model, tokens

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.model.gpt import cross_entropy
from bov_jax.model.loss import chunk_length
from bov_jax.train.state import create_train_state
from bov_jax.train.step import make_train_step, on_mesh


def ids_and_targets(rows: int = 2, length: int = 32, vocab: int = 200):
    ids = tokens(rows, length + 1, vocab=vocab, seed=5)
    targets = ids[:, 1:].at[0, 3].set(-1).at[1, 10:14].set(-1)  # some ignored targets
    return ids[:, :-1], targets


@pytest.mark.parametrize("chunk_tokens, vocab", [(8, 200), (64, 200), (64, 256)])
def test_chunked_loss_and_gradients_equal_the_plain_loss(chunk_tokens, vocab):
    # lm_head scale 1.0 puts logits near the cap, so the softcap's derivative matters. Vocab
    # 200 has padded lm_head columns (256) that the softmax must skip; 256 has none.
    model = tiny_model("d12_bov", depth=2, loss_chunk_tokens=chunk_tokens, vocab_size=vocab)
    randomize(model, seed=11)
    randomize(model, seed=12, scale=1.0, only="lm_head")
    inputs, targets = ids_and_targets(vocab=vocab)
    graphdef, params = nnx.split(model, nnx.Param)

    def plain(p):
        return cross_entropy(nnx.merge(graphdef, p)(inputs), targets)

    def chunked(p):
        return nnx.merge(graphdef, p).loss(inputs, targets)

    loss_plain, grads_plain = jax.value_and_grad(plain)(params)
    loss_chunked, grads_chunked = jax.value_and_grad(chunked)(params)
    assert float(loss_plain) > 1.0
    np.testing.assert_allclose(loss_chunked, loss_plain, rtol=1e-6)
    flat_plain = dict(nnx.to_flat_state(grads_plain))
    for path, g in nnx.to_flat_state(grads_chunked):
        want = np.asarray(flat_plain[path][...])
        scale = np.abs(want).max()
        assert scale > 0, path  # every parameter's gradient is live
        got = np.asarray(g[...])
        # A scalar's gradient (smear_lambda, the per-layer lambdas) is one sum over every
        # row, position and channel, whose terms cancel: the two programs' fp32 orders of
        # summation move it by ~1e-4 of itself on some CPUs (AVX-512), an array's by less.
        rtol = 1e-3 if want.size <= model.spec.n_layer else 1e-4
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-5 * scale, err_msg=str(path))


@pytest.mark.parametrize("rows", [8, 3])
def test_gradients_on_a_mesh_equal_the_single_device_ones(rows):
    # 8 rows over 4 batch shards (data 2 x fsdp 2, tensor 2): 4 chunks of 8 positions per
    # shard, each shard's lm_head gradient summed apart, then over the shards; one device: 16
    # chunks of 2 positions. 3 rows do not split over the 4 shards: one sum, as on one device.
    model = tiny_model("d12_bov", depth=2, loss_chunk_tokens=16)
    randomize(model, seed=15)
    randomize(model, seed=16, scale=1.0, only="lm_head")
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = ids_and_targets(rows=rows)

    def loss_and_grads(p, ids, t):
        return jax.value_and_grad(lambda q: nnx.merge(graphdef, q).loss(ids, t))(p)

    want_loss, want = jax.jit(loss_and_grads)(params, inputs, targets)
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
    got_loss, got = jax.jit(on_mesh(loss_and_grads, mesh))(params, inputs, targets)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    flat_want = dict(nnx.to_flat_state(want))
    for path, g in nnx.to_flat_state(got):
        w = np.asarray(flat_want[path][...])
        np.testing.assert_allclose(
            np.asarray(g[...]), w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=str(path)
        )


def test_per_token_nats_equal_the_plain_ones():
    model = tiny_model("d12", depth=2, loss_chunk_tokens=16)
    randomize(model, seed=13)
    inputs, targets = ids_and_targets()
    want = cross_entropy(model(inputs), targets, reduction="none")
    got = model.loss(inputs, targets, reduction="none")
    assert got.shape == targets.shape and float(got[0, 3]) == 0.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_chunk_length_divides_time_within_the_budget():
    assert chunk_length(8, 512, 2048) == 256
    assert chunk_length(2, 30, 16) == 6
    assert chunk_length(64, 7, 16) == 1
    assert chunk_length(8, 512, 2048, shards=8) == 512  # one row per device: 2048 budget
    assert chunk_length(16, 512, 256, shards=8) == 128


def test_compiled_train_step_holds_no_full_fp32_logits():
    rows, seq, vocab = jax.device_count(), 128, 512
    config = tiny_config("d12_bov", depth=2, seq_len=seq, vocab_size=vocab, loss_chunk_tokens=64)
    t = config.train
    t.device_batch_size, t.total_batch_tokens, t.num_steps = rows, rows * seq, 10
    mesh = sharding.make_mesh(config.mesh)
    graphdef, state, shardings, tx = create_train_state(config, training_plan(config), mesh)
    step = make_train_step(graphdef, tx, shardings, mesh)
    ids = np.zeros((1, rows, seq), np.int32)
    batch = sharding.global_batch({"inputs": ids, "targets": ids}, mesh, leading=1)
    hlo = step.lower(state, batch).compile().as_text()
    local = rows // jax.device_count()  # the compiled module holds per-device shapes
    for shape in (f"f32[{local},{seq},{vocab}]", f"f32[{local * seq},{vocab}]"):
        assert shape not in hlo, shape
    chunk = 64 // local  # loss_chunk_tokens counts one device's tokens
    assert f"f32[{local},{chunk},{vocab}]" in hlo  # the chunk's logits are there instead


def test_bf16_chunked_loss_is_close_to_the_plain_one():
    model = tiny_model("d12_bov", depth=2, compute_dtype="bfloat16", loss_chunk_tokens=16)
    randomize(model, seed=14)
    inputs, targets = ids_and_targets()
    want = cross_entropy(model(inputs), targets)
    got = model.loss(inputs, targets)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-2)
