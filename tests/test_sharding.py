"""Mesh sizing and the logical-axis rule table."""

import jax
import ml_collections
import pytest
from jax.sharding import PartitionSpec as P

from bov_jax import sharding


def mesh_cfg(data=-1, fsdp=1, tensor=1):
    return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))


def test_mesh_shape_fills_one_axis_and_names_bad_sizes():
    assert sharding.mesh_shape(mesh_cfg(), 8) == (8, 1, 1)
    assert sharding.mesh_shape(mesh_cfg(2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="at most one"):
        sharding.mesh_shape(mesh_cfg(-1, -1), 8)
    with pytest.raises(ValueError, match="needs 12 devices; 8 are available"):
        sharding.mesh_shape(mesh_cfg(3, 2, 2), 8)
    with pytest.raises(ValueError, match="do not divide 8 devices"):
        sharding.mesh_shape(mesh_cfg(-1, 3), 8)


def test_logical_rules_map_names_to_mesh_axes():
    assert sharding.logical_to_mesh(P("vocab", "embed")) == P("tensor", "fsdp")
    assert sharding.logical_to_mesh(P("bank_vocab", "kv")) == P("fsdp", "tensor")
    assert sharding.logical_to_mesh(P(None, None)) == P(None, None)
    assert sharding.logical_to_mesh(None) == P()


def test_global_batch_is_sharded_over_data_and_fsdp():
    import numpy as np

    mesh = sharding.make_mesh(mesh_cfg(2, 2, 2), jax.devices()[:8])
    batch = sharding.global_batch({"inputs": np.zeros((3, 8, 16), np.int32)}, mesh, leading=1)
    assert batch["inputs"].shape == (3, 8, 16)
    assert batch["inputs"].sharding.spec == P(None, ("data", "fsdp"))
    assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(3, 2, 16)}
