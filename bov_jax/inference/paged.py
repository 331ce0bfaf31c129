"""The engine's one jitted step: new tokens of many sequences through the model over pages.

Shapes: B rows (one sequence each), C new tokens a row, D model width, H heads, hd head
width, P tokens a page (`CacheLayout.page_size`), W_g the width of group g's block tables
(logical pages a sequence may use), V vocab.

A row holds `counts[b]` new tokens from column 0 at positions start[b] .. start[b] +
counts[b] - 1: a prompt chunk (C > 1) or one decoding token (C == 1); rows past the
batch's sequences, and columns past a row's count, are padding. Each layer writes the new
keys (and values, for an own layer; the ids once, for the bank layers) into the pages the
block tables name, then reads the pages its window reaches: a static `span` of logical
pages from the one holding start - window, gathered by the tables in XLA ops. A decoding
step (C == 1) runs each layer's attention in `paged_kernels` instead where the platform has
one (NVIDIA GPUs and TPUs: windows, V pages and bank rows read where weighed). Off NVIDIA
GPUs the gathers take the span `block_pages` pages at a time with an online softmax, so a
step never holds more than one block of a layer's keys and values gathered (on GPUs,
prefill chunks and BOV_PAGED_KERNEL=0 steps, the span is one block). A bank layer's table
comes as words (`bank_words`; the engine's `serving_params`), unpacked where read.
Padding writes go to the null page, and padding queries repeat their row's last position,
so every query sees at least one key and nothing non-finite reaches a page.

The previous token's embedding, which the smear mixes in, is recomputed from its id
(`previous`): the step keeps no per-sequence state but the pages.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from bov_jax.inference import bank_words, paged_kernels
from bov_jax.inference.decode import smear_continuing
from bov_jax.inference.layout import (
    BANK,
    NULL_PAGE,
    OWN,
    CacheLayout,
    LayerReads,
    pages_touched,
)
from bov_jax.model import layers
from bov_jax.model.gpt import GPT, ValueContext

Pools = dict[str, jax.Array]  # pool name -> (H, pages, P, hd) or (pages, P)
BLOCK_PAGES = 32  # logical pages the XLA attention weighs at a time (`forward_step`)


class StepInput(NamedTuple):
    """One step's rows, built on the host by the scheduler; a pytree."""

    tokens: jax.Array  # (B, C) int32: each row's new tokens from column 0
    start: jax.Array  # (B,) int32: the position of tokens[:, 0]
    counts: jax.Array  # (B,) int32: new tokens in the row (0: a padding row)
    previous: jax.Array  # (B,) int32: the token at start - 1 (anything where start is 0)
    tables: tuple[jax.Array, ...]  # per group (B, W_g) int32: logical page -> page


def init_pools(layout: CacheLayout, pages: Sequence[int]) -> Pools:
    """Zeroed pools, `pages[g]` pages in each pool of group g (page 0 is the null page)."""
    return {
        pool.name: jnp.zeros(*layout.pool_shape(pool, pages[pool.group])) for pool in layout.pools
    }


def abstract_pools(layout: CacheLayout, pages: Sequence[int]) -> dict:
    """`init_pools`' shapes as ShapeDtypeStructs (nothing allocated)."""
    return jax.eval_shape(lambda: init_pools(layout, pages))


def bucket(n: int, cap: int) -> int:
    """n rounded up to a power of two, at most cap (few compiled shapes)."""
    return min(1 << (max(n, 1) - 1).bit_length(), cap)


def buckets(cap: int) -> int:
    """How many values `bucket(n, cap)` takes for n = 1 .. cap."""
    return len({bucket(n, cap) for n in range(1, cap + 1)})


def spans_for(
    layout: CacheLayout, end_page: int, columns: int, width: int
) -> tuple[tuple[int, int], ...]:
    """((window, logical pages read), ...) for each window of the layout's layers, in a step
    of `columns` tokens a row whose last page is `end_page` (the largest among its rows).

    A row's queries read positions start - window .. start + columns - 1 (window + columns
    positions), from the page holding the first to the one holding the last: at most
    end_page + 1 pages, rounded up to a power of two (so a step's spans follow from end_page's
    bucket and columns: few compiled shapes), and never more than the most pages that many
    consecutive positions can touch (`layout.pages_touched`), a constant of the window and
    columns, not rounded (a short window reads its few pages, not the next power of two)."""
    size = layout.page_size
    reach = bucket(end_page + 1, width)
    return tuple(
        (window, min(reach, pages_touched(window + columns, size), width))
        for window in sorted({reads.window for reads in layout.layers})
    )


def _write(pool: jax.Array, pages: jax.Array, offsets: jax.Array, new: jax.Array) -> jax.Array:
    """Write new (B, C, H, hd), or (B, C) ids, at (pages, offsets) (B, C) of a pool."""
    if pool.ndim == 2:
        return pool.at[pages, offsets].set(new.astype(pool.dtype))
    return pool.at[:, pages, offsets].set(jnp.moveaxis(new, 2, 0).astype(pool.dtype))


