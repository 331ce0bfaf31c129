"""Schedules of spec 3.5 at chosen steps, from Python and under jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bov_jax.train import schedules

# d24 BoV horizon of spec 3.5: N = 7998, W = round(0.65 N) = 5199, warmdown starts at 2799.
N = 7998
W = 5199
MOMENTUM = dict(
    warmdown_ratio=0.65,
    warmup_steps=400,
    momentum_start=0.85,
    momentum_peak=0.97,
    momentum_end=0.90,
)


def lrm(step):
    return float(schedules.lr_multiplier(step, N, 40, 0.65, 0.05))


def momentum(step):
    return float(schedules.muon_momentum(step, N, **MOMENTUM))


@pytest.mark.parametrize(
    "num_steps, start", [(3766, 1318), (7809, 2733), (7998, 2799)], ids=["d12", "d24", "d24_bov"]
)
def test_warmdown_start_matches_spec(num_steps, start):
    assert schedules.warmdown_start(num_steps, 0.65) == start
    at = schedules.lr_multiplier(start, num_steps, 40, 0.65, 0.05)
    after = schedules.lr_multiplier(start + 1, num_steps, 40, 0.65, 0.05)
    assert float(at) == 1.0 and float(after) < 1.0


def test_lr_multiplier_at_chosen_steps():
    assert schedules.warmdown_steps(N, 0.65) == W
    expected = {
        0: 1 / 40,
        39: 1.0,
        40: 1.0,
        2799: 1.0,
        2800: 5198 / W + (1 - 5198 / W) * 0.05,
        N - 1: 1 / W + (1 - 1 / W) * 0.05,
    }
    for step, value in expected.items():
        assert lrm(step) == pytest.approx(value, rel=1e-6), step


def test_muon_momentum_at_chosen_steps():
    expected = {
        0: 0.85,
        200: 0.5 * 0.85 + 0.5 * 0.97,
        399: (1 / 400) * 0.85 + (399 / 400) * 0.97,
        400: 0.97,
        2798: 0.97,
        2799: 0.97,
        2800: 0.97 * (1 - 1 / W) + 0.90 / W,
        N - 1: 0.97 * (1 - 5198 / W) + 0.90 * 5198 / W,
    }
    for step, value in expected.items():
        assert momentum(step) == pytest.approx(value, rel=1e-6), step


def test_momentum_warmup_takes_precedence_over_warmdown():
    # N = 500: the warmdown starts at 175, inside the 400-step momentum warmup.
    value = schedules.muon_momentum(300, 500, **MOMENTUM)
    assert float(value) == pytest.approx(0.25 * 0.85 + 0.75 * 0.97, rel=1e-6)


def test_muon_weight_decay_cosine():
    wd = 0.059738
    assert float(schedules.muon_weight_decay(0, N, wd)) == pytest.approx(wd, rel=1e-6)
    assert float(schedules.muon_weight_decay(N // 2, N, wd)) == pytest.approx(wd / 2, rel=1e-5)
    end = wd * 0.5 * (1 + math.cos(math.pi * (N - 1) / N))
    assert float(schedules.muon_weight_decay(N - 1, N, wd)) == pytest.approx(end, rel=1e-5)


def test_schedules_under_jit_equal_python():
    steps = jnp.array([0, 39, 40, 2799, 2800, N - 1], jnp.int32)

    @jax.jit
    def all_schedules(step):
        return (
            schedules.lr_multiplier(step, N, 40, 0.65, 0.05),
            schedules.muon_momentum(step, N, **MOMENTUM),
            schedules.muon_weight_decay(step, N, 0.28),
        )

    traced = jax.vmap(all_schedules)(steps)
    for i, step in enumerate(steps.tolist()):
        python = (lrm(step), momentum(step), float(schedules.muon_weight_decay(step, N, 0.28)))
        np.testing.assert_allclose([float(t[i]) for t in traced], python, rtol=1e-6)
