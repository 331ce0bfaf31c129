"""The reference optimizer (spec 3.1-3.3) as optax transformations.

Groups. `param_labels` gives every parameter exactly one label from its '/'-joined path (Flax
NNX pure-dict paths; a trailing `/value`, present when an `nnx.State` of Variables is passed,
is ignored) and raises on any path no rule knows:

    muon         2-D kernels of the blocks: c_q, c_k, c_v, attn c_proj, c_fc, mlp c_proj, ve_gate
    embedding    wte                              AdamW, lr embedding_lr * batch * dmodel
    unembedding  lm_head                          AdamW, lr unembedding_lr * batch * dmodel
    value_table  BoV / add-E / nanogpt banks      AdamW, lr embedding_lr * batch * dmodel * 0.5
    smear        smear_gate, smear_lambda         AdamW, lr smear_lr (no batch or dmodel scale)
    alpha        alpha coefficients               AdamW, lr scalar_lr * batch * 0.01
    beta         beta and gamma coefficients      AdamW, lr scalar_lr * batch

with dmodel = (d_model / 768) ** -0.5 and batch = sqrt(B / 2**19) (spec 3.4). Every group's lr
is multiplied by `schedules.lr_multiplier(step)`. `optax.multi_transform` combines the groups;
a group with no parameters in the model gets no transformation (and no state).

AdamW groups are `nanochat_adamw`, the reference `adamw_step_fused` (spec 3.3) in any
parameter dtype. Its moments are stored in the parameter's dtype (bf16 for bf16 tables, see
`model.table_dtype`), and its math follows the reference's compiled kernel: the scalars
(1 - lr wd, 1 - beta, the bias corrections 1 - beta^t, lr / (1 - beta1^t)) in fp32 from
fp32 betas and lr, every element upcast to fp32, and one rounding to the stored dtype per
written buffer (the two moments and the parameter; torch.compile fuses the step into one
kernel, which keeps its intermediates in fp32). In bf16 an update smaller than half a bf16
ulp of the parameter is thus rounded away, as in the reference.

Muon (`nanochat_muon`) is the reference `muon_step_fused`, per parameter, for Flax (in, out)
kernels (any leading axes are batch axes):
  1. Nesterov form in the parameter dtype: buf <- lerp(buf, g, 1 - m); g <- lerp(g, buf, m),
     m = `schedules.muon_momentum(step)`; no bias correction.
  2. Polar Express in bf16: X = bf16(g) / (1.01 ||X||_F + 1e-6), then the 5 coefficient triples,
     with the Gram matrix of the smaller side (square: the output side, as the reference's
     "wide" branch). Matmul operands and outputs are bf16; the elementwise polynomial combines
     run in fp32 and are rounded to bf16, as the reference's fused kernels do. Under jit XLA
     may skip some of these roundings (xla_allow_excess_precision, on by default), as
     torch.compile's fusions may: the result then differs from op-by-op bf16 at bf16 noise.
  3. NorMuon: the squared update averaged over the input axis (per output unit) when
     fan_out >= fan_in, else over the output axis (per input unit); an EMA buffer of it
     (init 0, no bias correction), the update scaled by rsqrt(max(buf, 1e-10)) and rescaled
     to keep its Frobenius norm. The EMA weight is 1 - bf16(beta2) = 0.1015625 for beta2 0.9,
     because the reference casts beta2 to the bf16 dtype of the orthogonalised update.
  4. lr_eff = lr * lrm(step) * sqrt(max(1, fan_out / fan_in)) (c_fc gets x2).
  5. Cautious weight decay: p <- p - lr_eff X - lr_eff wd p [X p >= 0], with
     wd = `schedules.muon_weight_decay(step)`; lr_eff and wd are rounded to bf16 first, as in
     the reference.

Layout of Muon's matrices under FSDP. Muon's state (momentum and NorMuon buffers) is sharded
exactly like its parameter, so steps 1, 3 and 5 are elementwise or cheap row/column reductions
on the shards. Only the orthogonalisation needs whole matrices. Left to GSPMD, each of its 15
small matmuls per stack was partitioned on its own and paid a collective (d24 BoV on v5e-8:
38 all-gathers of bf16[88,1536,1536], 33 GiB per step, even with the update constrained to be
replicated first). On an fsdp mesh (`FsdpMatrices`) the stacks are grouped by the dimension
their matrices are split along (c_q, c_k and c_v split their input axis, attention's c_proj its
output axis, all of one shape at d24), and `split_orthogonalise`, in a shard_map over fsdp,
gives each device 1/n of a stack's matrices whole by one all-to-all, orthogonalises them and
returns the slices by another: about twice each device's shard of bf16 crosses the links, and
the iterations' FLOPs are split over the devices, where gathering every matrix to every device
(the reference's DistMuon splits like this too) moves the whole bf16 update and repeats the
iterations n times; docs/targets.md compares the two, compiled. On a data-parallel mesh every
device holds whole matrices and orthogonalises them all.
"""

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from bov_jax.train import schedules

