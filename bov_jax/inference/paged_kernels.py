"""A decoding step's attention over pages in JAX's own Pallas kernels, where they are exact.

JAX ships paged-attention kernels for one query per sequence over head-major pages
(H, pages, P, hd) and a block table per sequence: `jax.experimental.pallas.ops.gpu.
paged_attention` (Triton) and `...ops.tpu.paged_attention` (Mosaic). Neither masks a sliding
window, both read K and V through one block table, and neither has a V-free mode. So a
layer's decoding attention runs in them only where

  - the layer keeps V pages (own, or v1 with layer 0's V pool in its keys' group: one table),
  - its window reaches every position the engine holds (window + 1 >= the tables' width in
    tokens): a length mask is then the window mask exactly;

elsewhere (bank layers, windows that cut, prefill chunks, CPUs) `paged` gathers the pages
in XLA ops; BoV layers weigh their bank rows in `bank_gather`'s kernel on NVIDIA GPUs. The
choice is made per platform when the step is lowered (`jax.lax.platform_dependent`, as
`bank_gather`), and everywhere XLA ops when the environment sets BOV_PAGED_KERNEL=0.

Shapes: B rows, H heads, hd head width, P page size, span logical pages read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bov_jax.inference.layout import BANK, CacheLayout, LayerReads

GPU_K_SPLITS = 16  # the GPU kernel's partitions of a sequence's pages
COMPUTE_BLOCK = 8  # pages a kernel block processes


def eligible(reads: LayerReads, layout: CacheLayout, queries: int, table_width: int) -> bool:
    """Whether a layer's attention in this step may run in a paged kernel (module doc)."""
    if os.environ.get("BOV_PAGED_KERNEL") == "0" or queries != 1 or reads.mode == BANK:
        return False
    one_table = layout.pool(reads.keys).group == layout.pool(reads.values).group
    return one_table and reads.window + 1 >= table_width * layout.page_size


def gpu_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    tables: jax.Array,
    lengths: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention of q (B, H, hd), already scaled by 1/sqrt(hd), over each row's first
    lengths[b] positions of pages (H, N, P, hd) named by tables (B, span): (B, H, hd)."""
    from jax.experimental.pallas.ops.gpu import paged_attention

    span = tables.shape[1]
    splits = math.gcd(GPU_K_SPLITS, span)
    return paged_attention.paged_attention(
        q,
        k_pages,
        v_pages,
        tables,
        lengths,
        k_splits=splits,
        pages_per_compute_block=math.gcd(COMPUTE_BLOCK, span // splits),
        interpret=interpret,
    )


def tpu_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array
) -> jax.Array:
    """`gpu_attention`'s contract in the TPU kernel."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(
        q,
        k_pages,
        v_pages,
        lengths,
        tables,
        pages_per_compute_block=math.gcd(COMPUTE_BLOCK, tables.shape[1]),
    )


def decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    tables: jax.Array,
    lengths: jax.Array,
    coef: jax.Array | float,
    xla: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """One query a row, q (B, 1, H, hd) -> (B, 1, H, hd) in q's dtype: coef times the
    attention over each row's first lengths[b] positions, by the platform's kernel when
    the step is lowered for CUDA (head width and page size powers of two, Triton's blocks)
    or TPU (head width a multiple of 128 and pages of a multiple of 8 tokens, Mosaic's
    tiles), else by `xla(q)` (the XLA gathers)."""
    head_dim, page_size = q.shape[-1], k_pages.shape[2]
    power_of_two = head_dim & (head_dim - 1) == 0 and page_size & (page_size - 1) == 0
    tpu_tiles = head_dim % 128 == 0 and page_size % 8 == 0

    def kernel(run: Callable[..., jax.Array]) -> Callable[[jax.Array], jax.Array]:
        def attend(q: jax.Array) -> jax.Array:
            scaled = q[:, 0] * jnp.asarray(1.0 / q.shape[-1] ** 0.5, q.dtype)
            out = run(scaled, k_pages.astype(q.dtype), v_pages.astype(q.dtype), tables, lengths)
            return (coef * out.astype(jnp.float32)).astype(q.dtype)[:, None]

        return attend

    return jax.lax.platform_dependent(
        q,
        cuda=kernel(gpu_attention) if power_of_two else xla,
        tpu=kernel(tpu_attention) if tpu_tiles else xla,
        default=xla,
    )
