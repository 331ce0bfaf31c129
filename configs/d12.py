"""The d12 (135M) baseline of Table 1, row 1, at the paper's 1.5e18-FLOP budget.

Use --config.train.target_flops=... to set another budget; see bov_jax/presets.py.
"""

from bov_jax.presets import config_for


def get_config():
    return config_for("d12")
