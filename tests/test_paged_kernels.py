"""The engine's paged decoding kernels, GPU (Pallas Triton) and TPU (Pallas Mosaic), in
interpret mode here: against attention over the gathered pages and through whole engine runs
against the full forward; which layers each platform lowers to a kernel, and the bytes a
kernel is counted for."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax import export
from test_engine import GREEDY, NEW, PROMPTS, VARIANTS, full_logits, random_model, tight

from bov_jax.compile import hlo
from bov_jax.inference import bank_words, decode, paged, paged_kernels, step_traffic
from bov_jax.inference.engine import Engine, serving_params
from bov_jax.inference.layout import CacheLayout, pages_touched

TRITON_CALL = "__gpu$xla.gpu.triton"
TPU_CALL = "tpu_custom_call"
HEADS, POOL_PAGES, ROWS, WIDTH, BANK_ROWS = 2, 40, 3, 10, 50


def kernel_inputs(page_size: int, head_dim: int, dtype, seed: int = 0):
    """Random pools (K, V, ids) of POOL_PAGES pages, a bank table, queries (ROWS, H, hd) and
    two unrelated block tables (ROWS, WIDTH) of distinct pages (page 0, the null page, unused)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (HEADS, POOL_PAGES, page_size, head_dim)
    k_pages = jax.random.normal(keys[0], shape).astype(dtype)
    v_pages = jax.random.normal(keys[1], shape).astype(dtype)
    ids = jax.random.randint(keys[2], (POOL_PAGES, page_size), 0, BANK_ROWS)
    bank = jax.random.normal(keys[3], (BANK_ROWS, HEADS * head_dim)).astype(dtype)
    q = jax.random.normal(keys[4], (ROWS, HEADS, head_dim))
    rng = np.random.default_rng(seed)
    tables = [rng.permutation(np.arange(1, POOL_PAGES))[: ROWS * WIDTH] for _ in range(2)]
    k_tables, v_tables = (jnp.asarray(t.reshape(ROWS, WIDTH), jnp.int32) for t in tables)
    return q, k_pages, v_pages, ids, bank, k_tables, v_tables


def attention_over_gathered_pages(q, keys, values, positions, window):
    """Softmax attention of q (B, H, hd) over keys and values (H, B, S, hd) gathered from
    position 0, each row's query at positions[b] seeing positions[b] - window .. positions[b]."""
    slots = jnp.arange(keys.shape[2])[None, None]
    reach = positions[:, None, None]
    seen = (slots <= reach) & (slots >= reach - window)
    logits = jnp.einsum("bhd,hbsd->bhs", q, keys.astype(jnp.float32)) / np.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,hbsd->bhd", weights, values.astype(jnp.float32))


def interpreted(kernel: str, q, reads):
    """The kernel `kernel` ('gpu' or 'tpu') in interpret mode, for a step that reads each row's
    window (the TPU kernel's span: the most pages it touches)."""
    if kernel == "gpu":
        return paged_kernels.gpu_attention(q, reads, interpret=True)
    page_size, width = reads.k_pages.shape[2], reads.k_tables.shape[1]
    span = min(pages_touched(reads.window + 1, page_size), width)
    return paged_kernels.tpu_attention(q, reads, span, interpret=True)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("window", [2, 13, 1000])  # within a page, across pages, every position
@pytest.mark.parametrize("bank", [False, True])
def test_each_kernel_equals_attention_over_the_gathered_pages(kernel, page_size, window, bank):
    q, k_pages, v_pages, ids, table, k_tables, v_tables = kernel_inputs(page_size, 16, jnp.float32)
    positions = jnp.array([0, 3 * page_size + 1, WIDTH * page_size - 1], jnp.int32)
    reads = paged_kernels.PagedReads(
        k_pages, ids if bank else v_pages, k_tables, v_tables, positions, window,
        bank_words.pack(table, HEADS) if bank else None, jnp.float32,
    )  # fmt: skip
    got = interpreted(kernel, q / np.sqrt(16), reads)
    slots = ROWS, WIDTH * page_size
    keys = k_pages[:, k_tables].reshape(HEADS, *slots, 16)
    if bank:
        rows = table[ids[v_tables].reshape(slots)].reshape(*slots, HEADS, 16)
        values = jnp.moveaxis(rows, 2, 0)
    else:
        values = v_pages[:, v_tables].reshape(HEADS, *slots, 16)
    want = attention_over_gathered_pages(q, keys, values, positions, window)
    assert got.shape == (ROWS, HEADS, 16) and got.dtype == jnp.float32
    assert float(jnp.std(want[1:])) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("head_dim", [16, 128, 256])  # TPU: a row's words in 1, 1, 2 x 128 lanes