FSDP_AXIS = "fsdp"  # bov_jax.sharding's axis of sharded parameters
GROUPS = ("muon", "embedding", "unembedding", "value_table", "smear", "alpha", "beta")

_BLOCK = r"blocks/\d+/"
_LABEL_RULES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(pattern), label)
    for pattern, label in (
        (r"wte/embedding", "embedding"),
        (r"lm_head/kernel", "unembedding"),
        (r"smear_gate/kernel|smear_lambda", "smear"),
        (_BLOCK + r"(attn/(c_q|c_k|c_proj|value/(c_v|ve_gate))|mlp/(c_fc|c_proj))/kernel", "muon"),
        (_BLOCK + r"attn/value/bank/embedding", "value_table"),
        (_BLOCK + r"attn/value/alpha", "alpha"),
        (_BLOCK + r"attn/value/(beta|gamma)", "beta"),
    )
)

# Polar Express coefficients (a, b, c) for the 5 iterations (spec 3.2).
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

# AdamW groups: (betas key, weight-decay key) in config.optim; None = no decay (reference).
_ADAMW_KEYS: dict[str, tuple[str, str | None]] = {
    "embedding": ("embedding_betas", "embedding_wd"),
    "unembedding": ("unembedding_betas", "unembedding_wd"),
    "value_table": ("value_table_betas", "value_table_wd"),
    "smear": ("smear_betas", None),
    "alpha": ("alpha_betas", "alpha_wd"),
    "beta": ("beta_betas", None),
}

Schedule = Callable[[jax.Array], jax.Array]


def param_label(path: str) -> str:
    """The optimizer group of the parameter at '/'-joined `path` (e.g. 'blocks/3/mlp/c_fc/kernel').

    Raises ValueError naming the path when no rule, or more than one, matches.
    """
    key = path.removesuffix("/value")
    labels = [label for pattern, label in _LABEL_RULES if pattern.fullmatch(key)]
    if len(labels) != 1:
        raise ValueError(
            f"parameter {path!r} matches {len(labels)} optimizer rules {labels} (need exactly "
            f"one); add a rule to bov_jax/train/optim.py::_LABEL_RULES"
        )
    return labels[0]


