"""Recall at CPU scale: MQAR for the baseline, BoV, x0-learned and V1-learned value paths x
width x number of pairs (configs/mqar.py: depth 3, so the "last third" is layer 2; rows of 256
tokens; every run the same steps). Each job is scored on the held-out split afterwards. On
2 cores, two jobs at once (one core each) finish the 108 jobs in about half the time:

  JAX_COMPILATION_CACHE_DIR=runs/jax_cache python -m bov_jax.sweep \
      --sweep=configs/sweeps/recall_cpu.py --root=runs/recall_cpu --parallel=2
  python -m bov_jax.probes mqar_sweep --root=runs/recall_cpu --out=docs/results/recall_cpu

Run names are <path>_d<width>_n<pairs>; the baseline of each (width, pairs) cell is its d12 run.
"""

from bov_jax.sweep.jobs import Run, Sweep

VALUE_PATHS = {
    "baseline": "d12",
    "bov": "d12_bov",
    "x0_learned": "d12_x0_learn",
    "v1_learned": "d12_v1_learn",
}
WIDTHS = (32, 64, 128)
PAIRS = (8, 32, 64)
STEPS = 300


def run_name(path: str, width: int, pairs: int) -> str:
    return f"{path}_d{width}_n{pairs}"


def get_sweep() -> Sweep:
    return Sweep(
        name="recall_cpu",
        title="MQAR recall by value path, width and pairs (depth 3, seq 256, CPU scale)",
        baseline=run_name("baseline", WIDTHS[0], PAIRS[0]),
        seeds=3,
        overrides={"train.num_steps": STEPS, "train.eval_every": STEPS},
        runs=tuple(
            Run(
                run_name(path, width, pairs),
                f"configs/mqar.py:{preset}",
                overrides={"model.model_dim": width, "data.mqar.num_pairs": pairs},
            )
            for pairs in PAIRS
            for width in WIDTHS
            for path, preset in VALUE_PATHS.items()
        ),
    )