def test_each_kernel_reads_pages_in_their_dtype_and_sums_in_fp32(kernel, head_dim):
    """bf16 pages and bank words (two values a word) against the same values in fp32 (one a
    word): bf16 values are exact in fp32, and every sum is fp32 in both."""
    q, k_pages, v_pages, ids, table, k_tables, v_tables = kernel_inputs(8, head_dim, jnp.bfloat16)
    positions = jnp.array([5, 40, 79], jnp.int32)
    words = bank_words.pack(table, HEADS)
    reads = paged_kernels.PagedReads(
        k_pages, ids, k_tables, v_tables, positions, 20, words, jnp.bfloat16
    )
    got = interpreted(kernel, q / np.sqrt(head_dim), reads)
    wide = reads._replace(
        k_pages=k_pages.astype(jnp.float32),
        bank=bank_words.pack(table.astype(jnp.float32), HEADS),
        bank_dtype=jnp.float32,
    )
    want = interpreted(kernel, q / np.sqrt(head_dim), wide)
    assert words.shape[2] * 2 == wide.bank.shape[2] == HEADS * head_dim
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.fixture(params=["gpu", "tpu"])
def through_the_interpreted_kernel(request, monkeypatch) -> list[int]:
    """`paged_kernels.decode_attention` as lowered for a GPU or a TPU, the kernel interpreted,
    for the steps traced while the test runs (the step's compiled programs are dropped before
    and after: one compiled by another test would not trace it); the windows it was traced
    for."""
    traced = []

    def decode_attention(q, reads, coef, xla, *, span):
        traced.append(reads.window)
        if request.param == "gpu":
            run = functools.partial(paged_kernels.gpu_attention, reads=reads, interpret=True)
        else:
            run = functools.partial(
                paged_kernels.tpu_attention, reads=reads, span=span, interpret=True
            )
        return paged_kernels.through_kernel(run, q, coef)

    monkeypatch.setattr(paged_kernels, "decode_attention", decode_attention)
    paged.forward_step.clear_cache()
    yield traced
    paged.forward_step.clear_cache()


def test_engine_decoding_through_each_kernel_equals_the_full_forward(
    through_the_interpreted_kernel,
):
    """BoV without a V cache, every decoding step's attention in the kernel (own layers of
    window 8, cutting here, bank layers of windows 8 and 64, the id pages in another group
    than the keys; preemption and recomputation): greedy tokens equal to the dense
    decoder's, logits to the full forward's. (Separate tables for K and V pages are in the
    kernel test above; the dense decoder holds every variant to the same forward.)"""
    preset, eliminate = VARIANTS["BoV without a V cache"]
    model = random_model(preset)
    prompts = PROMPTS[:4]  # 4 requests through 2 batch slots: 9 step shapes, not 15
    engine = Engine(model, tight(eliminate_bank_v=eliminate, max_seqs=2))
    results = engine.generate(prompts, GREEDY)
    assert engine.scheduler.preemptions > 0
    dense = decode.generate(model, prompts, NEW, eliminate_bank_v=eliminate)
    fulls = full_logits(model, prompts, [r.token_ids for r in results])
    for result, want, full in zip(results, dense, fulls, strict=True):
        assert result.token_ids == want
        np.testing.assert_allclose(np.stack(result.logits), full[:NEW], rtol=1e-5, atol=2e-5)
    assert set(through_the_interpreted_kernel) == {8, 64}  # every layer's window, decoding


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
    state = serving_params(model, state, layout)
    spans = paged.spans_for(layout, width - 1, 1, width)
    # the plain function: a fresh trace (the environment is read when tracing)
    step = functools.partial(paged.forward_step.__wrapped__, graphdef, layout=layout, spans=spans)
    if platform == "cpu":
        return jax.jit(step).lower(state, paged.abstract_pools(layout, (12, 12)), inputs).as_text()
    unchecked = [export.DisabledSafetyCheck.custom_call(c) for c in (TRITON_CALL, TPU_CALL)]
    exported = export.export(jax.jit(step), platforms=[platform], disabled_checks=unchecked)
    return exported(state, paged.abstract_pools(layout, (12, 12)), inputs).mlir_module()


