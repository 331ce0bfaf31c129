"""Table 1 of the paper: the 13 value paths at d12 (1.5e18 FLOPs each) and BoV.

  python -m bov_jax.sweep --sweep=configs/sweeps/table1.py --root=DIR \
      --override=data.data_dir=$CLIMBMIX [--seeds=3] [--launcher=slurm|tpu]

The paper's val BPB of each row (spec 2.5) sits beside ours in the report; its d12 BoV has no
number in a table (Fig. 5(b) shows its curve only).
"""

from bov_jax.sweep.jobs import Run, Sweep

# (preset, output, target, coefficient, the paper's val BPB)
ROWS = (
    ("d12", "V", "-", "-", 0.854),
    ("d12_v_learn", "V", "last 4", "gamma", 0.858),
    ("d12_v1_every_layer", "V1", "all 12", "1", 0.872),
    ("d12_v1_learn_every2", "V1", "every 2", "gamma", 0.851),
    ("d12_v1", "V1", "last 4", "1", 0.849),
    ("d12_v1_learn", "V1", "last 4", "gamma", 0.847),
    ("d12_x0_learn_every2", "x0 W_V", "every 2", "gamma", 0.849),
    ("d12_x0", "x0 W_V", "last 4", "1", 0.847),
    ("d12_x0_learn", "x0 W_V", "last 4", "gamma", 0.845),
    ("d12_add_v1", "V + V1", "last 4", "0.5", 0.849),
    ("d12_add_v1_learn", "V + V1", "last 4", "alpha, beta", 0.848),
    ("d12_add_x0", "V + x0 W_V", "last 4", "0.5", 0.848),
    ("d12_add_x0_learn", "V + x0 W_V", "last 4", "alpha, beta", 0.845),
    ("d12_bov", "E_v[i] (BoV)", "last 4", "gamma", None),
)


def paper_row(output: str, target: str, coeff: str, val_bpb: float | None) -> dict:
    row = dict(output=output, target=target, coeff=coeff)
    return row if val_bpb is None else {**row, "val_bpb": val_bpb}


def get_sweep() -> Sweep:
    return Sweep(
        name="table1",
        title="Table 1: value paths at d12",
        layout="table1",
        baseline="d12",
        seeds=1,
        runs=tuple(
            Run(preset, f"configs/ablations.py:{preset}", paper=paper_row(*row))
            for preset, *row in ROWS
        ),
    )
