"""The nanochat GPT (spec section 1) with a composable value path (spec section 2).

Shapes: B batch, T time, D model width, H heads, K = H * head_dim, V padded vocab.
Every parameter carries logical axis names (vocab, embed, heads, kv, mlp, bank_vocab)
that `bov_jax.sharding` maps onto a device mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bov_jax import sharding
from bov_jax.model import layers, loss
from bov_jax.model.spec import ModelSpec
from bov_jax.model.tables import Table, iter_tables
from bov_jax.model.values import GATE_CHANNELS

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]
BlockRunner = Callable[..., tuple[jax.Array, jax.Array]]
LAYER_KEYS = ("c_q", "c_k", "c_v", "c_fc", "ve_gate", "bank")


def uniform(bound: float, low: float | None = None) -> Init:
    low = -bound if low is None else low
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, low, bound)


def normal(std: float) -> Init:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def zeros(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def dense(
    spec: ModelSpec, n_in: int, n_out: int, init: Init, axes: tuple, key: jax.Array
) -> nnx.Linear:
    """A bias-free Linear whose kernel (n_in, n_out) is init(key, ...) exactly.

    The explicit key makes a layer's weights independent of which other parameters
    a variant creates, so variants built from one seed share their common weights.
    """
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        kernel_init=nnx.with_partitioning(lambda _, shape, dtype: init(key, shape, dtype), axes),
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        rngs=nnx.Rngs(0),
    )


def table(spec: ModelSpec, values: jax.Array, axes: tuple, role: str) -> Table:
    """A token-id table holding the given (rows, features) values, stored in spec.table_dtype."""
    rows, features = values.shape
    return Table(
        rows,
        features,
        role=role,
        embedding_init=nnx.with_partitioning(lambda *_: values.astype(spec.table_dtype), axes),
        dtype=spec.compute_dtype,
        param_dtype=spec.table_dtype,
        rngs=nnx.Rngs(0),
    )


def scalar(value: float, spec: ModelSpec) -> nnx.Param:
    return nnx.Param(jnp.full((1,), value, spec.param_dtype), out_sharding=(None,))


class ValueContext(NamedTuple):
    """Per-forward inputs that value sources read besides the layer input."""

    token_ids: jax.Array  # (B, T) int32
    x0n: jax.Array  # (B, T, D) rmsnorm of the post-smear embedding
    v1: jax.Array | None  # (B, T, K) layer 0's values, once computed
    rows: Mapping[str, jax.Array] | None = None  # table rows (B, T, F) gathered by the caller


class ValuePath(nnx.Module):
    """Forms one layer's values (B, T, K); see bov_jax/model/values.py."""

    def __init__(self, spec: ModelSpec, layer: int, keys: dict, bank: Table | None):
        vp = spec.value_path
        self.vp = vp
        self.is_target = layer in spec.targets
        self.compute_dtype = spec.compute_dtype
        if vp.owns_projection(self.is_target):
            self.c_v = dense(
                spec,
                spec.d_model,
                spec.kv_dim,
                uniform(spec.init_bound),
                ("embed", "kv"),
                keys["c_v"],
            )
        if not self.is_target:
            return
        names = vp.coefficient_names(True)
        if "gamma" in names:
            self.gamma = scalar(1.0, spec)
        if "alpha" in names:
            self.alpha = scalar(1.0, spec)
            self.beta = scalar(0.0, spec)
        if vp.uses_bank:
            self.bank = bank
        if vp.combine == "gated_add":
            self.ve_gate = dense(
                spec,
                GATE_CHANNELS,
                spec.n_head,
                uniform(0.02, 0.0),
                (None, None),
                keys["ve_gate"],
            )

    def _coef(self, name: str) -> jax.Array:
        return getattr(self, name)[...].astype(self.compute_dtype)

    def source(self, x: jax.Array, ctx: ValueContext) -> jax.Array:
        """The raw source values (B, T, K) of a target layer."""
        return {
            "residual": lambda: self.c_v(x),
            "x0": lambda: self.c_v(ctx.x0n),
            "v1": lambda: ctx.v1,
            "bank": lambda: self.bank_lookup(ctx.token_ids, ctx.rows),
        }[self.vp.source]()

    def bank_lookup(
        self, token_ids: jax.Array, given: Mapping[str, jax.Array] | None = None
    ) -> jax.Array:
        """The bank rows of the ids: (B, T) -> (B, T, K) (`given`: see Table)."""
        with jax.named_scope("bank"):
            return self.bank(token_ids, given)

    def replace_coef(self) -> jax.Array | float:
        return {
            "none": 1.0,
            "fixed": self.vp.fixed_coeff,
            "learned": self._coef("gamma") if self.vp.scale == "learned" else 1.0,
        }[self.vp.scale]

    def __call__(self, x: jax.Array, ctx: ValueContext) -> jax.Array:
        if not self.is_target:
            return self.c_v(x)
        src = self.source(x, ctx)
        combine, scale = self.vp.combine, self.vp.scale
        if combine == "replace":
            return self.replace_coef() * src
        own = self.c_v(x)
        if combine == "gated_add":
            b, t, k = own.shape
            gate = 3.0 * jax.nn.sigmoid(self.ve_gate(x[..., :GATE_CHANNELS]))  # (B, T, H)
            heads = gate.shape[-1]
            mixed = own.reshape(b, t, heads, -1) + gate[..., None] * src.reshape(b, t, heads, -1)
            return mixed.reshape(b, t, k)
        if scale == "learned":
            return self._coef("alpha") * own + self._coef("beta") * src
        coef = self.vp.fixed_coeff if scale == "fixed" else 1.0
        return coef * (own + src)


