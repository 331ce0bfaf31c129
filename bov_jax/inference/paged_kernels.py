"""A decoding step's attention over pages in Pallas kernels that read each page once.

A decoding row's query at position p attends to positions p - window .. p: the logical pages
from the one holding max(p - window, 0) to the one holding p, named by the row's block
tables. The kernels read exactly those pages, where they are weighed:

  - NVIDIA GPUs (`gpu_attention`, Pallas Triton, a program per row and head): every
    decoding layer, any window. Keys from the layer's K pages; values from its V pages
    (own, or layer 0's for a v1 layer, each pool through its own group's table) or, for a
    bank layer, the rows of the bank table named by the id pages, gathered where weighed.
  - TPUs (JAX's `paged_attention`, Mosaic): the layers that keep V pages in their keys'
    group (one block table) and whose window reaches every position the tables hold (a
    length mask is then the window mask exactly).

Everything else (prefill chunks, CPUs, TPU layers whose window cuts, TPU bank layers) gathers
the pages in XLA ops (`paged._attend`). The choice is made per platform when the step is
lowered (`jax.lax.platform_dependent`), and everywhere XLA ops when the environment sets
BOV_PAGED_KERNEL=0.

Shapes: B rows, H heads, hd head width, P page size, N pages of a pool, W a group's table
width (logical pages), R bank rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas's Triton backend, deprecated since jax 0.11 (Mosaic GPU replaces it)
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:  # a jax without it: XLA ops on GPUs
    pallas_triton = None

COMPUTE_BLOCK = 8  # pages a TPU kernel block processes
KERNEL_NAME = "bov_paged_decode"  # the GPU kernel's name in the HLO (`step_traffic` reads it)


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


def tpu_eligible(window: int, one_table: bool, bank: bool, page_size: int, width: int) -> bool:
    """Whether JAX's TPU kernel is exact for a layer: V pages in the keys' table, and a window
    reaching every position the tables hold (width logical pages)."""
    return one_table and not bank and window + 1 >= width * page_size


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

    def kernel(q_ref, pos_ref, kt_ref, vt_ref, k_ref, v_ref, *rest):  # q, out: (1, 1, hd)
        bank_ref, out_ref = rest if bank else (None, *rest)
        row, head = pl.program_id(0), pl.program_id(1)
        position = pos_ref[row]
        first = jnp.maximum(position - window, 0) // page_size
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

        pages = position // page_size - first + 1
        start = (jnp.float32(-jnp.inf), jnp.float32(0), jnp.zeros((head_dim,), jnp.float32))
        _, total, acc = jax.lax.fori_loop(0, pages, add_page, start)
        out_ref[0, 0, :] = acc / total

    operands = [q, reads.positions, reads.k_tables, reads.v_tables, reads.k_pages, reads.values]
    if bank:
        operands.append(reads.bank)
    own = pl.BlockSpec((1, 1, head_dim), lambda b, h: (b, h, 0))  # the program's row and head
    whole = pl.BlockSpec(memory_space=pl.ANY)  # indexed in the kernel
    params = None if interpret else pallas_triton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        in_specs=[own] + [whole] * (len(operands) - 1),
        out_specs=own,
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=f"{KERNEL_NAME}_w{window}_{'bank' if bank else 'pages'}",
    )(*operands)


def tpu_attention(q: jax.Array, reads: PagedReads, span: int) -> jax.Array:
    """JAX's TPU kernel over the first `span` logical pages (`tpu_eligible`: the window reaches
    every position held, so it is each row's first position + 1 of them): (B, H, hd)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    tables = reads.k_tables[:, :span]
    return paged_attention(
        q,
        reads.k_pages.astype(q.dtype),
        reads.values.astype(q.dtype),
        reads.positions + 1,
        tables,
        pages_per_compute_block=math.gcd(COMPUTE_BLOCK, span),
    )


def decode_attention(
    q: jax.Array,
    reads: PagedReads,
    coef: jax.Array | float,
    xla: Callable[[jax.Array], jax.Array],
    *,
    tpu_span: int | None,
) -> jax.Array:
    """One query a row, q (B, 1, H, hd) -> (B, 1, H, hd) in q's dtype: coef times the
    attention over each row's window, by `gpu_attention` when the step is lowered for CUDA
    (head width and page size powers of two, a jax with Pallas's Triton backend), by JAX's
    TPU kernel when lowered for TPU where `tpu_span` is given (the layer is `tpu_eligible`;
    head width a multiple of 128 and pages of a multiple of 8 tokens, Mosaic's tiles), else
    by `xla(q)` (the XLA gathers)."""
    head_dim, page_size = q.shape[-1], reads.k_pages.shape[2]
    power_of_two = head_dim & (head_dim - 1) == 0 and page_size & (page_size - 1) == 0
    tpu_tiles = head_dim % 128 == 0 and page_size % 8 == 0

    def gpu(q: jax.Array) -> jax.Array:
        return through_kernel(lambda q: gpu_attention(q, reads), q, coef)

    def tpu(q: jax.Array) -> jax.Array:
        return through_kernel(lambda q: tpu_attention(q, reads, tpu_span), q, coef)

    return jax.lax.platform_dependent(
        q,
        cuda=gpu if power_of_two and pallas_triton is not None else xla,
        tpu=tpu if tpu_tiles and tpu_span is not None else xla,
        default=xla,
    )


def through_kernel(
    run: Callable[[jax.Array], jax.Array], q: jax.Array, coef: jax.Array | float
) -> jax.Array:
    """coef * run(q scaled by 1/sqrt(hd)) for q (B, 1, H, hd), where run maps (B, H, hd) to
    (B, H, hd): (B, 1, H, hd) in q's dtype."""
    out = run(q[:, 0] * jnp.asarray(1.0 / q.shape[-1] ** 0.5, q.dtype))
    return (coef * out.astype(jnp.float32)).astype(q.dtype)[:, None]
