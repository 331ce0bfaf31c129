"""Any paper preset by name: --config=configs/ablations.py:d12_x0_learn.

`python -m bov_jax.presets` lists the names and the paper row each reproduces.
"""

from bov_jax.presets import config_for


def get_config(name: str):
    return config_for(name)
