"""KV-cached decoding: a cache pytree, a cached forward, and a jitted generate engine.

Shapes: B batch, T new tokens, S cache slots (max_len), H heads, hd head dim, K = H * hd,
D model width, V vocab.

Every layer caches its keys (B, S, H, hd). Values are cached only where they cannot be
rebuilt from something already held (spec section 8, paper section 4):

  own   the layer's values depend on the context: a V cache (B, S, H, hd).
  bank  an id-only target (source=bank, combine=replace): no V cache. The cache keeps the
        token-id history (B, S) once; attention weights come first, then each visible slot's
        row of E_l is read where it is weighed (`attention.cached_table_attention`: the slots
        the layer's window reaches, a static count, and in a decoding step a gather fused
        into the weighted sum), V = coef * E_l[ids] never stored.
        `eliminate_bank_v=False` keeps a V cache instead.
  v1    a source=v1, combine=replace target: V = coef * V1, and V1 at past positions is
        exactly layer 0's V cache, so the layer reads that instead of holding a copy.

Prompts of different lengths all start at position 0 (the token buffer is right-padded,
the padding is never attended): `generate` prefills the shortest prompt's length for the
whole batch in one call, then steps one token at a time, feeding each row its own next
prompt token while it is still inside its prompt and its sampled token afterwards. Every
row sees exactly the positions and smear inputs of an unpadded forward, and the cache
needs one scalar position for the batch; the price is that prompt tokens past the
shortest prompt are processed one step at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.inference import attention, sampling
from bov_jax.inference.layout import BANK, OWN, value_modes
from bov_jax.model import layers
from bov_jax.model.gpt import GPT, Block, ValueContext
from bov_jax.model.spec import ModelSpec

SLOT_MULTIPLE = 64  # generate rounds its cache length up to this, to reuse compilations


class KVCache(NamedTuple):
    """The decoding state of a batch; a pytree (None leaves are absent arrays)."""

    k: tuple[jax.Array, ...]  # per layer (B, S, H, hd): rotated, normed, scaled keys
    v: tuple[jax.Array | None, ...]  # per layer (B, S, H, hd), None where V is rebuilt
    token_ids: jax.Array | None  # (B, S) int32 history, present when a layer gathers V
    prev_embedding: jax.Array  # (B, 1, D) pre-smear normalized embedding of the last token
    pos: jax.Array  # () int32: tokens processed so far (the next token's position)


def init_cache(
    spec: ModelSpec,
    batch: int,
    max_len: int,
    dtype: jnp.dtype | None = None,
    eliminate_bank_v: bool = True,
) -> KVCache:
    """An empty cache of `max_len` slots; K/V in `dtype` (default: the compute dtype).

    The previous embedding stays in the compute dtype, so the smear of a decode step
    matches the full forward exactly.
    """
    dtype = dtype or spec.compute_dtype
    slots = jnp.zeros((batch, max_len, spec.n_head, spec.head_dim), dtype)
    modes = value_modes(spec, eliminate_bank_v)
    return KVCache(
        k=tuple(slots for _ in modes),
        v=tuple(slots if m == OWN else None for m in modes),
        token_ids=jnp.zeros((batch, max_len), jnp.int32) if BANK in modes else None,
        prev_embedding=jnp.zeros((batch, 1, spec.d_model), spec.compute_dtype),
        pos=jnp.zeros((), jnp.int32),
    )


def _write(buffer: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """Write new (B, T, ...) into buffer (B, S, ...) at slots [pos, pos + T)."""
    start = (0, pos) + (0,) * (buffer.ndim - 2)
    return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype), start)


def smear_continuing(model: GPT, e: jax.Array, prev: jax.Array, positions: jax.Array) -> jax.Array:
    """The smear of new tokens given the previous token's embedding.

    e: (B, T, D) pre-smear embeddings at `positions` (T,) or (B, T); prev: (B, 1, D) the
    embedding of the token before e[:, 0]. Position 0 is left unchanged (spec 1.2).
    """
    before = jnp.concatenate([prev.astype(e.dtype), e[:, :-1]], axis=1)
    mixed = e + model.smear_gate_values(e) * before
    return jnp.where((jnp.broadcast_to(positions, e.shape[:2]) > 0)[..., None], mixed, e)


def _block(
    block: Block,
    x: jax.Array,
    ctx: ValueContext,
    cache: KVCache,
    layer: int,
    mode: str,
    rope: tuple[jax.Array, jax.Array, jax.Array],
    v0: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """One block on new tokens x (B, T, D) against its layer's cache (ids already written).

    mode: how the layer rebuilds its values if its V slot is None; rope: (cos, sin,
    positions (T,)); v0: layer 0's V cache after this call's write. Returns (x, the
    layer's K cache, its V cache, its values of the new tokens (B, T, K)); the last two
    are None for a layer without a V cache.
    """
    attn, pos = block.attn, cache.pos
    cos, sin, positions = rope
    h = layers.rms_norm(x)
    q, k_new = attn.queries_keys(h, cos, sin)
    k = _write(cache.k[layer], k_new, pos)
    v, v_new = cache.v[layer], None
    mask = dict(q_positions=positions, k_length=pos + x.shape[1], window=attn.window)
    if v is None and mode == BANK:  # V = coef * E_l[ids], gathered inside the attention
        table = attn.value.bank.embedding[...]
        coef = attn.value.replace_coef()
        y = attention.cached_table_attention(
            q, k.astype(q.dtype), table, cache.token_ids, **mask, scale=coef
        )
    else:
        if v is None:  # V1: V = coef * layer 0's V cache
            v_all = attn.value.replace_coef() * v0
        else:
            v_new = attn.value(h, ctx)
            v = v_all = _write(v, attn.heads(v_new), pos)
        y = attention.cached_attention(q, k.astype(q.dtype), v_all.astype(q.dtype), **mask)
    x = x + attn.output(y)
    return x + block.mlp(layers.rms_norm(x)), k, v, v_new


def hidden_cached(model: GPT, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """The final residual stream (B, T, D) of tokens (B, T) at positions pos..pos+T-1.

    Which layers rebuild their values is read off the cache (a None V slot).
    """
    spec, pos = model.spec, cache.pos
    positions = pos + jnp.arange(tokens.shape[1])
    e = model.embed(tokens)
    x = smear_continuing(model, e, cache.prev_embedding, positions)
    if cache.token_ids is not None:
        cache = cache._replace(token_ids=_write(cache.token_ids, tokens, pos))
    ctx = ValueContext(token_ids=tokens, x0n=layers.rms_norm(x), v1=None)
    tables = layers.rotary_tables(cache.k[0].shape[1], spec.head_dim, spec.rope_base)
    cos, sin = layers.rotary_at(tables, positions)
    modes = value_modes(spec)  # a layer's mode when its V slot is None
    ks, vs = [], []
    for i, block in enumerate(model.blocks):
        v0 = vs[0] if vs else None
        x, k, v, v_new = _block(block, x, ctx, cache, i, modes[i], (cos, sin, positions), v0)
        if i == 0:
            ctx = ctx._replace(v1=v_new)
        ks.append(k)
        vs.append(v)
    cache = cache._replace(
        k=tuple(ks), v=tuple(vs), prev_embedding=e[:, -1:], pos=pos + tokens.shape[1]
    )
    return x, cache


def forward_cached(model: GPT, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits (B, T, vocab) of tokens (B, T) continuing the cache, and the updated cache.

    Works for a prefill (T > 1 at pos 0), a chunk (T > 1 at pos > 0) and a step (T == 1);
    the caller keeps pos + T within the cache's S slots. Attention spans all S slots
    (masked), so a step costs O(S), not O(pos).
    """
    x, cache = hidden_cached(model, tokens, cache)
    return model.logits(x), cache


# -- sampling and the generate engine -------------------------------------------------


class Prefilled(NamedTuple):
    """A batch after its common prefill, ready for `Engine.decode`."""

    cache: KVCache
    tokens: jax.Array  # (B, S) int32: prompts (zero-padded on the right), then generations
    logits: jax.Array  # (B, V) logits of the last prefilled position
    prompt_lens: jax.Array  # (B,) int32


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "dtype", "eliminate_bank_v"))
def prefill_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    *,
    max_len: int,
    dtype: jnp.dtype,
    eliminate_bank_v: bool,
) -> tuple[jax.Array, KVCache]:
    """A fresh cache filled with tokens (B, P); returns (last logits (B, V), cache)."""
    model = nnx.merge(graphdef, state)
    cache = init_cache(model.spec, tokens.shape[0], max_len, dtype, eliminate_bank_v)
    x, cache = hidden_cached(model, tokens, cache)
    return model.logits(x[:, -1]), cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache", "tokens"))
