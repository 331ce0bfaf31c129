"""Fig. 5(b) of the paper: the BoV component ablation at d12 (1.5e18 FLOPs each).

  python -m bov_jax.sweep --sweep=configs/sweeps/fig5b.py --root=DIR \
      --override=data.data_dir=$CLIMBMIX [--seeds=3]

The paper gives these arms as curves only; every arm is paired with BoV itself.
"""

from bov_jax.sweep.jobs import Run, Sweep

ARMS = (
    ("d12_bov", "BoV"),
    ("d12_bov_no_coeff", "no coeff."),
    ("d12_bov_every_layer", "every layer"),
    ("d12_bov_shared", "shared table"),
    ("d12_bov_add_v", "add V"),
)


def get_sweep() -> Sweep:
    return Sweep(
        name="fig5b",
        title="Fig. 5(b): BoV components at d12",
        layout="fig5b",
        baseline="d12_bov",
        seeds=1,
        runs=tuple(
            Run(preset, f"configs/ablations.py:{preset}", paper=dict(arm=arm))
            for preset, arm in ARMS
        ),
    )