def param_labels(params: Any) -> Any:
    """The tree of group labels (str leaves) with the structure of `params`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: param_label(jax.tree_util.keystr(path, simple=True, separator="/")),
        params,
    )


def effective_learning_rates(
    optim_cfg: Any, *, d_model: int, batch_lr_scale: float
) -> dict[str, float]:
    """Each group's base learning rate before the lr multiplier (spec 3.1, 3.4).

    `batch_lr_scale` is sqrt(total_batch_tokens / reference_batch_tokens). Muon's shape factor
    (x2 for c_fc) is applied per matrix inside `nanochat_muon`, not here.
    """
    dmodel = (d_model / optim_cfg.reference_d_model) ** -0.5
    embedding = optim_cfg.embedding_lr * batch_lr_scale * dmodel
    scalar = optim_cfg.scalar_lr * batch_lr_scale
    return {
        "muon": optim_cfg.matrix_lr * batch_lr_scale,
        "embedding": embedding,
        "unembedding": optim_cfg.unembedding_lr * batch_lr_scale * dmodel,
        "value_table": embedding * optim_cfg.value_table_lr_mult,
        "smear": optim_cfg.smear_lr,
        "alpha": scalar * optim_cfg.alpha_lr_mult,
        "beta": scalar,
    }


def learning_rate_schedules(
    optim_cfg: Any, *, num_steps: int, d_model: int, batch_lr_scale: float
) -> dict[str, Schedule]:
    """Per group, step -> lr: the base lr times `schedules.lr_multiplier` (log these)."""
    shape = (num_steps, optim_cfg.warmup_steps, optim_cfg.warmdown_ratio, optim_cfg.final_lr_frac)

    def scheduled(base_lr: float) -> Schedule:
        return lambda step: base_lr * schedules.lr_multiplier(step, *shape)

    lrs = effective_learning_rates(optim_cfg, d_model=d_model, batch_lr_scale=batch_lr_scale)
    return {group: scheduled(lr) for group, lr in lrs.items()}


def muon_lr_factor(shape: tuple[int, ...]) -> float:
    """sqrt(max(1, fan_out / fan_in)) for a Flax (..., fan_in, fan_out) kernel."""
    fan_in, fan_out = shape[-2:]
    return math.sqrt(max(1.0, fan_out / fan_in))


def _bf16_round(x: jax.Array | float) -> jax.Array:
    """x rounded to bf16 and returned as float32 (the reference's `.to(bfloat16)` casts)."""
    return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def polar_express(x: jax.Array, ns_steps: int) -> jax.Array:
    """Approximate orthogonal polar factor of each (fan_in, fan_out) matrix of `x`, in bf16.

    x: (..., fan_in, fan_out), any float dtype. Returns bf16 of the same shape whose singular
    values lie in about [0.86, 1.14] for singular values of x above ~1e-3 ||x||_F.
    """
    x = x.astype(jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=(-2, -1), keepdims=True))
    x = (x32 / (norm * 1.01 + 1e-6)).astype(jnp.bfloat16)
    # Gram of the smaller side; a square matrix uses the output side like the reference's
    # (out, in) "wide" branch.
    input_gram = x.shape[-1] > x.shape[-2]
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        xt = jnp.swapaxes(x, -1, -2)
        gram = x @ xt if input_gram else xt @ x
        poly = (b * gram.astype(jnp.float32) + c * (gram @ gram).astype(jnp.float32)).astype(
            jnp.bfloat16
        )
        prod = poly @ x if input_gram else x @ poly
        x = (a * x.astype(jnp.float32) + prod.astype(jnp.float32)).astype(jnp.bfloat16)
    return x


def _second_moment_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """NorMuon buffer shape: (..., 1, fan_out) if fan_out >= fan_in else (..., fan_in, 1)."""
    *batch, fan_in, fan_out = shape
    return (*batch, 1, fan_out) if fan_out >= fan_in else (*batch, fan_in, 1)


class MuonState(NamedTuple):
    """State of `nanochat_muon`: the step, the momentum buffers, the NorMuon buffers."""

    count: jax.Array  # () int32, the 0-based index of the next step
    momentum: optax.Updates  # like params
    second_moment: optax.Updates  # (..., 1, fan_out) or (..., fan_in, 1) per param