def decode_loop(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    logits: jax.Array,
    lens: jax.Array,
    max_new_tokens: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    stop_tokens: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """Step until every row has max_new_tokens generated or emitted a stop token.

    cache, tokens (B, S), logits (B, V), lens (B,): a `Prefilled` batch. Each step picks
    the token at position p = cache.pos for every row (its prompt token while p < lens,
    else `sampling.choose` from the carried logits, keyed by (seed, row, p)), writes it into tokens
    and runs it through the model. Returns (tokens, cache); returning the cache lets it
    alias the donated one instead of doubling its memory.
    """
    model = nnx.merge(graphdef, state)

    def step(carry):
        cache, logits, tokens, done = carry
        p = cache.pos
        rows = jnp.arange(lens.shape[0])
        keys = sampling.token_keys(jnp.full_like(rows, seed), rows, jnp.full_like(rows, p))
        every = functools.partial(jnp.full, rows.shape)
        sampled = sampling.choose(logits, keys, every(temperature), every(top_k), every(top_p))
        in_prompt = p < lens
        token = jnp.where(in_prompt, tokens[:, p], sampled)
        tokens = tokens.at[:, p].set(token)
        last = p + 1 >= lens + max_new_tokens
        done = done | (~in_prompt & (jnp.isin(token, stop_tokens) | last))
        x, cache = hidden_cached(model, token[:, None], cache)
        return cache, model.logits(x[:, 0]), tokens, done

    done = jnp.zeros(lens.shape, bool)
    init = (cache, logits, tokens, done)
    cache, _, tokens, _ = jax.lax.while_loop(lambda c: ~jnp.all(c[3]), step, init)
    return tokens, cache


class Engine:
    """A model split once for decoding (nnx.split); prefill and decode are jitted.

    The jitted functions take the graphdef as a static argument, so engines of models
    with the same structure share compilations: a decode compiles once per (batch,
    cache length, number of stop tokens), never per token or sampling parameter.
    """

    def __init__(
        self, model: GPT, cache_dtype: jnp.dtype | None = None, eliminate_bank_v: bool = True
    ):
        self.spec = model.spec
        self.graphdef, self.state = nnx.split(model)
        self.cache_dtype = jnp.dtype(cache_dtype or model.spec.compute_dtype)
        self.eliminate_bank_v = eliminate_bank_v

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Prefilled:
        """Prefill the first min(len) tokens of every prompt in one call.

        The cache holds max(len) + max_new_tokens slots, rounded up to SLOT_MULTIPLE.
        """
        lens = np.array([len(p) for p in prompts], np.int32)
        if lens.min() < 1 or max_new_tokens < 1:
            raise ValueError("every prompt needs at least one token and max_new_tokens >= 1")
        max_len = -(-(int(lens.max()) + max_new_tokens) // SLOT_MULTIPLE) * SLOT_MULTIPLE
        tokens = np.zeros((len(prompts), max_len), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        logits, cache = prefill_step(
            self.graphdef,
            self.state,
            jnp.asarray(tokens[:, : lens.min()]),
            max_len=max_len,
            dtype=self.cache_dtype,
            eliminate_bank_v=self.eliminate_bank_v,
        )
        return Prefilled(cache, jnp.asarray(tokens), logits, jnp.asarray(lens))

    def decode(
        self,
        batch: Prefilled,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        top_p: float = 1.0,
    ) -> jax.Array:
        """Run the jitted decode loop on a prefilled batch (consumed); returns tokens (B, S)."""
        tokens, _ = decode_loop(
            self.graphdef,
            self.state,
            *batch,
            jnp.int32(max_new_tokens),
            jnp.float32(temperature),
            jnp.int32(top_k or 0),
            jnp.float32(top_p),
            jnp.int32(seed),
            jnp.array(list(stop_tokens) or [-1], jnp.int32),
        )
        return tokens

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        top_p: float = 1.0,
    ) -> list[list[int]]:
        """Completions of a batch of prompts (see `generate`)."""
        batch = self.prefill(prompts, max_new_tokens)
        out = self.decode(batch, max_new_tokens, temperature, top_k, seed, stop_tokens, top_p)
        out = np.asarray(out)
        stops = set(stop_tokens)
        completions = []
        for row, prompt in enumerate(prompts):
            new = out[row, len(prompt) : len(prompt) + max_new_tokens].tolist()
            ends = [j for j, token in enumerate(new) if token in stops]
            completions.append(new[: ends[0]] if ends else new)
        return completions


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    *,
    top_p: float = 1.0,
    cache_dtype: jnp.dtype | None = None,
    eliminate_bank_v: bool = True,
) -> list[list[int]]:
    """Generate up to max_new_tokens after each prompt (lists of token ids, e.g. BOS first).

    Greedy at temperature 0, else a sample (`sampling.choose`: temperature, top-k, top-p)
    keyed by (seed, row, position) (`sampling.token_keys`), so a row's samples do not
    depend on the other rows. A row ends at its first stop token, which is not returned.
    Prompts may differ in length (module doc).
    """
    engine = Engine(model, cache_dtype, eliminate_bank_v)
    return engine.generate(prompts, max_new_tokens, temperature, top_k, seed, stop_tokens, top_p)
