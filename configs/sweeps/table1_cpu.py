"""Table 1 at CPU scale: the Table 1 rows and BoV as quickstart models on the embedded corpus.

Depth 4, width 256, seq 512, vocab 8192 (configs/quickstart.py), 120 steps of 4,096 tokens,
val BPB every 20 steps; about 3 minutes a run on 2 CPU cores. At depth 4 the "last third" is
layers 2-3 (the paper's "last 4" of 12). The paper's numbers (d12, 1.5e18 FLOPs) are shown for
the ordering only: the scales differ by four orders of magnitude. The committed reproduction
(docs/results/table1_cpu/) ran the Fig. 4 set with 3 seeds:

  python -m bov_jax.sweep --sweep=configs/sweeps/table1_cpu.py --root=runs/table1_cpu \
      --only=d12,d12_bov,d12_x0_learn,d12_v1_learn,d12_v1_every_layer --seeds=3
  python -m bov_jax.report --root=runs/table1_cpu
"""

from pathlib import Path

from bov_jax.config import load_python_file
from bov_jax.sweep.jobs import Run, Sweep

table1 = load_python_file(Path(__file__).with_name("table1.py"), "sweep file")

STEPS = 120


def depth4_target(target: str) -> str:
    """The paper's d12 target labels at depth 4: "last 4" is the last third, "all 12" all."""
    return {"last 4": "last third", "all 12": "all (1..3)"}.get(target, target)


def get_sweep() -> Sweep:
    return Sweep(
        name="table1_cpu",
        title="Table 1 at CPU scale: quickstart models (depth 4, width 256)",
        layout="table1",
        baseline="d12",
        seeds=3,
        overrides={"train.num_steps": STEPS, "train.eval_every": 20},
        runs=tuple(
            Run(
                preset,
                f"configs/quickstart.py:{preset}",
                paper=table1.paper_row(output, depth4_target(target), coeff, bpb),
            )
            for preset, output, target, coeff, bpb in table1.ROWS
        ),
    )