def _muon_leaf(
    grad: jax.Array,
    momentum_buf: jax.Array,
    second_moment: jax.Array,
    param: jax.Array,
    *,
    momentum: jax.Array,
    lr: jax.Array,
    wd: jax.Array,
    one_minus_beta2: float,
    orthogonalise: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One reference Muon step for a (..., fan_in, fan_out) parameter; returns
    (update to add to param, new momentum buffer, new NorMuon buffer). `orthogonalise` is
    `polar_express` on the bf16 Nesterov update, wherever its matrices lie."""
    m = momentum.astype(momentum_buf.dtype)
    grad = grad.astype(momentum_buf.dtype)
    momentum_buf = momentum_buf + (1 - m) * (grad - momentum_buf)
    nesterov = grad + m * (momentum_buf - grad)
    x = orthogonalise(nesterov.astype(jnp.bfloat16)).astype(jnp.float32)

    fan_in, fan_out = param.shape[-2:]
    axis = -2 if fan_out >= fan_in else -1
    size = param.shape[axis]
    v_mean = jnp.mean(x * x, axis=axis, keepdims=True)
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * size)
    second_moment = second_moment + one_minus_beta2 * (
        v_mean.astype(second_moment.dtype) - second_moment
    )
    step_size = jax.lax.rsqrt(jnp.maximum(second_moment, 1e-10)).astype(jnp.float32)
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * size * step_size**2, axis=(-2, -1), keepdims=True))
    x = x * _bf16_round(step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10)))

    lr_eff = _bf16_round(lr * muon_lr_factor(param.shape))
    mask = (x * param) >= 0
    update = -(lr_eff * x + lr_eff * _bf16_round(wd) * param * mask)
    return update.astype(param.dtype), momentum_buf, second_moment


def _same_shape_groups(leaves: list[jax.Array], dims: list[int]) -> list[list[int]]:
    """Indices of the leaves grouped by (shape, dtype, fsdp dimension), in first-seen order:
    a stack of matrices split along one dimension (c_q, c_k and c_v split their input axis,
    attention's c_proj its output axis, all of one shape at d24) is stacked without moving."""
    groups: dict[tuple, list[int]] = {}
    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        groups.setdefault((leaf.shape, jnp.dtype(leaf.dtype), dim), []).append(i)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class FsdpMatrices:
    """Where Muon's matrices lie on a mesh with an fsdp axis: the mesh, and per parameter of
    the muon group the dimension split over fsdp (-1: none); a tree like the params, with
    `optax.MaskedNode()` for the other groups' parameters (what `optax.multi_transform` hands
    the muon transformation)."""

    mesh: jax.sharding.Mesh
    dims: Any


def split_orthogonalise(x: jax.Array, dim: int, ns_steps: int) -> jax.Array:
    """`polar_express` of a stack x (K, fan_in, fan_out) split over fsdp along `dim` (1 or 2),
    inside a shard_map over fsdp: one all-to-all gives each of the n devices K / n whole
    matrices (the stack padded with zero matrices to a multiple of n, which stay zero), it
    orthogonalises those, and one all-to-all returns every device its slices. Each device
    sends and receives about its own shard twice, and computes 1/n of the iterations."""
    n = jax.lax.axis_size(FSDP_AXIS)
    count = x.shape[0]
    x = jnp.pad(x, ((0, -count % n), (0, 0), (0, 0)))
    whole = jax.lax.all_to_all(x, FSDP_AXIS, split_axis=0, concat_axis=dim, tiled=True)
    done = polar_express(whole, ns_steps)
    return jax.lax.all_to_all(done, FSDP_AXIS, split_axis=dim, concat_axis=0, tiled=True)[:count]


def orthogonaliser(
    layout: FsdpMatrices | None, dim: int, ndim: int, ns_steps: int
) -> Callable[[jax.Array], jax.Array]:
    """polar_express for a stack (K, fan_in, fan_out) of matrices whose dimension `dim` (of
    one matrix; -1: none) is split over fsdp: `split_orthogonalise` in a shard_map over the
    fsdp axis, or polar_express as it is where nothing is split."""
    if layout is None or dim < 0 or layout.mesh.shape.get(FSDP_AXIS, 1) == 1:
        return functools.partial(polar_express, ns_steps=ns_steps)
    spec = PartitionSpec(*(FSDP_AXIS if i == dim + 1 else None for i in range(ndim + 1)))
    return jax.shard_map(
        functools.partial(split_orthogonalise, dim=dim + 1, ns_steps=ns_steps),
        mesh=layout.mesh,
        in_specs=spec,
        out_specs=spec,
        axis_names={FSDP_AXIS},
        check_vma=False,
    )


def nanochat_muon(
    learning_rate: Schedule,
    momentum: Schedule,
    weight_decay: Schedule,
    *,
    beta2: float,
    ns_steps: int,
    layout: FsdpMatrices | None = None,
) -> optax.GradientTransformation:
    """The reference Muon (see the module docstring) for Flax (..., fan_in, fan_out) kernels.

    Same-shape matrices are stacked and updated together, one batched Polar Express per
    shape group (as the reference's stacked update); the state stays one leaf per parameter.

    The schedules map the 0-based step to the group lr (lrm included, shape factor not),
    the momentum and the cautious weight decay. The returned updates include -lr and the
    decay, so they are added to the params as they are; `update` requires `params`.
    `layout`, on an fsdp mesh, says how the matrices are split: the orthogonalisation then
    runs on whole matrices split over the devices (`split_orthogonalise`).
    """
    if not 1 <= ns_steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"muon_ns_steps must be in 1..{len(POLAR_EXPRESS_COEFFS)}: {ns_steps}")
    one_minus_beta2 = 1.0 - float(_bf16_round(beta2))

    def init(params: optax.Params) -> MuonState:
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(jnp.zeros_like, params),
            second_moment=jax.tree.map(
                lambda p: jnp.zeros(_second_moment_shape(p.shape), p.dtype), params
            ),
        )

    def update(
        updates: optax.Updates, state: MuonState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, MuonState]:
        if params is None:
            raise ValueError("nanochat_muon needs params (cautious weight decay)")
        step = state.count
        hyper = dict(
            momentum=momentum(step),
            lr=learning_rate(step),
            wd=weight_decay(step),
            one_minus_beta2=one_minus_beta2,
        )
        leaves, treedef = jax.tree.flatten(updates)
        columns = [leaves] + [
            treedef.flatten_up_to(tree) for tree in (state.momentum, state.second_moment, params)
        ]
        dims = treedef.flatten_up_to(layout.dims) if layout else [-1] * len(leaves)
        outs: list[list[jax.Array]] = [[] for _ in leaves]
        for group in _same_shape_groups(leaves, dims):
            first = leaves[group[0]]
            orthogonalise = orthogonaliser(layout, dims[group[0]], first.ndim, ns_steps)
            with jax.named_scope("muon"):
                stacked = [jnp.stack([column[i] for i in group]) for column in columns]
                results = _muon_leaf(*stacked, **hyper, orthogonalise=orthogonalise)
            for j, i in enumerate(group):
                outs[i] = [r[j] for r in results]

        def pick(k: int) -> optax.Updates:
            return jax.tree.unflatten(treedef, [out[k] for out in outs])

        return pick(0), MuonState(optax.safe_increment(step), pick(1), pick(2))

    return optax.GradientTransformation(init, update)


