"""JAX's Pallas paged-attention kernels in the engine's decoding step: the GPU kernel
(interpret mode) against the XLA gathers, and which layers each platform lowers to a kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax import export

from bov_jax.inference import paged, paged_kernels
from bov_jax.inference.layout import CacheLayout

TRITON_CALL = "__gpu$xla.gpu.triton"
TPU_CALL = "tpu_custom_call"


def test_the_gpu_kernel_equals_attention_over_the_gathered_pages():
    keys = jax.random.split(jax.random.key(0), 3)
    heads, pages, size, head_dim, rows, span = 2, 30, 4, 32, 3, 8
    k_pages = jax.random.normal(keys[0], (heads, pages, size, head_dim))
    v_pages = jax.random.normal(keys[1], (heads, pages, size, head_dim))
    q = jax.random.normal(keys[2], (rows, heads, head_dim))
    order = np.random.default_rng(0).permutation(np.arange(1, pages))[: rows * span]
    tables = jnp.asarray(order.reshape(rows, span), jnp.int32)
    lengths = jnp.array([5, 17, 32], jnp.int32)
    got = paged_kernels.gpu_attention(
        q / np.sqrt(head_dim), k_pages, v_pages, tables, lengths, interpret=True
    )
    k = k_pages[:, tables].reshape(heads, rows, span * size, head_dim)
    v = v_pages[:, tables].reshape(heads, rows, span * size, head_dim)
    logits = jnp.einsum("bhd,hbsd->bhs", q, k) / np.sqrt(head_dim)
    seen = jnp.arange(span * size)[None, None] < lengths[:, None, None]
    want = jnp.einsum("bhs,hbsd->bhd", jax.nn.softmax(jnp.where(seen, logits, -jnp.inf)), v)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def lowered_decode_step(preset: str, platform: str) -> str:
    """The engine's decoding step for 4 rows holding up to 64 positions, head width 128
    (d24's, which the TPU kernel's tiles need), lowered for `platform` (no device needed)."""
    model = tiny_model(preset, depth=4, model_dim=256, head_dim=128, seq_len=64)
    layout = CacheLayout.build(model.spec, 16)
    width = 4  # 64 positions
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    inputs = paged.StepInput(
        jax.ShapeDtypeStruct((4, 1), jnp.int32),
        rows,
        rows,
        rows,
        tuple(jax.ShapeDtypeStruct((4, width), jnp.int32) for _ in layout.groups),
    )
    graphdef, state = nnx.split(model)
    spans = paged.spans_for(layout, width - 1, 1, width)
    # the plain function: a fresh trace (the environment is read when tracing)
    step = functools.partial(paged.forward_step.__wrapped__, graphdef, layout=layout, spans=spans)
    if platform == "cpu":
        return jax.jit(step).lower(state, paged.abstract_pools(layout, (12, 12)), inputs).as_text()
    unchecked = [export.DisabledSafetyCheck.custom_call(c) for c in (TRITON_CALL, TPU_CALL)]
    exported = export.export(jax.jit(step), platforms=[platform], disabled_checks=unchecked)
    return exported(state, paged.abstract_pools(layout, (12, 12)), inputs).mlir_module()


def test_only_decoding_own_layers_whose_window_reaches_every_position_take_the_kernel():
    layout = CacheLayout.build(tiny_model("d12", depth=4).spec, 16)
    assert [r.window for r in layout.layers] == [8, 8, 8, 64]
    assert [paged_kernels.eligible(r, layout, 1, 4) for r in layout.layers] == [
        False,
        False,
        False,
        True,
    ]
    assert not paged_kernels.eligible(layout.layers[3], layout, 1, 5)  # 80 positions: cut
    assert not paged_kernels.eligible(layout.layers[3], layout, 8, 4)  # a prefill chunk
    bov = CacheLayout.build(tiny_model("d12_bov", depth=4).spec, 16)
    assert not paged_kernels.eligible(bov.layers[3], bov, 1, 4)  # no V pages


@pytest.mark.parametrize(
    ("preset", "platform", "triton", "mosaic"),
    [
        ("d12", "cuda", 1, 0),  # layer 3 in the paged kernel
        ("d12", "tpu", 0, 1),
        ("d12_bov", "cuda", 2, 0),  # layers 2, 3 (bank) in bank_gather's kernel
        ("d12_bov", "tpu", 0, 0),
        ("d12", "cpu", 0, 0),
    ],
)
def test_the_decoding_step_lowers_its_kernels_per_platform(preset, platform, triton, mosaic):
    text = lowered_decode_step(preset, platform)
    assert (text.count(TRITON_CALL), text.count(TPU_CALL)) == (triton, mosaic)


def test_paged_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("BOV_PAGED_KERNEL", "0")
    assert lowered_decode_step("d12", "cuda").count(TRITON_CALL) == 0


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("columns", [1, 3, 16])
def test_spans_cover_every_page_a_window_reaches_and_no_page_more(page_size, columns):
    layout = CacheLayout.build(tiny_model("d12", depth=4).spec, page_size)
    width = 1024 // page_size
    widest = dict.fromkeys((r.window for r in layout.layers), 0)
    for start in range(0, 512):
        end_page = (start + columns - 1) // page_size
        for window, span in paged.spans_for(layout, end_page, columns, width):
            first = max(start - window, 0) // page_size  # where the step's reads begin
            touched = end_page - first + 1
            assert touched <= span, (start, window)
            widest[window] = max(widest[window], touched)
    far = paged.spans_for(layout, 511 // page_size, columns, width)
    assert dict(far) == widest  # far from the start, the span is the most pages ever touched