class Attention(nnx.Module):
    def __init__(self, spec: ModelSpec, layer: int, keys: dict, bank: Table | None):
        s = spec.init_bound
        self.n_head, self.head_dim = spec.n_head, spec.head_dim
        self.qk_scale = spec.qk_scale
        self.window = spec.windows[layer]
        self.impl = spec.attention_impl
        self.c_q = dense(
            spec, spec.d_model, spec.kv_dim, uniform(s), ("embed", "heads"), keys["c_q"]
        )
        self.c_k = dense(spec, spec.d_model, spec.kv_dim, uniform(s), ("embed", "kv"), keys["c_k"])
        self.value = ValuePath(spec, layer, keys, bank)
        self.c_proj = dense(spec, spec.kv_dim, spec.d_model, zeros, ("heads", "embed"), keys["c_q"])

    def heads(self, x: jax.Array) -> jax.Array:
        """(B, T, K) -> (B, T, H, hd), rows over the batch axes and heads over tensor."""
        x = x.reshape(*x.shape[:2], self.n_head, self.head_dim)
        return sharding.constrain(x, "batch", None, "heads", None)

    def queries_keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, ...]:
        """Rotary, then QK RMS-norm, then the 1.2 scale. x: (B, T, D) -> 2 x (B, T, H, hd)."""
        q = layers.apply_rotary(self.heads(self.c_q(x)), cos, sin)
        k = layers.apply_rotary(self.heads(self.c_k(x)), cos, sin)
        return self.qk_scale * layers.rms_norm(q), self.qk_scale * layers.rms_norm(k)

    def output(self, y: jax.Array) -> jax.Array:
        """(B, T, H, hd) -> (B, T, D)."""
        return self.c_proj(y.reshape(*y.shape[:2], -1))

    def __call__(self, x, ctx: ValueContext, cos, sin) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, D) normed input -> (out (B, T, D), values (B, T, K))."""
        with jax.named_scope("attn"):
            q, k = self.queries_keys(x, cos, sin)
            v = self.value(x, ctx)
            y = layers.attention(q, k, self.heads(v), window=self.window, implementation=self.impl)
            return self.output(y), v


class MLP(nnx.Module):
    def __init__(self, spec: ModelSpec, keys: dict):
        hidden = spec.mlp_ratio * spec.d_model
        self.c_fc = dense(
            spec,
            spec.d_model,
            hidden,
            uniform(0.4 * spec.init_bound),
            ("embed", "mlp"),
            keys["c_fc"],
        )
        self.c_proj = dense(spec, hidden, spec.d_model, zeros, ("mlp", "embed"), keys["c_fc"])

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            hidden = sharding.constrain(self.c_fc(x), "batch", None, "mlp")
            return self.c_proj(jnp.square(jax.nn.relu(hidden)))


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, layer: int, keys: dict, bank: Table | None):
        self.attn = Attention(spec, layer, keys, bank)
        self.mlp = MLP(spec, keys)

    def __call__(self, x, ctx: ValueContext, cos, sin) -> tuple[jax.Array, jax.Array]:
        """Pre-norm residual block: (B, T, D) -> ((B, T, D), values (B, T, K)). Its own ops,
        the norms and residual adds, are traced in the name scope "block" (profiles)."""
        with jax.named_scope("block"):
            a, v = self.attn(layers.rms_norm(x), ctx, cos, sin)
            x = x + a
            return residual(x + self.mlp(layers.rms_norm(x))), v


def residual(x: jax.Array) -> jax.Array:
    """The residual stream (B, T, D), its rows over the batch axes and its width whole."""
    return sharding.constrain(x, "batch", None, None)


def layer_keys(key: jax.Array, layer: int) -> dict[str, jax.Array]:
    base = jax.random.fold_in(key, layer)
    return {name: jax.random.fold_in(base, j) for j, name in enumerate(LAYER_KEYS)}


class GPT(nnx.Module):
    """tokens (B, T) -> logits (B, T, vocab_size), fp32 and softcapped."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        self.spec = spec
        k_wte, k_head, k_blocks = jax.random.split(jax.random.key(seed), 3)
        d, vocab = spec.d_model, spec.padded_vocab
        wte_fp32 = normal(0.8)(k_wte, (vocab, d), jnp.float32)
        self.wte = table(spec, wte_fp32, ("vocab", "embed"), "wte")
        self.smear_gate = dense(spec, spec.smear_channels, 1, zeros, (None, None), k_wte)
        self.smear_lambda = scalar(0.0, spec)
        banks = make_banks(spec, wte_fp32, k_blocks)
        self.blocks = nnx.List(
            [Block(spec, i, layer_keys(k_blocks, i), banks.get(i)) for i in range(spec.n_layer)]
        )
        self.lm_head = dense(spec, d, vocab, normal(0.001), ("embed", "vocab"), k_head)

    def embed(self, tokens: jax.Array, rows: Mapping[str, jax.Array] | None = None) -> jax.Array:
        """(B, T) -> the normalized, pre-smear token embedding (B, T, D) (`rows`: see hidden)."""
        return layers.rms_norm(self.wte(tokens, rows))

    def table_rows(self, tokens: jax.Array, roles: Iterable[str]) -> dict[str, jax.Array]:
        """The rows (B, T, F) at tokens (B, T) of the tables named by `roles` (wte, each
        bank's), for `hidden`'s `rows`, each gathered in the name scope of its lookup there
        (embed, bank)."""
        tables, rows = {table.role: table for _, table in iter_tables(self)}, {}
        for role in roles:
            with jax.named_scope("embed" if role == "wte" else "bank"):
                rows[role] = tables[role](tokens)
        return rows

    def smear_gate_values(self, x: jax.Array) -> jax.Array:
        """Gate g (B, T, 1) = smear_lambda * sigmoid(smear_gate(x[..., :24]))."""
        lam = self.smear_lambda[...].astype(x.dtype)
        return lam * jax.nn.sigmoid(self.smear_gate(x[..., : self.spec.smear_channels]))

    def smear(self, x: jax.Array) -> jax.Array:
        """x[t] += g[t] * x[t-1] for t >= 1, with the pre-smear x[t-1]. (B, T, D)."""
        mixed = x[:, 1:] + self.smear_gate_values(x[:, 1:]) * x[:, :-1]
        return jnp.concatenate([x[:, :1], mixed], axis=1)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final hidden state (B, T, D) -> softcapped fp32 logits (B, T, vocab_size)."""
        logits = self.lm_head(layers.rms_norm(x)).astype(jnp.float32)[..., : self.spec.vocab_size]
        cap = self.spec.logit_softcap
        return cap * jnp.tanh(logits / cap)

    def hidden(
        self,
        tokens: jax.Array,
        run_block: BlockRunner | None = None,
        rows: Mapping[str, jax.Array] | None = None,
    ) -> jax.Array:
        """(B, T) -> the final residual stream (B, T, D), before the last norm. `run_block`
        (block, x, ctx, cos, sin) -> (x, v) runs each block in place of calling it (the train
        step's per-layer gather of sharded weights, bov_jax/train/fsdp.py). `rows`: the rows
        (B, T, F) of some tables (by role, `table_rows`) at the tokens, used instead of looking
        them up (the train step differentiates them, bov_jax/model/tables.py)."""
        with jax.named_scope("embed"):
            x = residual(self.smear(self.embed(tokens, rows)))
            ctx = ValueContext(token_ids=tokens, x0n=layers.rms_norm(x), v1=None, rows=rows)
        cos, sin = layers.rotary_tables(tokens.shape[1], self.spec.head_dim, self.spec.rope_base)
        run_block = run_block or (lambda block, *args: block(*args))
        for i, block in enumerate(self.blocks):
            x, v = run_block(block, x, ctx, cos, sin)
            if i == 0:
                ctx = ctx._replace(v1=v)
        return x

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.logits(self.hidden(tokens))

    def loss(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        reduction: str = "mean",
        run_block: BlockRunner | None = None,
        rows: Mapping[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Cross-entropy in nats of the next-token targets (B, T), -1 ignored, computed over
        chunks of tokens without the full logits (bov_jax/model/loss.py): a scalar mean over
        valid targets, or per-token nats (B, T) (0 where ignored) when reduction == "none".
        Equal to cross_entropy(self(tokens), targets, reduction). `run_block`, `rows`: see
        hidden."""
        h = layers.rms_norm(self.hidden(tokens, run_block, rows)).astype(self.spec.compute_dtype)
        args = (
            h,
            self.lm_head.kernel[...],
            targets,
            self.spec.vocab_size,
            self.spec.logit_softcap,
            self.spec.loss_chunk_tokens,
        )
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction={reduction!r}; expected 'mean' or 'none'")
        with jax.named_scope("loss"):
            return loss.token_nll(*args) if reduction == "none" else loss.mean_nll(*args)


def dense_kernels_in(params: dict, dtype: jnp.dtype) -> dict:
    """`params` (the pure-dict layout) with every dense kernel but lm_head's cast to `dtype`.

    nnx.Linear casts its kernel to the compute dtype at each call; a train step casts these
    kernels once and reuses them for all its micro-batches. A cast's VJP is the cast back, so
    the gradients are unchanged (each kernel is used once per forward). lm_head's kernel is
    left as stored: the loss accumulates its gradient in fp32 over the token chunks and
    returns it in the kernel's dtype (bov_jax/model/loss.py), so a cast kernel would round
    that gradient.
    """

    def cast(path: tuple, x: jax.Array) -> jax.Array:
        names = [getattr(key, "key", None) for key in path]
        return x.astype(dtype) if names[-1] == "kernel" and names[0] != "lm_head" else x

    return jax.tree_util.tree_map_with_path(cast, params)


def make_banks(spec: ModelSpec, wte_fp32: jax.Array, blocks_key: jax.Array) -> dict[int, Table]:
    """The value tables of the target layers, keyed by layer (one object when shared).

    Aligned init (spec 2.3): E_l[t] = rmsnorm(wte[t]) @ W_V^l in fp32, where W_V^l is the
    value projection layer l would have had (the first target's when shared).
    Uniform init: U(-s, s) as the modded-nanogpt-style variant.
    """
    vp = spec.value_path
    if not vp.uses_bank:
        return {}
    s = spec.init_bound

    def new_bank(layer: int, role: str) -> Table:
        keys = layer_keys(blocks_key, layer)
        if vp.bank_init == "uniform":
            values = uniform(s)(keys["bank"], (spec.padded_vocab, spec.kv_dim), jnp.float32)
        else:
            w_v = uniform(s)(keys["c_v"], (spec.d_model, spec.kv_dim), jnp.float32)
            values = jnp.dot(layers.rms_norm(wte_fp32), w_v, precision=jax.lax.Precision.HIGHEST)
        return table(spec, values, ("bank_vocab", "kv"), role)

    if vp.bank_shared:
        shared = new_bank(spec.targets[0], "bank")
        return {layer: shared for layer in spec.targets}
    return {layer: new_bank(layer, f"bank.{layer}") for layer in spec.targets}


def learned_coefficients(params: dict) -> dict[str, float]:
    """The learned scalars of a model's pure-dict params, for logs and figures.

    Returns {"<name>/<layer>": value} for every gamma / alpha / beta of the value path (e.g.
    "gamma/8", "alpha/9", "beta/9"), in layer order, plus "smear_lambda". The scalars are
    replicated, so any process can read them.
    """

    def read(x: jax.Array) -> float:
        return float(jax.device_get(x.addressable_data(0)).reshape(-1)[0])

    coefficients = {}
    for layer in sorted(params["blocks"]):
        value_path = params["blocks"][layer]["attn"].get("value", {})  # absent: no parameters
        for name in ("gamma", "alpha", "beta"):
            if name in value_path:
                coefficients[f"{name}/{layer}"] = read(value_path[name])
    coefficients["smear_lambda"] = read(params["smear_lambda"])
    return coefficients


def cross_entropy(logits: jax.Array, targets: jax.Array, reduction: str = "mean") -> jax.Array:
    """Cross-entropy in nats with ignore index -1.

    logits (B, T, V) fp32, targets (B, T) int -> scalar mean over valid targets, or the
    per-token losses (B, T) (0 at ignored positions) when reduction == "none".
    """
    valid = targets >= 0
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    nll = jnp.where(valid, nll, 0.0)
    if reduction == "none":
        return nll
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}; expected 'mean' or 'none'")
    return nll.sum() / jnp.maximum(valid.sum(), 1)
