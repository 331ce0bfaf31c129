"""The fsdp reduce-scatter in torus stages (bov_jax/train/torus.py): which device orders get
stages, and that the staged reduce-scatter leaves each of the 8 fake CPU devices the same rows
of the same sum as one psum_scatter."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from bov_jax.train import torus


def mixed_radix_coords(sizes: tuple[int, ...], order: tuple[int, ...]) -> np.ndarray:
    """(1, n, len(sizes)): the coordinates of a torus of `sizes` chips, listed with the
    dimensions of `order` from most to least significant."""
    ranges = [range(sizes[k]) for k in order]
    listed = []
    for digits in itertools.product(*ranges):
        coords = [0] * len(sizes)
        for k, d in zip(order, digits):
            coords[k] = d
        listed.append(coords)
    return np.array([listed])


def test_three_dimensions_reduce_along_the_most_significant_then_over_the_rest():
    # 2x4x4 listed with the third coordinate fastest, as jax.make_mesh lists a v5p-64
    stages = torus.stages_for(mixed_radix_coords((2, 4, 4), (0, 1, 2)))
    assert stages == (
        tuple((i, i + 16) for i in range(16)),
        (tuple(range(16)), tuple(range(16, 32))),
    )
    # another order of the dimensions: the first stage is the most significant one's
    first, rest = torus.stages_for(mixed_radix_coords((2, 4, 4), (1, 0, 2)))
    assert first == tuple((i, i + 8, i + 16, i + 24) for i in range(8))
    assert rest == tuple(tuple(range(8 * j, 8 * j + 8)) for j in range(4))


def test_no_stages_where_one_psum_scatter_is_a_reduce_scatter_or_the_order_is_no_number():
    assert torus.stages_for(mixed_radix_coords((2, 4), (0, 1))) == ()  # a 2-D torus
    assert torus.stages_for(mixed_radix_coords((2, 1, 4), (0, 1, 2))) == ()  # two dimensions
    snake = mixed_radix_coords((2, 2, 2), (0, 1, 2))
    snake[0, [2, 3]] = snake[0, [3, 2]]  # a ring order: index 2 is no mixed-radix number
    assert torus.stages_for(snake) == ()


def test_every_group_of_the_axis_must_share_the_order():
    one = mixed_radix_coords((2, 2, 2), (0, 1, 2))[0]
    other = mixed_radix_coords((2, 2, 2), (2, 1, 0))[0]
    assert torus.stages_for(np.stack([one, one])) == torus.stages_for(one[None])
    assert torus.stages_for(np.stack([one, other])) == ()


def test_off_tpu_the_mesh_has_no_stages():
    mesh = jax.make_mesh((8,), ("fsdp",))
    assert torus.scatter_stages(mesh, "fsdp") == ()


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_staged_reduce_scatter_equals_one_psum_scatter(order):
    stages = torus.stages_for(mixed_radix_coords((2, 2, 2), order))
    assert len(stages) == 2
    mesh = jax.make_mesh((8,), ("fsdp",))
    rng = np.random.default_rng(0)
    partials = rng.standard_normal((8, 16, 3)).astype(np.float32)  # one (16, 3) per device

    def scattered(stages):
        def body(x):
            return torus.reduce_scatter(x[0], "fsdp", 0, stages)

        shard_map = jax.shard_map(
            body, mesh=mesh, in_specs=PartitionSpec("fsdp"), out_specs=PartitionSpec("fsdp")
        )
        split = jax.device_put(partials, NamedSharding(mesh, PartitionSpec("fsdp")))
        return np.asarray(jax.jit(shard_map)(split))

    staged, flat = scattered(stages), scattered(())
    np.testing.assert_allclose(flat, partials.sum(axis=0), rtol=1e-6, atol=1e-6)
    # the same sums, each device keeping the rows of its index; summed in another order
    np.testing.assert_allclose(staged, flat, rtol=1e-6, atol=1e-6)