class AdamWState(NamedTuple):
    """State of `nanochat_adamw`: the step and the two moments (in the parameters' dtypes)."""

    count: jax.Array  # () int32, steps taken
    mu: optax.Updates  # like params: exp_avg
    nu: optax.Updates  # like params: exp_avg_sq


def _lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    """torch.lerp: start + w (end - start) for |w| < 0.5, else end + (w - 1) (end - start)."""
    return jnp.where(jnp.abs(weight) < 0.5, start, end) + jnp.where(
        jnp.abs(weight) < 0.5, weight, weight - 1
    ) * (end - start)


def _adamw_leaf(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    param: jax.Array,
    *,
    decay: jax.Array,
    one_minus_b1: jax.Array,
    one_minus_b2: jax.Array,
    bias2: jax.Array,
    step_size: jax.Array,
    eps: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One `adamw_step_fused` on one parameter; returns (update, new mu, new nu).

    Elements are computed in fp32 and rounded once to the stored dtypes; the update is the
    fp32 difference between the rounded new parameter and the old one, so that
    `optax.apply_updates` lands exactly on the rounded value.
    """
    f32 = jnp.float32
    g, p = grad.astype(f32), param.astype(f32)
    mu32 = _lerp(mu.astype(f32), g, one_minus_b1)
    nu32 = _lerp(nu.astype(f32), g * g, one_minus_b2)
    denom = jnp.sqrt(nu32 / bias2) + eps
    new_param = (p * decay - step_size * (mu32 / denom)).astype(param.dtype)
    return new_param.astype(f32) - p, mu32.astype(mu.dtype), nu32.astype(nu.dtype)


def nanochat_adamw(
    learning_rate: Schedule, *, b1: float, b2: float, eps: float, weight_decay: float
) -> optax.GradientTransformation:
    """The reference AdamW (see the module docstring) for parameters of any float dtype.

    `learning_rate` maps the 0-based step to the group lr (lrm included); the weight decay is
    decoupled and multiplied by it. The returned updates are fp32 and already include -lr;
    `update` requires `params`.
    """
    f32 = jnp.float32

    def init(params: optax.Params) -> AdamWState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamWState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update(
        updates: optax.Updates, state: AdamWState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, AdamWState]:
        if params is None:
            raise ValueError("nanochat_adamw needs params (decoupled weight decay)")
        lr = jnp.asarray(learning_rate(state.count), f32)
        beta1, beta2 = jnp.asarray(b1, f32), jnp.asarray(b2, f32)
        t = (state.count + 1).astype(f32)
        hyper = dict(
            decay=1 - lr * jnp.asarray(weight_decay, f32),
            one_minus_b1=1 - beta1,
            one_minus_b2=1 - beta2,
            bias2=1 - beta2**t,
            step_size=lr / (1 - beta1**t),
            eps=jnp.asarray(eps, f32),
        )
        out = jax.tree.map(
            lambda g, mu, nu, p: _adamw_leaf(g, mu, nu, p, **hyper),
            updates,
            state.mu,
            state.nu,
            params,
        )

        def pick(i: int) -> optax.Updates:
            return jax.tree.map(lambda _, leaf_out: leaf_out[i], updates, out)

        return pick(0), AdamWState(optax.safe_increment(state.count), pick(1), pick(2))

    return optax.GradientTransformation(init, update)


def build_optimizer(
    optim_cfg: Any,
    params: Any,
    *,
    num_steps: int,
    d_model: int,
    batch_lr_scale: float,
    muon_weight_decay: float,
    mesh: jax.sharding.Mesh | None = None,
    fsdp_dims: Any = None,
) -> optax.GradientTransformation:
    """The full reference optimizer over `params` (a pytree as from `nnx.to_pure_dict`).

    Labels every parameter first, so an unknown path fails here, before anything compiles.
    `muon_weight_decay` is weight_decay_scaled of spec 3.4 (0.28 at d12); it follows the
    cosine schedule. `mesh` and `fsdp_dims` (per parameter, the dimension split over the fsdp
    axis, -1 if none): where the matrices lie, for Muon's orthogonalisation (module doc).
    """
    labels = param_labels(params)
    present = set(jax.tree.leaves(labels))
    layout = None
    if mesh is not None and fsdp_dims is not None:
        muon_dims = jax.tree.map(
            lambda dim, label: dim if label == "muon" else optax.MaskedNode(), fsdp_dims, labels
        )
        layout = FsdpMatrices(mesh, muon_dims)
    lrs = learning_rate_schedules(
        optim_cfg, num_steps=num_steps, d_model=d_model, batch_lr_scale=batch_lr_scale
    )
    momentum = dict(
        warmdown_ratio=optim_cfg.warmdown_ratio,
        warmup_steps=optim_cfg.muon_momentum_warmup_steps,
        momentum_start=optim_cfg.muon_momentum_start,
        momentum_peak=optim_cfg.muon_momentum,
        momentum_end=optim_cfg.muon_momentum_end,
    )
    transforms: dict[str, optax.GradientTransformation] = {}
    for group in sorted(present):
        if group == "muon":
            transforms[group] = nanochat_muon(
                lrs[group],
                lambda step: schedules.muon_momentum(step, num_steps, **momentum),
                lambda step: schedules.muon_weight_decay(step, num_steps, muon_weight_decay),
                beta2=optim_cfg.muon_beta2,
                ns_steps=optim_cfg.muon_ns_steps,
                layout=layout,
            )
        else:
            betas_key, wd_key = _ADAMW_KEYS[group]
            b1, b2 = getattr(optim_cfg, betas_key)
            adamw = nanochat_adamw(
                lrs[group],
                b1=b1,
                b2=b2,
                eps=optim_cfg.adam_eps,
                weight_decay=getattr(optim_cfg, wd_key) if wd_key else 0.0,
            )
            transforms[group] = named_scope("adamw", adamw)
    return optax.multi_transform(transforms, param_labels)


def named_scope(name: str, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its update traced under jax.named_scope(name) (profiles group ops by it)."""

    def update(updates, state, params=None):
        with jax.named_scope(name):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update)
