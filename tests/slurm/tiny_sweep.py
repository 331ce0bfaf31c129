"""A sweep of one run and two seeds for tests/test_slurm.py: the quickstart config, made tiny
by the test's --override flags (test_resume's model)."""

from bov_jax.sweep.jobs import Run, Sweep


def get_sweep() -> Sweep:
    return Sweep(
        name="tiny",
        title="tests/test_slurm.py: the slurm launcher's job array",
        runs=(Run("tiny", "configs/quickstart.py"),),
        baseline="tiny",
        seeds=2,
    )