@pytest.mark.parametrize(
    ("preset", "platform", "triton", "mosaic"),
    [
        ("d12", "cuda", 4, 0),  # every layer in the engine's kernel, windows cutting or not
        ("d12", "tpu", 0, 4),
        ("d12_bov", "cuda", 4, 0),  # layers 2, 3 weigh bank rows in it
        ("d12_bov", "tpu", 0, 4),
        ("d12", "cpu", 0, 0),
    ],
)
def test_the_decoding_step_lowers_its_kernels_per_platform(preset, platform, triton, mosaic):
    text = lowered_decode_step(preset, platform)
    assert (text.count(TRITON_CALL), text.count(TPU_CALL)) == (triton, mosaic)
    if platform != "cpu":  # no layer's pages or bank rows gathered in XLA ops
        modes = ("pages", "pages", "bank", "bank") if preset == "d12_bov" else ("pages",) * 4
        names = {f"{paged_kernels.KERNEL_NAME}_w{w}_{m}" for w, m in zip((8, 8, 8, 64), modes)}
        assert set(re.findall(rf"{paged_kernels.KERNEL_NAME}_\w+", text)) == names


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


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_kernels_bytes_are_the_pages_its_window_touches(platform):
    """`step_traffic` counts a kernel of a compiled step by the pages its window (named in the
    kernel: in the GPU call's backend config, as the TPU call's own name) touches per row, not
    by its pools: 8 rows, 4 heads of 128, pages of 16, tables of 128 logical pages (the TPU
    kernel's cut to the window's span, flat); window 40 touches 4 pages (41 positions), 5000
    every one."""
    tpu = platform == "tpu"
    shapes = {
        "q": "bf16[8,4,128]{2,1,0}",
        "pos": "s32[8]{0}",
        "k": "bf16[4,9000,16,128]{3,2,1,0}",
        "v": "bf16[4,9000,16,128]{3,2,1,0}",
        "ids": "s32[9000,1,16]{2,1,0}" if tpu else "s32[9000,16]{1,0}",
        # 4 heads of 128 bf16 columns: 256 words a row (`bank_words`)
        "bank": "u32[32768,1,256]{2,1,0}" if tpu else "u32[32768,256]{1,0}",
    }

    def counted(window: int, values: str) -> float:
        span = min(pages_touched(window + 1, 16), 128)
        shapes["kt"] = shapes["vt"] = f"s32[{8 * span}]{{0}}" if tpu else "s32[8,128]{1,0}"
        operands = ["pos", "kt", "vt", "q", "k", values] + (["bank"] if values == "ids" else [])
        name = f"{paged_kernels.KERNEL_NAME}_w{window}_{'bank' if values == 'ids' else 'pages'}"
        call = hlo.Instruction(
            name=f"{name}.1" if tpu else "call",
            shape="f32[8,4,128]{2,1,0}",
            opcode="custom-call",
            arguments=", ".join(f"%{o}" for o in operands),
            attributes='custom_call_target="tpu_custom_call"'
            if tpu
            else f'custom_call_target="__gpu$xla.gpu.triton", backend_config={{"name":"{name}"}}',
        )
        assert step_traffic.is_kernel(call)
        return step_traffic.kernel_bytes(call, shapes)

    small = 8 * 4 * 128 * 2 + 8 * 4 + 8 * 4 * 128 * 4  # queries, positions, output
    slots = 8 * 4 * 16 * 4  # rows x pages x slots x heads
    # a k and a v table entry, and a page's ids: per page and head program on GPUs, per page
    # on TPUs (all heads at once)
    readers = 1 if tpu else 4
    entries = 2 * 8 * 4 * readers * 4
    ids = 8 * 4 * 16 * readers * 4
    assert counted(40, "v") == slots * 128 * 2 * 2 + entries + small
    assert counted(40, "ids") == slots * (128 * 2 + 128 * 2) + ids + entries + small
    every = 8 * 128 * 16 * 4  # 128 pages a row: the table's width
    assert counted(5000, "v") == every * 128 * 2 * 2 + 2 * 8 * readers * 128 * 4 + small
