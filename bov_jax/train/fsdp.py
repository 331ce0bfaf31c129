"""The gradient half of the train step on a device mesh: when weights are gathered and
gradients reduced, stated once instead of left to the partitioner.

Left to GSPMD, a step on an fsdp mesh re-gathered every sharded weight at each use inside the
micro-batch loop (the attention backward's inner loop included), gathered each bank whole per
layer and per micro-batch, and reduced the tables' gradients per micro-batch: 647 GiB of
collectives per device per step for d24 BoV on v5e-8 (597 bytes per parameter) where about 7
bytes per parameter are needed. `sharded_gradients` is a `jax.shard_map` over the batch axes
(data, fsdp), the tensor axis left to XLA, with one of two schedules (`mesh.fsdp_gather`):

  step   the compute copy of every parameter (dense kernels in the compute dtype, the tables as
         stored, lm_head gathered in the compute dtype and differentiated in its own) is
         gathered once per step, before the micro-batch loop, and kept for every micro-batch;
         each device accumulates the gradient of its rows over the micro-batches in each
         parameter's dtype; one reduce-scatter over fsdp in fp32 (in two stages where the
         fsdp devices span three torus dimensions: `torus`) and one all-reduce of the
         shards over data at the end. Bytes per device per step: the gathered copy (2 B per
         bf16 parameter) and the fp32 gradient (4 B), whatever the number of micro-batches.
  layer  for models whose compute copy and fp32 gradient do not fit beside the activations:
         each block's parameters are gathered in the compute dtype when the block runs (and
         once more in its backward: `jax.checkpoint` keeps the gathered weights out of the
         saved residuals), and the gather's transpose reduce-scatters their gradient in fp32,
         once per block and micro-batch; the rest (wte, lm_head, smear) as in step.
  auto   step when the state, the compute copy, the accumulator and one micro-batch's
         gradients take at most STEP_SHARE_OF_HBM of the chip's memory (always on a CPU),
         else layer. `train.remat=auto` then recomputes each block's forward in its backward
         where the step compiled without it would not fit (`fit_remat`).

On a data-parallel mesh (fsdp 1) the gathers vanish and either schedule is one all-reduce of
the fp32 gradient per step. The loss of a micro-batch is its mean over the valid targets of
all devices: each device weighs its own rows' mean by its share of the valid targets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec

from bov_jax import sharding
from bov_jax.config import FSDP_GATHER_MODES, REMAT_MODES
from bov_jax.model.gpt import dense_kernels_in
from bov_jax.model.spec import ModelSpec
from bov_jax.model.tables import add_rows, embedding_paths
from bov_jax.train import torus

STEP_SHARE_OF_HBM = 0.65  # of the chip's memory: the state and step's copy, accumulator, grads
FIT_SHARE_OF_HBM = 0.9  # of the chip's memory: beyond it the blocks are recomputed (auto)
FSDP = "fsdp"
GATHERED = "fsdp_gathered"  # checkpoint_name of a block's gathered weights (layer)
GIB = 2**30
MICRO_BATCH_SCOPE = "micro_batch"  # the name scope of each micro-batch's forward and backward
# The name scope of the gradients' own ops (profiles): the dense kernels' cast to the compute
# dtype and the micro-batches' gradient sum.
GRADS_SCOPE = "grads"


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """How a train step spends memory: when the fsdp mesh gathers (`gather`: "step" or
    "layer") and whether each block's activations are recomputed in the backward instead of
    kept (`remat`), with the reasons."""

    gather: str = "step"
    remat: bool = False
    reason: str = ""

    def describe(self) -> str:
        remat = "each block recomputed in the backward" if self.remat else "no recomputation"
        return f"fsdp gather per {self.gather}, {remat} ({self.reason})"


PLAIN = StepSchedule(reason="gathered once per step, nothing recomputed")


def transfer_dtype(path: tuple, x: Any, compute_dtype: Any) -> jnp.dtype:
    """The dtype a parameter is gathered in: dense kernels (lm_head's too) in the compute
    dtype, tables and scalars as stored."""
    return jnp.dtype(compute_dtype if getattr(path[-1], "key", None) == "kernel" else x.dtype)


def step_buffers(params: Any, compute_dtype: Any) -> dict[str, int]:
    """Bytes per device that step holds beside the sharded state, by buffer: the gathered
    compute copy, the gradient accumulator (in each parameter's dtype) and one micro-batch's
    gradients while they are added to it (the size of the compute copy)."""

    def sizes(path: tuple, x: Any) -> tuple[int, int]:
        n = math.prod(x.shape)
        return n * transfer_dtype(path, x, compute_dtype).itemsize, n * jnp.dtype(x.dtype).itemsize

    leaves = jax.tree.leaves(
        jax.tree_util.tree_map_with_path(sizes, params), is_leaf=lambda x: isinstance(x, tuple)
    )
    copy, accumulator = (sum(column) for column in zip(*leaves))
    return {
        "compute copy": copy,
        "gradient accumulator": accumulator,
        "micro-batch gradients": copy,
    }


def step_bytes(params: Any, compute_dtype: Any) -> int:
    """All of `step_buffers`."""
    return sum(step_buffers(params, compute_dtype).values())


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays (or ShapeDtypeStructs) with shardings."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if hasattr(x, "sharding") and x.sharding is not None
    )


def choose_schedule(
    gather: str,
    remat: str,
    *,
    params: Any,
    state_bytes: int,
    spec: ModelSpec,
    hbm_bytes: int | None,
    fsdp: int,
) -> StepSchedule:
    """`mesh.fsdp_gather` and `train.remat` resolved before compiling: as configured unless
    "auto". gather=auto is step where the sharded state (`state_bytes` per device) and
    `step_bytes` take at most STEP_SHARE_OF_HBM of `hbm_bytes` per chip (always with no
    limit or no fsdp axis), else layer. remat=auto starts without recomputation: `fit_remat`
    turns it on where the compiled step would not fit."""
    if gather not in FSDP_GATHER_MODES:
        raise ValueError(f"mesh.fsdp_gather={gather!r}; expected one of {FSDP_GATHER_MODES}")
    if remat not in REMAT_MODES:
        raise ValueError(f"train.remat={remat!r}; expected one of {REMAT_MODES}")
    reasons = []
    if gather == "auto":
        held = state_bytes + step_bytes(params, spec.compute_dtype)
        fits = hbm_bytes is None or fsdp == 1 or held <= STEP_SHARE_OF_HBM * hbm_bytes
        gather = "step" if fits else "layer"
        if fsdp > 1 and hbm_bytes is not None:
            reasons.append(
                f"state + step's copy, accumulator and gradients {held / GIB:.1f} GiB "
                f"{'<=' if fits else '>'} {STEP_SHARE_OF_HBM:.0%} of {hbm_bytes / GIB:.1f} GiB"
            )
    if remat != "auto":
        reasons.append(f"train.remat={remat}")
    return StepSchedule(gather, remat == "blocks", "; ".join(reasons) or "as configured")


def fit_remat(
    schedule: StepSchedule,
    remat: str,
    hbm_bytes: int | None,
    peak_bytes: Callable[[StepSchedule], float],
) -> StepSchedule:
    """train.remat=auto decided by compiling: `schedule` as it is where no recomputation was
    asked for by "auto" or memory has no limit, or where the step compiled without it
    (`peak_bytes(schedule)`: its peak per device) fits FIT_SHARE_OF_HBM of the chip; else the
    blocks recomputed, which compiles the step a second time."""
    if remat != "auto" or hbm_bytes is None:
        return schedule
    peak = peak_bytes(schedule)
    fits = peak <= FIT_SHARE_OF_HBM * hbm_bytes
    note = (
        f"without recomputation the step needs {peak / GIB:.2f} GiB "
        f"{'<=' if fits else '>'} {FIT_SHARE_OF_HBM:.0%} of {hbm_bytes / GIB:.1f} GiB"
    ) + ("" if fits else " (fewer rows may fit without it: python -m bov_jax.compile --find_rows)")
    reason = "; ".join(r for r in (schedule.reason, note) if r and r != "as configured")
    return dataclasses.replace(schedule, remat=not fits, reason=reason)


def schedule_for(
    config: Any, mesh: jax.sharding.Mesh, state: Any, hbm_bytes: int | None
) -> StepSchedule:
    """The schedule of `config` (mesh.fsdp_gather, train.remat) on `mesh` for the train
    `state` (arrays or ShapeDtypeStructs with shardings), with `hbm_bytes` per chip."""
    return choose_schedule(
        config.mesh.fsdp_gather,
        config.train.remat,
        params=state.params,
        state_bytes=per_device_bytes(state),
        spec=ModelSpec.from_config(config.model, sharding.platform(mesh)),
        hbm_bytes=hbm_bytes,
        fsdp=mesh.shape[FSDP],
    )


def compiled_peak_bytes(compiled: Any) -> float:
    """A compiled program's peak memory per device: arguments + outputs - aliased + temps."""
    m = compiled.memory_analysis()
    return float(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def device_memory_bytes(mesh: jax.sharding.Mesh) -> int | None:
    """The memory of one of the mesh's devices (None on a CPU or where the runtime says none)."""
    if sharding.platform(mesh) == "cpu":
        return None
    stats = mesh.devices.flat[0].memory_stats() or {}
    return stats.get("bytes_limit")


def fsdp_dims(param_shardings: Any) -> Any:
    """Per parameter (a tree like params): the dimension split over the fsdp axis, -1 if none."""
    return jax.tree.map(lambda named: sharding.split_dim(named.spec, FSDP), param_shardings)


def manual_spec(dim: int, ndim: int) -> PartitionSpec:
    """A parameter's spec over the shard_map's manual axes: its fsdp dimension, if any."""
    return PartitionSpec(*(FSDP if i == dim else None for i in range(ndim)))


def gather(x: jax.Array, dim: int, dtype: Any) -> jax.Array:
    """This device's shard x of a parameter gathered whole along `dim` over fsdp, in `dtype`."""
    x = x.astype(dtype)
    return x if dim < 0 else jax.lax.all_gather(x, FSDP, axis=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_reducing_fp32(
    x: jax.Array, dim: int, dtype: Any, stages: tuple[torus.Groups, ...]
) -> jax.Array:
    """`gather` whose transpose reduce-scatters the cotangent in fp32 (layer): the stored shard
    x (fp32) travels in `dtype` (bf16), its gradient comes back summed in fp32, reduce-scattered
    in `stages` (`torus.reduce_scatter`)."""
    return gather(x, dim, dtype)


def _gather_fwd(x, dim, dtype, stages):
    return gather(x, dim, dtype), jnp.zeros((), x.dtype)


def _gather_bwd(dim, dtype, stages, stored, g):
    g = g.astype(jnp.float32)
    if dim >= 0:
        g = torus.reduce_scatter(g, FSDP, dim, stages)
    return (g.astype(stored.dtype),)


gather_reducing_fp32.defvjp(_gather_fwd, _gather_bwd)


def reduce(
    g: jax.Array, dim: int, axes: tuple[str, ...], stages: tuple[torus.Groups, ...] = ()
) -> jax.Array:
    """Sum a gradient over the devices of `axes`, in fp32: scattered over fsdp along `dim`
    (>= 0, in `stages`: `torus.reduce_scatter`), summed over the rest (all of `axes` for a
    parameter with no fsdp dimension)."""
    g = g.astype(jnp.float32)
    if dim >= 0:
        g = torus.reduce_scatter(g, FSDP, dim, stages)
    rest = tuple(a for a in axes if dim < 0 or a != FSDP)
    return jax.lax.psum(g, rest) if rest else g


def without(tree: dict, paths: Iterable[tuple]) -> dict:
    """A nested dict `tree` with the leaves at `paths` replaced by None (no leaves)."""
    return with_leaves(tree, dict.fromkeys(paths))


def with_leaves(tree: dict, leaves: Mapping[tuple, Any]) -> dict:
    """A nested dict `tree` with the leaves at the paths of `leaves` set to their values."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(tree), **leaves})


def accumulate(
    graphdef: nnx.GraphDef,
    variables: Any,
    inputs: jax.Array,
    targets: jax.Array,
    shares: jax.Array,
    params: Any,
    run_block: Callable | None = None,
    by_rows: Callable[[tuple], bool] = lambda path: True,
) -> tuple[jax.Array, Any]:
    """sum_i shares[i] * loss_i and its gradient, loss_i the model's (graphdef, variables)
    mean loss of the micro-batch inputs[i], targets[i] of inputs, targets (accum, rows, T)
    (`run_block`: see GPT.hidden): in a `lax.scan`, or one call where there is one
    micro-batch (a 1-trip scan made XLA TPU run part of the forward twice). Each micro-batch
    is traced in the name scope MICRO_BATCH_SCOPE. Each gradient is summed in its parameter's
    dtype (`params`: the stored parameters, a tree like variables): fp32 for fp32 parameters
    whatever the compute copy's dtype, bf16 for bf16 tables, as the reference sums .grad in
    the parameter's dtype (and as a full fp32 sum of d24's tables would cost 0.9 GB more per
    device).

    The token-id tables whose embedding path passes `by_rows` (all by default) are not
    differentiated: their rows at the micro-batch's tokens are gathered here and passed to
    the model, and the rows' gradient is added into the running sum by id
    (`tables.add_rows`), touching the rows of the micro-batch's ids only. Autodiff would
    build each micro-batch's whole (V, F) gradient and add it to the sum, two passes over
    every table per micro-batch; the sums are the same (each id's rows summed in fp32, added
    in the parameter's dtype; rows of absent ids add an exact zero there).
    """
    model = nnx.merge(graphdef, variables)  # the tables' roles and paths, their rows' lookup
    paths = {role: path for role, path in embedding_paths(model).items() if by_rows(path)}
    flat, stored = traverse_util.flatten_dict(variables), traverse_util.flatten_dict(params)
    tables = {path: flat[path] for path in paths.values()}  # held fixed, not differentiated
    rest = without(variables, tables)

    def loss_of(rest: Any, inputs_i: jax.Array, targets_i: jax.Array, rows: dict) -> jax.Array:
        model = nnx.merge(graphdef, with_leaves(rest, tables))
        return model.loss(inputs_i, targets_i, run_block=run_block, rows=rows)

    def micro_step(sums, batch):
        dense_sum, table_sums = sums
        inputs_i, targets_i, share = batch
        with jax.named_scope(MICRO_BATCH_SCOPE):
            rows = model.table_rows(inputs_i, paths)
            loss, (grads, row_grads) = jax.value_and_grad(
                lambda r, g: loss_of(r, inputs_i, targets_i, g) * share, argnums=(0, 1)
            )(rest, rows)
            with jax.named_scope(GRADS_SCOPE):
                dense_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), dense_sum, grads)
                table_sums = {
                    role: add_rows(table_sums[role], inputs_i, row_grads[role]) for role in paths
                }
                return (dense_sum, table_sums), loss

    zeros = (
        jax.tree.map(lambda v, p: jnp.zeros(v.shape, p.dtype), rest, without(params, tables)),
        {role: jnp.zeros(tables[path].shape, stored[path].dtype) for role, path in paths.items()},
    )
    if inputs.shape[0] == 1:
        sums, loss = micro_step(zeros, (inputs[0], targets[0], shares[0]))
    else:
        sums, losses = jax.lax.scan(micro_step, zeros, (inputs, targets, shares))
        loss = losses.sum()
    dense_sum, table_sums = sums
    return loss, with_leaves(dense_sum, {paths[role]: g for role, g in table_sums.items()})


def block_runner(
    gather_dims: Callable[[nnx.State], Any] | None,
    compute_dtype: Any,
    remat: bool,
    stages: tuple[torus.Groups, ...],
):
    """How each block runs inside the micro-batch, or None for a plain call. With
    `gather_dims` (layer): its parameters, this device's shards, gathered when it runs and once
    more in its backward (`jax.checkpoint` keeps the gathered weights out of the residuals),
    their gradients reduce-scattered in fp32 (in `stages`). With `remat`: nothing of the block
    kept but its inputs, its forward run again in the backward."""
    if gather_dims is None and not remat:
        return None
    policy = (
        jax.checkpoint_policies.nothing_saveable
        if remat
        else jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
    )

    def run(block: nnx.Module, *args: Any) -> Any:
        graph, local = nnx.split(block)
        dims = gather_dims(local) if gather_dims is not None else None

        def call(local: nnx.State, *args: Any) -> Any:
            def one(path: tuple, x: jax.Array, dim: int) -> jax.Array:
                dtype = transfer_dtype(path, x, compute_dtype)
                return jax.ad_checkpoint.checkpoint_name(
                    gather_reducing_fp32(x, dim, dtype, stages), GATHERED
                )

            whole = local if dims is None else jax.tree_util.tree_map_with_path(one, local, dims)
            return nnx.merge(graph, whole)(*args)

        return jax.checkpoint(call, policy=policy)(local, *args)

    return run


def gather_leaf(path: tuple, x: jax.Array, dim: int, compute_dtype: Any) -> jax.Array:
    """One parameter of a compute copy gathered whole, in the compute dtype if it is a kernel,
    and returned in its own dtype (a dense kernel is already in the compute dtype; lm_head is
    differentiated as stored, the loss casting it at use)."""
    return gather(x, dim, transfer_dtype(path, x, compute_dtype)).astype(x.dtype)


def sharded_gradients(
    graphdef: nnx.GraphDef,
    param_shardings: Any,
    mesh: jax.sharding.Mesh,
    schedule: StepSchedule,
) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]:
    """gradients(params, inputs, targets (accum, rows, T)) -> (mean loss, mean gradient) on
    `mesh` with `schedule` (module docstring); for use inside the jitted step, where params
    carry `param_shardings` and the rows are split over the batch axes."""
    mode = schedule.gather
    if mode not in ("step", "layer"):
        raise ValueError(f"fsdp gather mode {mode!r}; expected step or layer")
    batch_axes = sharding.BATCH_AXES
    others = tuple(a for a in batch_axes if a != FSDP)
    dims = fsdp_dims(param_shardings)
    stages = torus.scatter_stages(mesh, FSDP)

    def local_gradients(params: Any, inputs: jax.Array, targets: jax.Array):
        valid = jnp.sum(targets >= 0, axis=(1, 2))  # (accum,): this device's valid targets
        shares = valid / jnp.maximum(jax.lax.psum(valid, batch_axes), 1) / inputs.shape[0]
        compute_dtype = nnx.merge(graphdef, params).spec.compute_dtype
        with jax.named_scope(GRADS_SCOPE):
            compute = dense_kernels_in(params, compute_dtype)

        def whole(tree: Any, tree_dims: Any) -> Any:
            return jax.tree_util.tree_map_with_path(
                lambda path, x, dim: gather_leaf(path, x, dim, compute_dtype), tree, tree_dims
            )

        if mode == "step":
            variables, gather_dims = whole(compute, dims), None
        else:  # the blocks' shards as stored, gathered block by block; the rest once
            rest = {k: v for k, v in compute.items() if k != "blocks"}
            variables = {**whole(rest, {k: dims[k] for k in rest}), "blocks": params["blocks"]}

            def gather_dims(local: nnx.State) -> Any:
                return jax.tree.map(sharding.fsdp_dim, nnx.get_partition_spec(local))

        loss, grads = accumulate(
            graphdef,
            variables,
            inputs,
            targets,
            shares,
            params,
            run_block=block_runner(gather_dims, compute_dtype, schedule.remat, stages),
            # layer: the blocks' tables stay sharded; their gradients leave per block
            by_rows=lambda path: mode == "step" or path[0] != "blocks",
        )
        if mode == "step":
            reduced = jax.tree.map(lambda g, dim: reduce(g, dim, batch_axes, stages), grads, dims)
        else:  # the blocks' gradients left their gathers scattered over fsdp already
            reduced = {
                k: jax.tree.map(
                    lambda g, dim: reduce(g, dim, batch_axes, stages), grads[k], dims[k]
                )
                for k in grads
                if k != "blocks"
            }
            reduced["blocks"] = jax.tree.map(
                lambda g, dim: reduce(g, -1, others if dim >= 0 else batch_axes),
                grads["blocks"],
                dims["blocks"],
            )
        reduced = jax.tree.map(lambda g, p: g.astype(p.dtype), reduced, params)
        return jax.lax.psum(loss, batch_axes), reduced

    param_specs = jax.tree.map(
        lambda dim, named: manual_spec(dim, len(named.spec)), dims, param_shardings
    )
    batch_spec = PartitionSpec(None, batch_axes)
    return jax.shard_map(
        local_gradients,
        mesh=mesh,
        in_specs=(param_specs, batch_spec, batch_spec),
        out_specs=(PartitionSpec(), param_specs),
        axis_names=set(batch_axes),
        check_vma=False,
    )
