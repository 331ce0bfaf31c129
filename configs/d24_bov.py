"""d24 BoV (gamma * E_l[ids] in layers 16-23), Table 2 row 2, on the 100B-token horizon.

Use --config.train.target_flops=... to set another budget; see bov_jax/presets.py.
"""

from bov_jax.presets import config_for


def get_config():
    return config_for("d24_bov")
