"""The fsdp gradient's reduce-scatter in two stages on TPU slices whose fsdp devices span
three torus dimensions.

On a 3-D torus (TPU v4, and v5p past 4 chips) libtpu's reduce-scatter-decomposer pass (post
layout assignment) rewrites a reduce-scatter whose group spans all three dimensions into an
all-reduce of the whole operand (its RotatedPincerEmitter) and a slice: each chip then sends
2(n-1)/n of the gradient instead of (n-1)/n and holds it reduced whole. A group spanning one
or two dimensions keeps its reduce-scatter. So the gradient is reduce-scattered first over
the chips along one dimension (the whole gradient) and then over the chips of the other two
(the rows the first left each chip): it sums the same partial gradients, leaves each device
the same rows, and its wire bytes add up to the flat reduce-scatter's, (n0-1)/n0 +
(n/n0-1)/n = (n-1)/n of the gradient. `benchmarks/reduce_scatter_forms.py` compiles both
forms per target.

A device's rows are those of its index along the fsdp axis, so the stages apply where that
index is a mixed-radix number of the devices' torus coordinates (as `jax.make_mesh` orders
them): the most significant digit's dimension is the first stage, each of its groups ordered
by that coordinate. Elsewhere (other platforms, fewer than three dimensions, an order that is
no such number) there are no stages and the reduce-scatter is one `psum_scatter` over the
axis.
"""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np

# The fsdp axis's index groups of one stage: each a tuple of axis indices, in the order the
# stage's tiled psum_scatter hands out the rows.
Groups = tuple[tuple[int, ...], ...]


def stages_for(coords: np.ndarray) -> tuple[Groups, ...]:
    """The reduce-scatter's stages for devices at `coords`, (groups, n, dims): for each group
    of the axis (one per index of the other mesh axes) its n devices' torus coordinates in
    axis order. Two stages (along the most significant dimension, then over the rest), or ()
    where one psum_scatter over the axis is the reduce-scatter (module docstring)."""
    groups, n, _ = coords.shape
    digits = np.stack(  # (groups, n, dims): the rank of each coordinate within its group
        [
            np.stack([np.unique(coords[g, :, k], return_inverse=True)[1] for g in range(groups)])
            for k in range(coords.shape[2])
        ],
        axis=-1,
    )
    varying = [k for k in range(coords.shape[2]) if digits[..., k].max() > 0]
    sizes = {k: int(digits[..., k].max()) + 1 for k in varying}
    if len(varying) < 3 or math.prod(sizes.values()) != n:
        return ()
    for order in itertools.permutations(varying):  # most significant first
        index = np.zeros((groups, n), np.int64)
        for k in order:
            index = index * sizes[k] + digits[..., k]
        if (index == np.arange(n)).all():
            first = sizes[order[0]]
            return (_stage_groups(n, first, n // first), _stage_groups(n, n // first, 1))
    return ()


def _stage_groups(n: int, size: int, stride: int) -> Groups:
    """The index groups of the stage along a dimension of `size` devices `stride` apart."""
    bases = (i for i in range(n) if (i // stride) % size == 0)
    return tuple(tuple(base + d * stride for d in range(size)) for base in bases)


def scatter_stages(mesh: jax.sharding.Mesh, axis: str) -> tuple[Groups, ...]:
    """`stages_for` the devices of `mesh` along `axis`; () off TPU and on fewer than the 8
    devices that three torus dimensions take."""
    devices = mesh.devices
    if devices.flat[0].platform != "tpu" or mesh.shape[axis] < 8:
        return ()
    along = np.moveaxis(devices, mesh.axis_names.index(axis), -1)
    along = along.reshape(-1, mesh.shape[axis])
    return stages_for(np.array([[d.coords for d in group] for group in along]))


def reduce_scatter(g: jax.Array, axis: str, dim: int, stages: tuple[Groups, ...]) -> jax.Array:
    """g summed over the devices of `axis` and split along `dim`, this device keeping the
    rows of its axis index: one tiled psum_scatter per stage, or one over the axis."""
    if not stages:
        return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    for groups in stages:
        g = jax.lax.psum_scatter(
            g, axis, scatter_dimension=dim, tiled=True, axis_index_groups=[list(x) for x in groups]
        )
    return g
