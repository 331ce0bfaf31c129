"""Table 3 of the paper (and V + E_v[i] of Tables 3/5): d24 value paths at 3.91e19 FLOPs.

  python -m bov_jax.sweep --sweep=configs/sweeps/table3.py --root=DIR \
      --override=data.data_dir=$CLIMBMIX --launcher=slurm|tpu
"""

from bov_jax.presets import PAPER_EVAL_EVERY
from bov_jax.sweep.jobs import Run, Sweep

# (preset, the paper's val BPB, the paper's CORE)
ROWS = (
    ("d24", 0.722, 0.260),
    ("d24_bov", 0.714, 0.272),
    ("d24_x0_learn", 0.719, 0.259),
    ("d24_v1_learn", 0.718, 0.242),
    ("d24_v1_every_layer", 0.741, 0.210),
    ("d24_ve_gated", 0.712, 0.268),
)


def get_sweep() -> Sweep:
    return Sweep(
        name="table3",
        title="Table 3: d24 value paths",
        layout="d24",
        baseline="d24",
        seeds=1,
        # d24 and d24_bov default to the 100B horizon's sparser evals: the authors' cadence
        overrides={"train.target_flops": 3.91e19, "train.eval_every": PAPER_EVAL_EVERY},
        runs=tuple(
            Run(preset, f"configs/ablations.py:{preset}", paper=dict(val_bpb=bpb, core=core))
            for preset, bpb, core in ROWS
        ),
    )
