"""d12 BoV (gamma * E_l[ids] in layers 8-11): the Fig. 5(b) reference arm, 1.5e18 FLOPs.

Use --config.train.target_flops=... to set another budget; see bov_jax/presets.py.
"""

from bov_jax.presets import config_for


def get_config():
    return config_for("d12_bov")
