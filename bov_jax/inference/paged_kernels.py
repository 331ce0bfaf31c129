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

from bov_jax.inference import bank_words

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
    bank: jax.Array | None  # (R, 1, K) uint32: a bank layer's table as words (values: ids)
    bank_dtype: jnp.dtype | None = None  # the dtype of the values the words hold


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
    online softmax: it reads the K page, then the V page or the id page and the words of the
    bank rows it names (head h's, unpacked as weighed: `bank_words`), each once. hd and P
    powers of two. `interpret`: Pallas interpret mode (any platform; for tests)."""
    batch, heads, head_dim = q.shape
    page_size = reads.k_pages.shape[2]
    window, bank = reads.window, reads.bank is not None
    # a head's values as `parts` runs of `width` columns: its words' halves, or its V columns
    parts = bank_words.halves(reads.bank_dtype) if bank else 1
    width = head_dim // parts

    def kernel(pos_ref, kt_ref, vt_ref, q_ref, k_ref, v_ref, *rest):  # q: (1, 1, hd)
        bank_ref, out_ref = rest if bank else (None, *rest)  # out: (1, 1, parts, width)
        row, head = pl.program_id(0), pl.program_id(1)
        position = pos_ref[row]
        first, pages = window_pages(position, window, page_size)
        query = q_ref[0, 0, :].astype(jnp.float32)
        columns = head * width + jnp.arange(width)  # the head's words

        def add_page(i: jax.Array, carry: tuple) -> tuple:
            top, total, acc = carry  # () fp32, () fp32, parts x (width,) fp32
            logical = first + i
            keys = k_ref[head, kt_ref[row, logical], :, :].astype(jnp.float32)  # (P, hd)
            slots = logical * page_size + jnp.arange(page_size)
            seen = (slots <= position) & (slots >= position - window)
            logits = jnp.where(seen, jnp.sum(keys * query[None, :], axis=1), -jnp.inf)
            new_top = jnp.maximum(top, jnp.max(logits))  # finite: each page has a seen slot
            p = jnp.exp(logits - new_top)[:, None]
            rescale = jnp.exp(top - new_top)
            if bank:
                ids = v_ref[vt_ref[row, logical], :]  # (P,)
                cells = bank_ref.at[ids[:, None], columns[None, :]]
                words = pallas_triton.load(cells, mask=seen[:, None], other=0)  # (P, width)
                values = [bank_words.half(words, j, reads.bank_dtype) for j in range(parts)]
            else:
                values = [v_ref[head, vt_ref[row, logical], :, :].astype(jnp.float32)]
            acc = tuple(a * rescale + jnp.sum(p * v, axis=0) for a, v in zip(acc, values))
            return new_top, total * rescale + jnp.sum(p), acc

        zeros = tuple(jnp.zeros((width,), jnp.float32) for _ in range(parts))
        start = (jnp.float32(-jnp.inf), jnp.float32(0), zeros)
        _, total, acc = jax.lax.fori_loop(0, pages, add_page, start)
        for j, a in enumerate(acc):
            out_ref[0, 0, j, :] = a / total

    operands = [reads.positions, reads.k_tables, reads.v_tables, q, reads.k_pages, reads.values]
    if bank:
        operands.append(reads.bank.reshape(reads.bank.shape[0], -1))  # (R, K)
    own = pl.BlockSpec((1, 1, head_dim), lambda b, h: (b, h, 0))  # the program's row and head
    whole = pl.BlockSpec(memory_space=pl.ANY)  # indexed in the kernel
    params = None if interpret else pallas_triton.CompilerParams(num_warps=4, num_stages=2)
    out = pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[whole] * 3 + [own] + [whole] * (len(operands) - 4),
        out_specs=pl.BlockSpec((1, 1, parts, width), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, parts, width), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=f"{KERNEL_NAME}_w{window}_{'bank' if bank else 'pages'}",
    )(*operands)
    return out.reshape(batch, heads, head_dim)


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
    per slot, the bank rows it names (words, (1, K): a row of the (R, 1, K) words is a tile).
    A step past the row's last page names that page again, which Pallas does not fetch twice,
    and is skipped. Online softmax over a row's steps in VMEM. A bank layer weighs its words
    `lanes` at a time, each half of them (`bank_words.half`) with the probabilities of the
    head its lane belongs to, into an accumulator in the words' order, put back in the heads'
    after the kernel. `interpret`: Pallas's interpret mode (any platform; for tests), its TPU
    interpreter (which simulates DMAs and semaphores) for a bank layer."""
    batch, heads, head_dim = q.shape
    page_size = reads.k_pages.shape[2]
    window, bank = reads.window, reads.bank is not None
    # (B * span,): flat, as scalar memory pads a 2-D array's rows
    k_entries, v_entries = (
        window_tables(t, reads.positions, window, page_size, span).reshape(-1)
        for t in (reads.k_tables, reads.v_tables)
    )
    if bank:  # K words a row, `per_head` a head, weighed `lanes` at a time, in `parts` halves
        words = reads.bank.shape[2]
        parts, per_head = bank_words.halves(reads.bank_dtype), words // heads
        lanes = 128 if words % 128 == 0 else words
        chunks = words // lanes

    def page(table: int, block_at: Callable[[jax.Array], tuple]) -> Callable:
        """The index map of a pool's block: `block_at` the page that table `table` (0 the
        keys', 1 the values') names at step i."""

        def index_map(row, i, positions_ref, *entries_refs):
            count = window_pages(positions_ref[row], window, page_size)[1]
            return block_at(entries_refs[table][row * span + jnp.minimum(i, count - 1)])

        return index_map

    def in_pool(page: jax.Array) -> tuple:  # a page of (H, N, P, hd), all heads
        return 0, page, 0, 0

    def by_lane(chunk: int, of_head: Callable[[int], jax.Array], shape: tuple) -> jax.Array:
        """An array of `shape` (..., lanes) whose lanes hold of_head(h) (broadcast) where
        word chunk `chunk`'s lane belongs to head h."""
        lane = chunk * lanes + jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        low, high = chunk * lanes // per_head, ((chunk + 1) * lanes - 1) // per_head
        out = jnp.broadcast_to(of_head(low), shape)
        for h in range(low + 1, high + 1):
            out = jnp.where(lane >= h * per_head, of_head(h), out)
        return out

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
            if bank:  # the page's rows, all heads' words: a DMA per slot, all in flight
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
            total_ref[...] = total_ref[...] * rescale + jnp.sum(p, axis=1, keepdims=True)
            top_ref[...] = new_top
            by_slot = p[:, :, None]  # (H, P, 1)
            if not bank:
                values = v_ref[...].astype(jnp.float32)  # (H, P, hd)
                acc_ref[...] = acc_ref[...] * rescale + jnp.sum(by_slot * values, axis=1)
                return
            for copy in copies:
                copy.wait()
            for chunk in range(chunks):
                these = rows_ref[:, 0, chunk * lanes : (chunk + 1) * lanes]  # (P, lanes)
                weights = by_lane(chunk, lambda h: by_slot[h], (page_size, lanes))
                scale = by_lane(chunk, lambda h: rescale[h : h + 1], (1, lanes))
                for j in range(parts):
                    values = bank_words.half(these, j, reads.bank_dtype)
                    at = chunk * parts + j
                    weighed = jnp.sum(weights * values, axis=0, keepdims=True)
                    acc_ref[at : at + 1, :] = acc_ref[at : at + 1, :] * scale + weighed

        @pl.when(i == span - 1)
        def _finish() -> None:
            if not bank:
                out_ref[...] = acc_ref[...] / total_ref[...]
                return
            total = total_ref[...]
            for chunk in range(chunks):
                over = by_lane(chunk, lambda h: total[h : h + 1], (1, lanes))
                at = slice(chunk * parts, (chunk + 1) * parts)
                out_ref[at, :] = acc_ref[at, :] / over

    own = pl.BlockSpec((None, heads, head_dim), lambda row, i, *_: (row, 0, 0))
    pool_page = (heads, None, page_size, head_dim)
    scratch = [pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32)]
    operands = [reads.positions, k_entries, v_entries, q, reads.k_pages]
    if bank:  # ids (N, 1, P): a page's ids a block; words (R, 1, K): a row a block
        ids_page = (None, 1, page_size)
        ids = pl.BlockSpec(ids_page, page(1, lambda n: (n, 0, 0)), memory_space=pltpu.SMEM)
        in_specs = [
            own,
            pl.BlockSpec(pool_page, page(0, in_pool)),
            ids,
            pl.BlockSpec(memory_space=pl.ANY),
        ]
        operands += [reads.values[:, None], reads.bank]
        accumulated = (chunks * parts, lanes)  # the weighed halves, in the words' order
        out_spec = pl.BlockSpec((None, *accumulated), lambda row, i, *_: (row, 0, 0))
        scratch += [
            pltpu.VMEM(accumulated, jnp.float32),
            pltpu.VMEM((page_size, 1, words), reads.bank.dtype),
            pltpu.SemaphoreType.DMA((page_size,)),
        ]
    else:
        in_specs = [own] + [pl.BlockSpec(pool_page, page(t, in_pool)) for t in (0, 1)]
        operands.append(reads.values)
        accumulated, out_spec = (heads, head_dim), own
        scratch.append(pltpu.VMEM(accumulated, jnp.float32))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, span),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=jax.ShapeDtypeStruct((batch, *accumulated), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret and bank else interpret,
        name=f"{KERNEL_NAME}_w{window}_{'bank' if bank else 'pages'}",
    )(*operands)
    if not bank:
        return out
    # (B, chunk, part, lane) -> (B, part, word) -> (B, H, part, column) -> (B, H, hd)
    by_part = jnp.swapaxes(out.reshape(batch, chunks, parts, lanes), 1, 2)
    by_head = jnp.swapaxes(by_part.reshape(batch, parts, heads, per_head), 1, 2)
    return by_head.reshape(batch, heads, head_dim)


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
    Triton backend), by `tpu_attention` when lowered for TPU (head width and a bank row's
    words multiples of 128, pages of a multiple of 8 tokens: Mosaic's tiles), else by
    `xla(q)` (the XLA gathers)."""
    head_dim, page_size = q.shape[-1], reads.k_pages.shape[2]
    power_of_two = head_dim & (head_dim - 1) == 0 and page_size & (page_size - 1) == 0
    rows_in_lanes = reads.bank is None or reads.bank.shape[2] % 128 == 0
    tpu_tiles = head_dim % 128 == 0 and page_size % 8 == 0 and rows_in_lanes

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
