"""Bits per byte (spec 6.3) on a tiny hand-computed case, jitted and on a sharded global array."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.evals.bpb import bits_per_byte, bpb_sums

# ids:           0  1  2  3  4  5   (id 0 is a special token: 0 bytes)
TOKEN_BYTES = [0, 1, 3, 2, 1, 4]
NATS = [[1.0, 2.0, 3.0], [0.5, 4.0, 1.5]]
TARGETS = [[5, 0, 2], [-1, 3, 1]]
# Counted: (5: 1.0 nats, 4 B), (2: 3.0, 3 B), (3: 4.0, 2 B), (1: 1.5, 1 B); the special target 0
# and the ignored target -1 are left out of both sums.
SUM_NATS, SUM_BYTES = 1.0 + 3.0 + 4.0 + 1.5, 4 + 3 + 2 + 1


def _arrays():
    return (
        jnp.asarray(NATS, jnp.float32),
        jnp.asarray(TARGETS, jnp.int32),
        jnp.asarray(TOKEN_BYTES, jnp.int32),
    )


def test_hand_computed_case():
    sum_nats, sum_bytes = bpb_sums(*_arrays())
    assert float(sum_nats) == pytest.approx(SUM_NATS)
    assert int(sum_bytes) == SUM_BYTES
    assert sum_bytes.dtype == jnp.int32
    assert bits_per_byte(sum_nats, sum_bytes) == pytest.approx(9.5 / (10 * math.log(2)))


def test_jit_and_excluded_positions_do_not_leak():
    nats, targets, token_bytes = _arrays()
    nats = nats.at[0, 1].set(jnp.nan).at[1, 0].set(jnp.inf)  # both positions are excluded
    sum_nats, sum_bytes = jax.jit(bpb_sums)(nats, targets, token_bytes)
    assert float(sum_nats) == pytest.approx(SUM_NATS)
    assert int(sum_bytes) == SUM_BYTES


def test_accumulation_over_steps():
    steps = [bpb_sums(*_arrays()) for _ in range(3)]
    total_nats = sum(float(n) for n, _ in steps)
    total_bytes = sum(int(b) for _, b in steps)
    assert bits_per_byte(total_nats, total_bytes) == pytest.approx(9.5 / (10 * math.log(2)))


def test_zero_bytes_raises():
    with pytest.raises(ValueError, match="no target bytes"):
        bits_per_byte(1.0, 0)


def test_sharded_global_sum():
    """On 4 CPU devices, a batch-sharded global array gives the same sums as the host array."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from bov_jax.evals.bpb import bpb_sums
        assert jax.device_count() == 4
        rng = np.random.default_rng(0)
        nats = rng.random((8, 16)).astype(np.float32)
        targets = rng.integers(-1, 6, (8, 16)).astype(np.int32)
        token_bytes = np.array([0, 1, 3, 2, 1, 4], np.int32)
        mesh = Mesh(np.array(jax.devices()), ("data",))
        shard = NamedSharding(mesh, P("data"))
        sum_nats, sum_bytes = jax.jit(bpb_sums)(
            jax.device_put(nats, shard), jax.device_put(targets, shard), token_bytes
        )
        nb = np.where(targets >= 0, token_bytes[np.maximum(targets, 0)], 0)
        np.testing.assert_allclose(float(sum_nats), nats[nb > 0].sum(), rtol=1e-6)
        assert int(sum_bytes) == nb.sum()
        print("ok")
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_numpy_inputs_work():
    sum_nats, sum_bytes = bpb_sums(
        np.asarray(NATS, np.float32), np.asarray(TARGETS, np.int32), np.asarray(TOKEN_BYTES)
    )
    assert float(sum_nats) == pytest.approx(SUM_NATS) and int(sum_bytes) == SUM_BYTES
