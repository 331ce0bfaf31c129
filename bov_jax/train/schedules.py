"""Learning-rate, Muon-momentum and Muon weight-decay schedules (spec 3.5).

Every function is a pure function of the 0-based optimizer step `step` (a Python int or a
traced int32 scalar inside `jax.jit`) and returns a float32 scalar `jax.Array`. The horizon
arguments (`num_steps`, `warmup_steps`, ratios, constants) are static Python numbers: the
warmdown length is computed with Python's `round` exactly as `scripts/base_train.py` does
(round-half-to-even on a float64 product), so the warmdown start step matches the reference
bit for bit (d12 N=3766 -> 1318, d24 N=7809 -> 2733, d24 BoV N=7998 -> 2799).
"""

import math

import jax
import jax.numpy as jnp

Step = int | jax.Array


def warmdown_steps(num_steps: int, warmdown_ratio: float) -> int:
    """W = round(warmdown_ratio * N), the length of the final linear decay."""
    return round(warmdown_ratio * num_steps)


def warmdown_start(num_steps: int, warmdown_ratio: float) -> int:
    """N - W: the last step at full LR and the first step of the momentum warmdown."""
    return num_steps - warmdown_steps(num_steps, warmdown_ratio)


def lr_multiplier(
    step: Step,
    num_steps: int,
    warmup_steps: int,
    warmdown_ratio: float,
    final_lr_frac: float,
) -> jax.Array:
    """The LR multiplier lrm(step) that scales every group's base learning rate.

    step < warmup_steps:           (step + 1) / warmup_steps
    step <= N - W:                 1.0
    otherwise, with p = (N - step) / W:  p + (1 - p) * final_lr_frac
    """
    warmdown = warmdown_steps(num_steps, warmdown_ratio)
    it = jnp.asarray(step, jnp.float32)
    warmup = (it + 1.0) / max(warmup_steps, 1)
    progress = (num_steps - it) / max(warmdown, 1)
    decay = progress + (1.0 - progress) * final_lr_frac
    return jnp.where(
        it < warmup_steps, warmup, jnp.where(it <= num_steps - warmdown, 1.0, decay)
    ).astype(jnp.float32)


def muon_momentum(
    step: Step,
    num_steps: int,
    *,
    warmdown_ratio: float,
    warmup_steps: int,
    momentum_start: float,
    momentum_peak: float,
    momentum_end: float,
) -> jax.Array:
    """The Muon momentum at `step`.

    Config keys: muon_momentum_warmup_steps, muon_momentum_start, muon_momentum (the peak),
    muon_momentum_end.

    step < warmup_steps (takes precedence): linear momentum_start -> momentum_peak over
        frac = step / warmup_steps;
    step >= N - W: linear momentum_peak -> momentum_end over q = (step - (N - W)) / W;
    otherwise momentum_peak.
    """
    warmdown = warmdown_steps(num_steps, warmdown_ratio)
    start = num_steps - warmdown
    it = jnp.asarray(step, jnp.float32)
    frac = it / max(warmup_steps, 1)
    warmup = (1.0 - frac) * momentum_start + frac * momentum_peak
    q = (it - start) / max(warmdown, 1)
    decay = momentum_peak * (1.0 - q) + momentum_end * q
    return jnp.where(
        it < warmup_steps, warmup, jnp.where(it >= start, decay, momentum_peak)
    ).astype(jnp.float32)


def muon_weight_decay(step: Step, num_steps: int, base_wd: float) -> jax.Array:
    """Cosine decay of the Muon weight decay: base_wd * 0.5 * (1 + cos(pi * step / N)).

    `base_wd` is the already batch- and horizon-scaled `weight_decay_scaled` of spec 3.4.
    """
    remaining = num_steps - jnp.asarray(step, jnp.float32)
    # 0.5 (1 + cos(pi t / N)) = sin(pi (N - t) / 2N)^2 keeps float32's relative precision
    # near the end, where the cosine form cancels to a few significant bits.
    return (base_wd * jnp.sin(0.5 * math.pi * remaining / num_steps) ** 2).astype(jnp.float32)
