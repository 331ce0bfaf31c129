"""Device mesh, logical-axis rules and placement of parameters and batches.

Parameters carry logical axis names (bov_jax/model/gpt.py); `RULES` maps them onto the
mesh axes (data, fsdp, tensor). Changing the parallelism means changing the mesh sizes
in the config (or this table), never the model.

  embed       -> fsdp     weights are split along the model width (ZeRO-3 style)
  vocab       -> tensor   wte / lm_head rows (columns of lm_head) over tensor
  heads, kv   -> tensor   attention projections split by head
  mlp         -> tensor   MLP hidden units
  bank_vocab  -> fsdp     each bank is sharded by vocab rows, like an embedding table;
                          its kv features follow the attention heads (tensor)
  batch       -> (data, fsdp)

Axes are Auto (GSPMD propagation): gathers on sharded tables need no annotations. The
activations are pinned to the batch axes (`constrain`, at the residual stream, the attention
heads, the MLP hidden units and the loss's chunks): without that, GSPMD may follow a
weight's fsdp split of the model width into the activations and gather whole micro-batches
instead of weights.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
RULES: dict[str, Any] = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv": "tensor",
    "mlp": "tensor",
    "bank_vocab": "fsdp",
    "batch": BATCH_AXES,
}


def mesh_shape(mesh_cfg: Any, n_devices: int) -> tuple[int, int, int]:
    """Resolve the (data, fsdp, tensor) sizes; one -1 takes the remaining devices."""
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one of mesh.{', mesh.'.join(MESH_AXES)} may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if fill:
        if n_devices % known:
            raise ValueError(
                f"mesh sizes {dict(zip(MESH_AXES, sizes))} do not divide {n_devices} devices"
            )
        sizes[fill[0]] = n_devices // known
    if int(np.prod(sizes)) != n_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices; "
            f"{n_devices} are available"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: Any, devices: list | None = None) -> jax.sharding.Mesh:
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def platform(mesh: jax.sharding.Mesh) -> str:
    """ "cpu", "gpu" or "tpu": the platform of the mesh's devices, which may be those of a
    compile-only target (bov_jax.compile) rather than this host's backend."""
    name = mesh.devices.flat[0].platform
    return "gpu" if name in ("cuda", "rocm") else name


def logical_to_mesh(logical: PartitionSpec | tuple | None) -> PartitionSpec:
    """('vocab', 'embed') -> P('tensor', 'fsdp'); unnamed axes stay replicated."""
    if logical is None:
        return PartitionSpec()
    return PartitionSpec(*(RULES.get(name) if name else None for name in logical))


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, an axis name, or a tuple of them."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def split_dim(spec: PartitionSpec, axis: str = "fsdp") -> int:
    """The dimension a mesh spec splits over `axis`, -1 if none."""
    for i, entry in enumerate(spec):
        if axis in entry_axes(entry):
            return i
    return -1


def without_axes(spec: PartitionSpec, axes: Any) -> PartitionSpec:
    """`spec` with the mesh axes `axes` taken out (those entries replicated instead)."""

    def keep(entry: Any) -> Any:
        kept = tuple(name for name in entry_axes(entry) if name not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(entry) for entry in spec))


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """x with one logical axis name (or None) per dimension, laid out by `RULES` on the
    ambient mesh (the train and eval steps trace under theirs); unchanged where none is set
    (eager calls, decoding, single-device use). ("batch", None, "mlp") on (B, T, F) splits the
    rows over (data, fsdp) and the hidden units over tensor. Inside a shard_map the axes it
    made manual are left out: each device's array there is already its own part."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = without_axes(logical_to_mesh(logical), set(mesh.manual_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def per_device_heads(attend: Any) -> Any:
    """`attend(q, k, v)` on (B, T, H, hd) arrays, run on each device's rows and heads of the
    ambient mesh: for attention kernels XLA does not partition (splash, a Mosaic call) or
    partitions only where no axis is manual (cuDNN's custom partitioner fails inside the train
    step's shard_map over the batch axes). A shard_map over the ambient mesh's axes that are
    still XLA's (all three outside a shard_map; tensor inside the train step's): batch rows
    over data and fsdp, heads over tensor. `attend` itself where no mesh is set."""

    def wrapped(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
            return attend(q, k, v)
        auto = [axis for axis in MESH_AXES if axis not in mesh.manual_axes]
        batch = tuple(axis for axis in BATCH_AXES if axis in auto) or None
        spec = PartitionSpec(batch, None, "tensor" if "tensor" in auto else None, None)
        mapped = jax.shard_map(
            attend, in_specs=(spec,) * 3, out_specs=spec, axis_names=set(auto), check_vma=False
        )
        return mapped(q, k, v)

    return wrapped


def ambient_batch_shards() -> int:
    """Devices the rows are split over on the ambient mesh (1 where none is set, and 1 inside
    a shard_map over the batch axes, where each device holds its own rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES if a not in mesh.manual_axes]))


def fsdp_dim(logical: PartitionSpec | tuple | None) -> int:
    """The dimension `RULES` splits over the fsdp axis in a parameter's logical spec, -1 if
    none: ('vocab', 'embed') -> 1, ('bank_vocab', 'kv') -> 0, (None,) -> -1."""
    return split_dim(logical_to_mesh(logical))


def shardings_for(logical_specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """Map a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_mesh(spec)),
        logical_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_size_per_step(mesh: jax.sharding.Mesh) -> int:
    """Devices the batch is split over."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: jax.sharding.Mesh, leading: int = 0) -> NamedSharding:
    """Rows over (data, fsdp), after `leading` unsharded axes (e.g. micro-steps)."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading), BATCH_AXES))


def global_batch(local: dict[str, np.ndarray], mesh: jax.sharding.Mesh, leading: int = 0) -> dict:
    """Assemble each process's rows into global jax.Arrays sharded over the batch axes.

    local: {name: (..., rows_local, T)} -> {name: (..., rows_local * process_count, T)}.
    """
    sharding = batch_sharding(mesh, leading)
    out = {}
    for name, array in local.items():
        shape = list(array.shape)
        shape[leading] *= jax.process_count()
        out[name] = jax.make_array_from_process_local_data(sharding, array, tuple(shape))
    return out
