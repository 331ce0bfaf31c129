"""python -m bov_jax.sweep --sweep=configs/sweeps/<name>.py --root=DIR [options]

Expands a sweep file into runs x seeds (workdirs DIR/<run>/seed<k>/) and hands them to an
engine: --launcher=local (here, one after another or --parallel=N at a time; rerunning skips
finished runs and resumes interrupted ones), slurm (writes DIR/slurm_array.sbatch) or tpu
(writes DIR/tpu_commands.sh). --dry-run prints every run's horizon and FLOPs and launches
nothing. Then `python -m bov_jax.report --root=DIR` writes the tables and figures.

Exit status: 0 when every job finished, 1 when some did not (stopped by a SIGTERM / SIGINT to
the sweep, or failed; rerunning resumes them), 2 for a bad flag or sweep file.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

from absl import flags

from bov_jax import cli
from bov_jax.errors import UserError
from bov_jax.sweep import jobs as sweeps

FLAGS = flags.FLAGS


class UnfinishedJobs(UserError):
    """Jobs stopped (a SIGTERM to the sweep) or failed before their horizon: an outcome, not a
    bad input, so exit status 1 (docs/reliability.md); rerunning the sweep resumes them."""

    exit_status = 1


def define_flags() -> None:
    """The command's flags (defined on use: other entry points also have a --root)."""
    flags.DEFINE_string("sweep", None, "Sweep file, e.g. configs/sweeps/table1.py.")
    flags.DEFINE_string("root", None, "Directory of the sweep: DIR/<run>/seed<k>/ per job.")
    flags.DEFINE_integer("seeds", None, "Seeds per run (0..N-1); default: the sweep file's.")
    flags.DEFINE_list("only", [], "Run only these runs (comma-separated run names).")
    flags.DEFINE_multi_string(
        "override", [], "key=value applied to every run, e.g. train.num_steps=20 (repeatable)."
    )
    flags.DEFINE_enum("launcher", "local", sweeps.LAUNCHERS, "Engine that runs the jobs.")
    flags.DEFINE_multi_string(
        "sbatch",
        [],
        "slurm launcher: an sbatch option for the array, e.g. --sbatch=--account=A "
        "--sbatch=--partition=P --sbatch=--gpus-per-node=4 (repeatable; replaces the default "
        "of the same name).",
    )
    flags.DEFINE_integer(
        "parallel",
        1,
        "local launcher: jobs at once, each pinned to its share of this machine's CPUs, its "
        "output in <workdir>/train.log (on 2 cores, 2 small jobs finish in about the time of 1).",
    )
    flags.DEFINE_bool("dry_run", False, "Print the jobs, their horizons and FLOPs; run nothing.")
    flags.DEFINE_alias("dry-run", "dry_run")
    flags.mark_flags_as_required(["sweep", "root"])


def main(argv: list[str]) -> None:
    if FLAGS.sbatch and FLAGS.launcher != "slurm":
        raise UserError("--sbatch applies to --launcher=slurm only")
    if FLAGS.parallel != 1 and FLAGS.launcher != "local":
        raise UserError("--parallel applies to --launcher=local only")
    logging.getLogger("jax").setLevel(logging.WARNING)  # no backend-probing chatter
    sweep = sweeps.load_sweep(FLAGS.sweep)
    root = Path(FLAGS.root).resolve()
    seeds = sweep.seeds if FLAGS.seeds is None else FLAGS.seeds
    jobs = sweeps.expand(sweep, root, seeds, FLAGS.only, FLAGS.override)
    print(f"sweep {sweep.name}: {sweep.title}")
    print(sweeps.describe(jobs))
    if FLAGS.dry_run:
        return
    selection = sweeps.invocation_record(FLAGS.only, seeds, FLAGS.override)
    record = sweeps.write_sweep_record(sweep, root, jobs, selection)
    print(f"recorded in {root / 'sweep.json'}: {record['title']}")
    invocation = shlex.join(["python", "-m", "bov_jax.sweep", *sys.argv[1:]])
    if FLAGS.launcher == "slurm":
        path = root / "slurm_array.sbatch"
        script = sweeps.slurm_script(sweep, root, jobs, invocation, FLAGS.sbatch)
        sweeps.write_executable(path, script)
        print(f"wrote {path}: submit it with `sbatch {path}` from the repository root")
    elif FLAGS.launcher == "tpu":
        path = root / "tpu_commands.sh"
        sweeps.write_executable(path, sweeps.tpu_commands(sweep, jobs, invocation))
        print(f"wrote {path}: run it from the repository root (its jobs run one after another)")
    else:
        failed = sweeps.run_local(jobs, parallel=FLAGS.parallel)
        if failed:
            names = ", ".join(f"{job.run.name}/seed{job.seed}" for job in failed)
            raise UnfinishedJobs(f"{len(failed)} of {len(jobs)} jobs did not finish: {names}")
        report = f"python -m bov_jax.report --root={FLAGS.root}"
        print(f"all {len(jobs)} jobs finished; report: {report}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
