"""The jitted train and eval steps.

`make_train_step` returns `train_step(state, batch) -> (state, metrics)` compiled once with
explicit shardings and a donated state. The batch holds every micro-batch of the step,
inputs/targets of shape (accum, rows, T) with rows sharded over (data, fsdp); a `lax.scan`
accumulates the gradient over the accum axis, so the optimizer sees the mean gradient of
the whole configured batch. A step is committed only if its loss and gradient are finite and
so are the new parameters and optimizer state (a finite gradient can still overflow a moment
or a parameter); otherwise the state is left unchanged and the step reports
`finite = False`, and the loop decides whether to stop or skip. `make_step_halves` jits the
step's two halves (gradients; optimizer update and commit) alone, for the bench.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bov_jax import sharding
from bov_jax.evals.bpb import bpb_sums
from bov_jax.model.gpt import dense_kernels_in
from bov_jax.train import fsdp
from bov_jax.train.state import TrainState, all_finite


def on_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """`fn` traced with `mesh` as the ambient mesh: kernels XLA does not partition (splash
    attention) shard_map over it. An abstract mesh only (`jax.sharding.use_abstract_mesh`),
    so that eager work during tracing (the kernel's mask tables) stays on this host's default
    device, also when the mesh holds a compile-only target's devices (bov_jax.compile)."""

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return traced


def accumulate_gradients(graphdef, params, inputs, targets) -> tuple[jax.Array, Any]:
    """Mean loss and gradient over micro-batches on one device: inputs, targets (accum, rows, T).

    The dense kernels are cast to the compute dtype once, before the micro-batches, rather
    than at every micro-batch's use (`dense_kernels_in`); gradients are summed in the
    parameters' dtypes. The train step runs the same math per device inside
    `fsdp.sharded_gradients`.
    """
    with jax.named_scope(fsdp.GRADS_SCOPE):
        compute = dense_kernels_in(params, nnx.merge(graphdef, params).spec.compute_dtype)
    accum = inputs.shape[0]
    shares = jnp.full((accum,), 1.0 / accum, jnp.float32)
    loss, grads = fsdp.accumulate(graphdef, compute, inputs, targets, shares, params)
    return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def apply_gradients(
    tx: optax.GradientTransformation,
    state: TrainState,
    loss: jax.Array,
    grads: dict,
    fault_nonfinite_step: int = -1,
) -> tuple[TrainState, dict]:
    """The optimizer's half of a step: update, finiteness check, commit or keep the state.

    `fault_nonfinite_step` >= 0 (train.fault_nonfinite_step, tests only) multiplies the new
    parameters of that step by NaN; at -1 nothing of it is compiled in.
    """
    with jax.named_scope("optimizer"):  # muon and adamw scope their own updates inside
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if fault_nonfinite_step >= 0:
            poison = jnp.where(state.step == fault_nonfinite_step, jnp.nan, 1.0)
            params = jax.tree.map(lambda p: p * poison.astype(p.dtype), params)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))

        def commit(state: TrainState) -> TrainState:
            return TrainState(state.step + 1, params, opt_state, state.rng)

        # A non-finite step keeps the previous state (the step counter included). A cond,
        # not a select over the whole state, so a good step pays no extra pass over memory.
        state = jax.lax.cond(finite, commit, lambda state: state, state)
    return state, {"loss": loss, "grad_norm": grad_norm, "finite": finite}


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state_shardings: TrainState,
    mesh: jax.sharding.Mesh,
    fault_nonfinite_step: int = -1,
    schedule: fsdp.StepSchedule = fsdp.PLAIN,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """train_step(state, batch {inputs, targets: (accum, rows, T)}) -> (state, metrics): the
    gradients on the mesh with `schedule` (`fsdp.sharded_gradients`; by default gathered once
    per step, nothing recomputed) then `apply_gradients`, in one jit with the state donated."""
    gradients = fsdp.sharded_gradients(graphdef, state_shardings.params, mesh, schedule)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads = gradients(state.params, batch["inputs"], batch["targets"])
        return apply_gradients(tx, state, loss, grads, fault_nonfinite_step)

    batch_sh = sharding.batch_sharding(mesh, leading=1)
    return jax.jit(
        on_mesh(train_step, mesh),
        in_shardings=(state_shardings, {"inputs": batch_sh, "targets": batch_sh}),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def abstract_batch(mesh: jax.sharding.Mesh, accum: int, rows: int, seq_len: int) -> dict:
    """The train step's batch as ShapeDtypeStructs, to lower it without data: {inputs,
    targets} int32 (accum, rows per step, seq_len), split over the batch axes."""
    tokens = jax.ShapeDtypeStruct(
        (accum, rows, seq_len), jnp.int32, sharding=sharding.batch_sharding(mesh, leading=1)
    )
    return {"inputs": tokens, "targets": tokens}


def make_step_halves(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state_shardings: TrainState,
    mesh: jax.sharding.Mesh,
    schedule: fsdp.StepSchedule = fsdp.PLAIN,
) -> tuple[Callable, Callable]:
    """The two halves of `make_train_step`'s step, each jitted alone with the step's shardings
    (the bench times them): `gradients(params, inputs, targets) -> (loss, grads)` and
    `update(state, loss, grads) -> (state, metrics)`, which donates the state as the step
    does."""
    batch_sh = sharding.batch_sharding(mesh, leading=1)
    rep = sharding.replicated(mesh)
    gradients = jax.jit(
        on_mesh(fsdp.sharded_gradients(graphdef, state_shardings.params, mesh, schedule), mesh),
        in_shardings=(state_shardings.params, batch_sh, batch_sh),
        out_shardings=(rep, state_shardings.params),
    )
    update = jax.jit(
        on_mesh(functools.partial(apply_gradients, tx), mesh),
        in_shardings=(state_shardings, rep, state_shardings.params),
        out_shardings=(state_shardings, rep),
        donate_argnums=0,
    )
    return gradients, update


def make_eval_step(
    graphdef: nnx.GraphDef, state_shardings: TrainState, mesh: jax.sharding.Mesh
) -> Callable[[dict, dict, jax.Array], tuple[jax.Array, jax.Array]]:
    """eval_step(params, batch (rows, T), token_bytes (V,)) -> (sum nats, sum bytes)."""

    def eval_step(params, batch, token_bytes):
        model = nnx.merge(graphdef, params)
        per_token = model.loss(batch["inputs"], batch["targets"], reduction="none")
        return bpb_sums(per_token, batch["targets"], token_bytes)

    batch_sh = sharding.batch_sharding(mesh)
    rep = sharding.replicated(mesh)
    return jax.jit(
        on_mesh(eval_step, mesh),
        in_shardings=(state_shardings.params, {"inputs": batch_sh, "targets": batch_sh}, rep),
        out_shardings=(rep, rep),
    )
