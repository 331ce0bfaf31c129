"""A decoding step's attention over pages in Pallas kernels that read each page once.

A decoding row's query at position p attends to positions p - window .. p: the logical pages
from the one holding max(p - window, 0) to the one holding p, named by the row's block
tables. The kernels read exactly those pages, where they are weighed, for every decoding
layer and any window: keys from the layer's K pages; values from its V pages (own, or layer
0's for a v1 layer, each pool through its own group's table) or, for a bank layer, the rows
of the bank table named by the id pages, gathered where weighed.

  - NVIDIA GPUs: `gpu_attention` (Pallas Triton), a program per row and head.
  - TPUs: `tpu_attention` (Pallas Mosaic), a grid step per row and page of its window, the
    block tables prefetched to scalar memory, bank rows copied in by DMA.

Prefill chunks and CPUs gather the pages in XLA ops (`paged._attend`). The choice is made
per platform when the step is lowered (`jax.lax.platform_dependent`), and everywhere XLA
ops when the environment sets BOV_PAGED_KERNEL=0. Both kernels are named
f"{KERNEL_NAME}_w{window}_{'bank' or 'pages'}" and take (positions, K table, V table, q, K
pages, V pages or ids[, bank]) in that order (`step_traffic` counts them by the pages
their window touches).

Shapes: B rows, H heads, hd head width, P page size, N pages of a pool, W a group's table
width (logical pages), R bank rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # Pallas's Triton backend, deprecated since jax 0.11 (Mosaic GPU replaces it)
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:  # a jax without it: XLA ops on GPUs
    pallas_triton = None

KERNEL_NAME = "bov_paged_decode"  # the kernels' name in the HLO (`step_traffic` reads it)


class PagedReads(NamedTuple):
    """What one layer's decoding attention reads: its pools and the rows' tables."""

    k_pages: jax.Array  # (H, N_k, P, hd)
    values: jax.Array  # (H, N_v, P, hd) V pages, or (N_v, P) int32 ids where bank is given
    k_tables: jax.Array  # (B, W_k) int32: logical page -> page of k_pages
    v_tables: jax.Array  # (B, W_v) int32: logical page -> page of values
    positions: jax.Array  # (B,) int32: each row's query position
    window: int  # the query at p sees p - window .. p
    bank: jax.Array | None  # (R, H * hd): a bank layer's table (values are then ids)


def enabled() -> bool:
    return os.environ.get("BOV_PAGED_KERNEL") != "0"


def window_pages(positions: jax.Array, window: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """For queries at positions (any shape, >= 0): the first logical page their window
    touches (the one holding max(p - window, 0)) and how many pages it touches, to the one
    holding p. lax.div, not jnp's //: no sign logic, which Mosaic lowers through the chip's
    kind (unknown when compiling ahead of time)."""
    first = jax.lax.div(jnp.maximum(positions - window, 0), page_size)
    return first, jax.lax.div(positions, page_size) - first + 1


def gpu_attention(q: jax.Array, reads: PagedReads, *, interpret: bool = False) -> jax.Array:
    """Softmax attention of q (B, H, hd), already scaled by 1/sqrt(hd), over the positions
    each row's window sees: (B, H, hd) fp32. One Pallas (Triton) program per (row, head)
    walks the row's pages from the window's first to the query's, a page at a time with an
    online softmax: it reads the K page, then the V page or the id page and the bank rows it
    names (head h's columns), each once. hd and P powers of two. `interpret`: Pallas
    interpret mode (any platform; for tests)."""
    batch, heads, head_dim = q.shape
    page_size = reads.k_pages.shape[2]
    window, bank = reads.window, reads.bank is not None

    def kernel(pos_ref, kt_ref, vt_ref, q_ref, k_ref, v_ref, *rest):  # q, out: (1, 1, hd)
        bank_ref, out_ref = rest if bank else (None, *rest)
        row, head = pl.program_id(0), pl.program_id(1)
        position = pos_ref[row]
        first, pages = window_pages(position, window, page_size)
        query = q_ref[0, 0, :].astype(jnp.float32)
        columns = head * head_dim + jnp.arange(head_dim)

        def add_page(i: jax.Array, carry: tuple) -> tuple:
            top, total, acc = carry  # () fp32, () fp32, (hd,) fp32
            logical = first + i
            keys = k_ref[head, kt_ref[row, logical], :, :].astype(jnp.float32)  # (P, hd)
            slots = logical * page_size + jnp.arange(page_size)
            seen = (slots <= position) & (slots >= position - window)
            logits = jnp.where(seen, jnp.sum(keys * query[None, :], axis=1), -jnp.inf)
            new_top = jnp.maximum(top, jnp.max(logits))  # finite: each page has a seen slot
            p = jnp.exp(logits - new_top)
            rescale = jnp.exp(top - new_top)
            if bank:
                ids = v_ref[vt_ref[row, logical], :]  # (P,)
                cells = bank_ref.at[ids[:, None], columns[None, :]]
                rows = pallas_triton.load(cells, mask=seen[:, None], other=0)
            else:
                rows = v_ref[head, vt_ref[row, logical], :, :]  # (P, hd)
            weighed = jnp.sum(p[:, None] * rows.astype(jnp.float32), axis=0)
            return new_top, total * rescale + jnp.sum(p), acc * rescale + weighed

        start = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.zeros((head_dim,), jnp.float32))
        _, total, acc = jax.lax.fori_loop(0, pages, add_page, start)
        out_ref[0, 0, :] = acc / total

    operands = [reads.positions, reads.k_tables, reads.v_tables, q, reads.k_pages, reads.values]
    if bank:
        operands.append(reads.bank)
    own = pl.BlockSpec((1, 1, head_dim), lambda b, h: (b, h, 0))  # the program's row and head
    whole = pl.BlockSpec(memory_space=pl.ANY)  # indexed in the kernel
    params = None if interpret else pallas_triton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[whole] * 3 + [own] + [whole] * (len(operands) - 4),
        out_specs=own,
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=f"{KERNEL_NAME}_w{window}_{'bank' if bank else 'pages'}",
    )(*operands)


def window_tables(
    tables: jax.Array, positions: jax.Array, window: int, page_size: int, span: int
) -> jax.Array:
    """The entries of tables (B, W) for each row's window, logical pages first .. first +
    span - 1 from the one holding max(p - window, 0) (past the table's width: its last
    entry): (B, span) int32."""
    first, _ = window_pages(positions, window, page_size)
    logical = jnp.minimum(first[:, None] + jnp.arange(span)[None, :], tables.shape[1] - 1)
    return jnp.take_along_axis(tables, logical, axis=1)


def tpu_attention(
    q: jax.Array, reads: PagedReads, span: int, *, interpret: bool = False
) -> jax.Array:
    """`gpu_attention` for TPUs (Pallas Mosaic): softmax attention of q (B, H, hd), scaled,
    over each row's window, (B, H, hd) fp32. A grid step per (row, page of the window): the
    rows' block tables, cut to their windows' `span` logical pages (`window_tables`), are
    prefetched to scalar memory and name the pages a step reads, all heads at once: the K
    page, then the V page or, for a bank layer, the id page (to scalar memory) and, by one DMA
    per slot, the bank rows it names. A step past the row's last page names that page again,
    which Pallas does not fetch twice, and is skipped. Online softmax over a row's steps in
    VMEM. `interpret`: Pallas's interpret mode (any platform; for tests), its TPU interpreter
    (which simulates DMAs and semaphores) for a bank layer."""
    batch, heads, head_dim = q.shape
    page_size = reads.k_pages.shape[2]
    window, bank = reads.window, reads.bank is not None
    # (B * span,): flat, as scalar memory pads a 2-D array's rows
    k_entries, v_entries = (
        window_tables(t, reads.positions, window, page_size, span).reshape(-1)
        for t in (reads.k_tables, reads.v_tables)
    )

    def page(table: int, block_at: Callable[[jax.Array], tuple]) -> Callable:
        """The index map of a pool's block: `block_at` the page that table `table` (0 the
        keys', 1 the values') names at step i."""

        def index_map(row, i, positions_ref, *entries_refs):
            count = window_pages(positions_ref[row], window, page_size)[1]
            return block_at(entries_refs[table][row * span + jnp.minimum(i, count - 1)])

        return index_map

    def in_pool(page: jax.Array) -> tuple:  # a page of (H, N, P, hd), all heads
        return 0, page, 0, 0

    def kernel(positions_ref, _k, _v, q_ref, k_ref, v_ref, *rest):
        bank_ref, out_ref, top_ref, total_ref, acc_ref, *copying = rest if bank else (None, *rest)
        row, i = pl.program_id(0), pl.program_id(1)
        position = positions_ref[row]
        first, count = window_pages(position, window, page_size)

        @pl.when(i == 0)
        def _start() -> None:
            top_ref[...] = jnp.full(top_ref.shape, -jnp.inf, jnp.float32)
            total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(i < count)
        def _add_page() -> None:
            if bank:  # the page's rows, all heads' columns: a DMA per slot, all in flight
                rows_ref, done = copying
                copies = [
                    pltpu.make_async_copy(bank_ref.at[v_ref[0, j]], rows_ref.at[j], done.at[j])
                    for j in range(page_size)
                ]
                for copy in copies:
                    copy.start()
            query = q_ref[...].astype(jnp.float32)  # (H, hd)
            keys = k_ref[...].astype(jnp.float32)  # (H, P, hd)
            slots = (first + i) * page_size + jax.lax.broadcasted_iota(
                jnp.int32, (heads, page_size), 1
            )
            seen = (slots <= position) & (slots >= position - window)
            logits = jnp.where(seen, jnp.sum(keys * query[:, None, :], axis=2), -jnp.inf)
            top = top_ref[...]  # (H, 1)
            new_top = jnp.maximum(top, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.exp(logits - new_top)  # (H, P)
            rescale = jnp.exp(top - new_top)
            if bank:
                for copy in copies:
                    copy.wait()
                rows = rows_ref[:, 0, :].astype(jnp.float32)  # (P, H * hd)
                columns = [rows[:, h * head_dim : (h + 1) * head_dim] for h in range(heads)]
                values = jnp.stack(columns)  # (H, P, hd)
            else:
                values = v_ref[...].astype(jnp.float32)  # (H, P, hd)
            total_ref[...] = total_ref[...] * rescale + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[...] = acc_ref[...] * rescale + jnp.sum(p[:, :, None] * values, axis=1)
            top_ref[...] = new_top

        @pl.when(i == span - 1)
        def _finish() -> None:
            out_ref[...] = acc_ref[...] / total_ref[...]

    own = pl.BlockSpec((None, heads, head_dim), lambda row, i, *_: (row, 0, 0))
    pool_page = (heads, None, page_size, head_dim)
    scratch = [  # the running max and sum, the weighed values
        pltpu.VMEM((heads, 1), jnp.float32),
        pltpu.VMEM((heads, 1), jnp.float32),
        pltpu.VMEM((heads, head_dim), jnp.float32),
    ]
    operands = [reads.positions, k_entries, v_entries, q, reads.k_pages]
    if bank:  # ids (N, 1, P), bank (R, 1, H * hd): a page's ids and a bank row each a block
        ids_page = (None, 1, page_size)
        ids = pl.BlockSpec(ids_page, page(1, lambda n: (n, 0, 0)), memory_space=pltpu.SMEM)
        in_specs = [
            own,
            pl.BlockSpec(pool_page, page(0, in_pool)),
            ids,
            pl.BlockSpec(memory_space=pl.ANY),
        ]
        operands += [reads.values[:, None], reads.bank[:, None]]
        scratch += [
            pltpu.VMEM((page_size, 1, reads.bank.shape[1]), reads.bank.dtype),
            pltpu.SemaphoreType.DMA((page_size,)),
        ]
    else:
        in_specs = [own] + [pl.BlockSpec(pool_page, page(t, in_pool)) for t in (0, 1)]
        operands.append(reads.values)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, span),
        in_specs=in_specs,
        out_specs=own,
        scratch_shapes=scratch,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret and bank else interpret,
        name=f"{KERNEL_NAME}_w{window}_{'bank' if bank else 'pages'}",
    )(*operands)


def decode_attention(
    q: jax.Array,
    reads: PagedReads,
    coef: jax.Array | float,
    xla: Callable[[jax.Array], jax.Array],
    *,
    span: int,
) -> jax.Array:
    """One query a row, q (B, 1, H, hd) -> (B, 1, H, hd) in q's dtype: coef times the
    attention over each row's window (at most `span` logical pages), by `gpu_attention` when
    the step is lowered for CUDA (head width and page size powers of two, a jax with Pallas's
    Triton backend), by `tpu_attention` when lowered for TPU (head width a multiple of 128
    and pages of a multiple of 8 tokens, Mosaic's tiles), else by `xla(q)` (the XLA
    gathers)."""
    head_dim, page_size = q.shape[-1], reads.k_pages.shape[2]
    power_of_two = head_dim & (head_dim - 1) == 0 and page_size & (page_size - 1) == 0
    tpu_tiles = head_dim % 128 == 0 and page_size % 8 == 0

    def gpu(q: jax.Array) -> jax.Array:
        return through_kernel(lambda q: gpu_attention(q, reads), q, coef)

    def tpu(q: jax.Array) -> jax.Array:
        return through_kernel(lambda q: tpu_attention(q, reads, span), q, coef)

    return jax.lax.platform_dependent(
        q,
        cuda=gpu if power_of_two and pallas_triton is not None else xla,
        tpu=tpu if tpu_tiles else xla,
        default=xla,
    )


def through_kernel(
    run: Callable[[jax.Array], jax.Array], q: jax.Array, coef: jax.Array | float
) -> jax.Array:
    """coef * run(q scaled by 1/sqrt(hd)) for q (B, 1, H, hd), where run maps (B, H, hd) to
    (B, H, hd): (B, 1, H, hd) in q's dtype."""
    out = run(q[:, 0] * jnp.asarray(1.0 / q.shape[-1] ** 0.5, q.dtype))
    return (coef * out.astype(jnp.float32)).astype(q.dtype)[:, None]