def _gathered(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """The slots of pages (B, span): (H, B, span * P, hd), or (B, span * P) for ids."""
    if pool.ndim == 2:
        return pool[pages].reshape(pages.shape[0], -1)
    heads, _, size, head_dim = pool.shape
    return pool[:, pages].reshape(heads, pages.shape[0], pages.shape[1] * size, head_dim)


class Rows(NamedTuple):
    """Where a step's tokens sit, derived once per step from its `StepInput`."""

    positions: jax.Array  # (B, C): each query's position (padding repeats its row's last)
    write: tuple[tuple[jax.Array, jax.Array], ...]  # per group: (pages, offsets) (B, C)


def _rows(inputs: StepInput, size: int) -> Rows:
    columns = jnp.arange(inputs.tokens.shape[1])[None, :]
    last = jnp.maximum(inputs.counts - 1, 0)[:, None]
    positions = inputs.start[:, None] + jnp.minimum(columns, last)
    valid = columns < inputs.counts[:, None]
    write = tuple(
        (
            jnp.where(valid, jnp.take_along_axis(table, positions // size, axis=1), NULL_PAGE),
            positions % size,
        )
        for table in inputs.tables
    )
    return Rows(positions, write)


def _attend(
    attn,
    q: jax.Array,
    reads: LayerReads,
    pools: Pools,
    layout: CacheLayout,
    inputs: StepInput,
    rows: Rows,
    span: int,
    block_pages: int,
    bank_dtype: jnp.dtype,
) -> jax.Array:
    """One layer's attention over its pages: q (B, C, H, hd) -> (B, C, H, hd). `block_pages`:
    logical pages the XLA path weighs at a time off NVIDIA GPUs (`forward_step`);
    `bank_dtype`: the dtype of the values a bank layer's words hold (`bank_words`)."""
    size, window = layout.page_size, reads.window
    batch, columns, heads, head_dim = q.shape
    first = jnp.maximum(inputs.start - window, 0) // size
    coef = 1.0 if reads.mode == OWN else attn.value.replace_coef()
    bank = attn.value.bank.embedding[...] if reads.mode == BANK else None  # (R, 1, K) words

    def pages(pool: str, logical: jax.Array) -> jax.Array:
        table = inputs.tables[layout.pool(pool).group]
        return jnp.take_along_axis(table, jnp.minimum(logical, table.shape[1] - 1), axis=1)

    def scores(q: jax.Array, logical: jax.Array) -> jax.Array:
        """Scaled logits (B, H, C, n * P) fp32 over logical pages (B, n), -inf where the
        window hides a slot (also pages past a row's last token)."""
        keys = _gathered(pools[reads.keys], pages(reads.keys, logical))  # (H, B, n * P, hd)
        key_positions = (logical[..., None] * size + jnp.arange(size)).reshape(batch, -1)
        distance = rows.positions[:, :, None] - key_positions[:, None, :]  # (B, C, n * P)
        visible = (distance >= 0) & (distance <= window)
        logits = jnp.einsum(
            "bqhd,hbsd->bhqs", q, keys.astype(q.dtype), preferred_element_type=jnp.float32
        )
        return jnp.where(visible[:, None], logits / jnp.sqrt(jnp.float32(head_dim)), -jnp.inf)

    def weighed(p: jax.Array, logical: jax.Array, value_pool: jax.Array) -> jax.Array:
        """sum_s p[b, h, q, s] * V[b, s, h] over the slots of logical (B, n): (B, C, H, hd)
        fp32, V from the layer's V pages or, for a bank layer, its table rows by id."""
        if reads.mode == BANK:  # the words of the ids' rows, unpacked: (H, B, n * P, hd)
            ids = _gathered(value_pool, pages("ids", logical))
            rows = bank_words.unpack(bank[ids][:, :, 0], heads, bank_dtype)
            values = jnp.moveaxis(rows.reshape(*ids.shape, heads, head_dim), 2, 0)
        else:
            values = _gathered(value_pool, pages(reads.values, logical))
        return jnp.einsum(
            "bhqs,hbsd->bqhd",
            p.astype(q.dtype),
            values.astype(q.dtype),
            preferred_element_type=jnp.float32,
        )

    def xla(q: jax.Array, blocks: int) -> jax.Array:
        """The gathers in XLA ops: one block, the softmax over the span; more, `blocks`
        blocks of the span one after another with an online softmax (running max and
        sum), so that what is gathered at once is one block's keys and values."""
        # The values' pool passes a barrier with the queries: without it XLA hoists the
        # reads that depend only on token ids (bank rows, a bank layer's V pages) of every
        # layer to the start of the step, all live at once (gigabytes at serving batches).
        q, value_pool = jax.lax.optimization_barrier((q, pools[reads.values]))
        if blocks == 1:
            logical = first[:, None] + jnp.arange(span)[None, :]  # (B, span)
            weights = jax.nn.softmax(scores(q, logical), axis=-1) * coef
            return weighed(weights, logical, value_pool).astype(q.dtype)
        per = -(-span // blocks)
        logical = first[:, None] + jnp.arange(blocks * per)[None, :]  # (B, blocks * per)

        def add_block(i: jax.Array, carry: tuple) -> tuple:
            top, total, acc = carry  # (B, H, C), (B, H, C), (B, C, H, hd) fp32
            these = jax.lax.dynamic_slice_in_dim(logical, i * per, per, axis=1)
            logits = scores(q, these)
            new_top = jnp.maximum(top, logits.max(axis=-1))
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # nothing seen yet
            p = jnp.exp(logits - shift[..., None])
            rescale = jnp.exp(top - shift)
            total = total * rescale + p.sum(axis=-1)
            acc = acc * jnp.swapaxes(rescale, 1, 2)[..., None] + weighed(p, these, value_pool)
            return new_top, total, acc

        start = (
            jnp.full((batch, heads, columns), -jnp.inf),
            jnp.zeros((batch, heads, columns)),
            jnp.zeros((batch, columns, heads, head_dim)),
        )
        _, total, acc = jax.lax.fori_loop(0, blocks, add_block, start)
        scale = coef / jnp.swapaxes(total, 1, 2)[..., None]  # every query sees its own slot
        return (acc * scale).astype(q.dtype)

    def gathers(q: jax.Array) -> jax.Array:
        # On NVIDIA GPUs the whole span at once; elsewhere block by block.
        blocked = functools.partial(xla, blocks=-(-span // block_pages))
        return jax.lax.platform_dependent(q, cuda=functools.partial(xla, blocks=1), default=blocked)

    if columns > 1 or not paged_kernels.enabled():
        return gathers(q)
    k_group, v_group = layout.pool(reads.keys).group, layout.pool(reads.values).group
    kernel_reads = paged_kernels.PagedReads(
        k_pages=pools[reads.keys],
        values=pools[reads.values],
        k_tables=inputs.tables[k_group],
        v_tables=inputs.tables[v_group],
        positions=rows.positions[:, 0].astype(jnp.int32),
        window=window,
        bank=bank,
        bank_dtype=bank_dtype,
    )
    return paged_kernels.decode_attention(q, kernel_reads, coef, gathers, span=span)


def hidden_paged(
    model: GPT,
    pools: Pools,
    inputs: StepInput,
    layout: CacheLayout,
    spans: Mapping[int, int],
    block_pages: int,
) -> tuple[jax.Array, Pools]:
    """The final residual stream (B, C, D) of the new tokens, and the pools they were
    written into. spans: window -> logical pages its layers read (`spans_for`);
    block_pages: logical pages the XLA attention weighs at a time off NVIDIA GPUs."""
    spec, size = model.spec, layout.page_size
    rows = _rows(inputs, size)
    pools = dict(pools)

    def write(pool: str, new: jax.Array) -> None:
        pages, offsets = rows.write[layout.pool(pool).group]
        pools[pool] = _write(pools[pool], pages, offsets, new)

    e = model.embed(inputs.tokens)
    x = smear_continuing(model, e, model.embed(inputs.previous[:, None]), rows.positions)
    if "ids" in pools:
        write("ids", inputs.tokens)
    ctx = ValueContext(token_ids=inputs.tokens, x0n=layers.rms_norm(x), v1=None)
    positions = inputs.tables[0].shape[1] * size
    tables = layers.rotary_tables(positions, spec.head_dim, spec.rope_base)
    cos, sin = layers.rotary_at(tables, rows.positions)
    for i, block in enumerate(model.blocks):
        reads, attn = layout.layers[i], block.attn
        h = layers.rms_norm(x)
        q, k_new = attn.queries_keys(h, cos, sin)
        write(reads.keys, k_new)
        if reads.mode == OWN:
            v_new = attn.value(h, ctx)
            write(reads.values, attn.heads(v_new))
            if i == 0:
                ctx = ctx._replace(v1=v_new)
        span, dtype = spans[reads.window], spec.compute_dtype
        y = _attend(attn, q, reads, pools, layout, inputs, rows, span, block_pages, dtype)
        x = x + attn.output(y)
        x = x + block.mlp(layers.rms_norm(x))
    return x, pools


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "layout", "spans", "block_pages", "every_position"),
    donate_argnames=("pools",),
)
def forward_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    pools: Pools,
    inputs: StepInput,
    *,
    layout: CacheLayout,
    spans: tuple[tuple[int, int], ...],
    block_pages: int = BLOCK_PAGES,
    every_position: bool = False,
) -> tuple[jax.Array, Pools]:
    """(logits fp32, the pools written): of each row's last new token (B, V), or with
    every_position of every column (B, C, V) (scoring a prompt: each position's next-token
    distribution; padding columns repeat their row's last). The pools are donated: the step
    updates them in place. block_pages: logical pages the XLA attention weighs at a time off
    NVIDIA GPUs (a block's keys and values are what it gathers at once)."""
    model = nnx.merge(graphdef, params)
    x, pools = hidden_paged(model, pools, inputs, layout, dict(spans), block_pages)
    if every_position:
        return model.logits(x), pools
    last = jnp.maximum(inputs.counts - 1, 0)[:, None, None]
    return model.logits(jnp.take_along_axis(x, last, axis=1))[:, 0], pools
