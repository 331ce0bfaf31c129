"""The decoding step's bank gather: the Pallas kernel (interpret mode here) against XLA ops,
the platform each is lowered for, and a whole decode through the kernel against the forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import randomize, tiny_model, tokens
from jax import export

from bov_jax.inference import bank_gather, decode

TRITON_CALL = "__gpu$xla.gpu.triton"


HISTORY = 260  # cache slots; the weights cover a window of them from slot FIRST
FIRST = 7


def inputs(slots: int, head_dim: int, dtype, seed: int = 0):
    """Softmax weights (2, C, 3) with some slots masked to 0, a history of ids (2, HISTORY)
    and a table (50, 3 * hd)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    logits = jax.random.normal(keys[0], (2, slots, 3))
    masked = jax.random.bernoulli(keys[1], 0.3, (2, slots, 1))
    weights = jax.nn.softmax(jnp.where(masked, -jnp.inf, logits), axis=1)
    ids = jax.random.randint(keys[2], (2, HISTORY), 0, 50)
    table = jax.random.normal(keys[3], (50, 3 * head_dim)).astype(dtype)
    return weights, ids, jnp.int32(FIRST), table


@pytest.mark.parametrize("slots", [5, 64, 70, 200])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_sum_in_xla_ops(slots, dtype):
    """Slot counts below, at and past the kernel's block (the last block's loads masked)."""
    weights, ids, first, table = inputs(slots, 16, dtype)
    options = dict(heads=3, dtype=jnp.float32)
    want = bank_gather.weighted_rows_xla(weights, ids, first, table, **options)
    rows = table[ids[:, FIRST : FIRST + slots]].reshape(2, slots, 3, 16).astype(jnp.float32)
    np.testing.assert_allclose(want, jnp.einsum("bsh,bshd->bhd", weights, rows), atol=1e-6)
    got = bank_gather.weighted_rows_kernel(weights, ids, first, table, **options, interpret=True)
    assert got.shape == (2, 3, 16) and got.dtype == jnp.float32
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The result in another dtype: the fp32 sum, rounded once.
    low = bank_gather.weighted_rows_kernel(
        weights, ids, first, table, heads=3, dtype=jnp.bfloat16, interpret=True
    )
    assert low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(low, got.astype(jnp.bfloat16))
    # Head h reads its own columns: a table whose head 1 is zero gives zero there only.
    zeroed = table.at[:, 16:32].set(0)
    got = bank_gather.weighted_rows_kernel(weights, ids, first, zeroed, **options, interpret=True)
    assert float(jnp.max(jnp.abs(got[:, 1]))) == 0 and float(jnp.min(jnp.abs(got[:, 0]))) > 0


def lowered_text(head_dim: int, platform: str) -> str:
    weights, ids, first, table = inputs(70, head_dim, jnp.bfloat16)

    def weighed(weights, ids, first, table):
        return bank_gather.weighted_rows(weights, ids, first, table, heads=3, dtype=jnp.bfloat16)

    fn = jax.jit(weighed)
    if platform == "cpu":
        return fn.lower(weights, ids, first, table).as_text()
    unchecked = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    exported = export.export(fn, platforms=[platform], disabled_checks=unchecked)
    return exported(weights, ids, first, table).mlir_module()


def test_the_kernel_is_lowered_for_nvidia_gpus_only(monkeypatch):
    cuda = lowered_text(16, "cuda")
    assert cuda.count(TRITON_CALL) == 1 and "stablehlo.gather" not in cuda
    cpu = lowered_text(16, "cpu")
    assert TRITON_CALL not in cpu and "custom_call" not in cpu and "gather" in cpu
    odd_width = lowered_text(24, "cuda")  # Triton's blocks need a power-of-two head width
    assert TRITON_CALL not in odd_width and "stablehlo.gather" in odd_width
    monkeypatch.setenv("BOV_BANK_KERNEL", "0")  # XLA ops on GPUs too (h200.sh compares)
    switched_off = lowered_text(16, "cuda")
    assert TRITON_CALL not in switched_off and "stablehlo.gather" in switched_off


def test_decoding_through_the_kernel_reproduces_the_full_forward(monkeypatch):
    """The decode engine's bank layers without a V cache, their values summed by the kernel
    (interpret mode, as on a GPU), against the full forward of a random-weight model."""
    model = tiny_model("d12_bov", depth=4)
    randomize(model, seed=5)
    assert model.spec.targets and model.spec.head_dim & (model.spec.head_dim - 1) == 0
    calls = []

    def through_kernel(weights, ids, first, table, **options):
        calls.append(weights.shape)
        return bank_gather.weighted_rows_kernel(
            weights, ids, first, table, **options, interpret=True
        )

    monkeypatch.setattr(bank_gather, "weighted_rows", through_kernel)
    ids = tokens(2, 14)
    graphdef, state = nnx.split(model)

    @jax.jit
    def decoded(state, ids):  # a prefill of 4 tokens, then one token at a time
        model = nnx.merge(graphdef, state)
        cache = decode.init_cache(model.spec, 2, 14)
        first, cache = decode.forward_cached(model, ids[:, :4], cache)

        def step(cache, token):
            logits, cache = decode.forward_cached(model, token[:, None], cache)
            return cache, logits[:, 0]

        _, rest = jax.lax.scan(step, cache, ids[:, 4:].T)
        return jnp.concatenate([first, rest.transpose(1, 0, 2)], axis=1)

    got = decoded(state, ids)
    assert len(calls) == len(model.spec.targets)  # one traced step, each bank layer once
    full = model(ids)
    assert float(jnp.std(full)) > 0.1
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=2e-5)
