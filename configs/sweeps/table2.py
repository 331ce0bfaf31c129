"""Table 2 of the paper: d24 baseline and BoV at 100B tokens (95,367 steps of 2^20 tokens).

  python -m bov_jax.sweep --sweep=configs/sweeps/table2.py --root=DIR \
      --override=data.data_dir=$CLIMBMIX --launcher=slurm|tpu
"""

from bov_jax.sweep.jobs import Run, Sweep


def get_sweep() -> Sweep:
    return Sweep(
        name="table2",
        title="Table 2: d24 baseline and BoV",
        layout="d24",
        baseline="d24",
        seeds=1,
        runs=(
            Run("d24", "configs/d24.py", paper=dict(val_bpb=0.671, core=0.334)),
            Run("d24_bov", "configs/d24_bov.py", paper=dict(val_bpb=0.663, core=0.351)),
        ),
    )
