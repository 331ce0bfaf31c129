"""Sweeps: named runs x seeds -> workdirs -> an existing engine.

A sweep file (configs/sweeps/<name>.py) defines `get_sweep() -> Sweep`: the runs (a name, a
config such as 'configs/ablations.py:d12_bov', per-run overrides and the paper's numbers for
that row), the baseline the report pairs every run with, the default number of seeds and the
table layout. Expanding it gives one `Job` per (run, seed): the workdir ROOT/<run>/seed<k>/ and
the exact `python -m bov_jax.main` command line, with `--config.seed=k` so that the seed
changes the model init and the data order. The engines only receive those command lines:

  local   runs them one after another on this machine (a finished run is skipped, an
          interrupted one resumes from its checkpoint, a failed one does not stop the rest);
  slurm   writes ROOT/slurm_array.sbatch, one array task per job, each task running
          launch/slurm.sbatch of the checkout it is submitted from (requeue until finished, as
          for a single run);
  tpu     writes ROOT/tpu_commands.sh, the jobs one after another through launch/tpu_pod.sh.

ROOT/sweep.json records the expanded sweep for the report (bov_jax.experiments.report).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bov_jax.cli import UserError
from bov_jax.experiments.configs import apply_override, load_config, load_python_file
from bov_jax.files import write_json_atomic, write_text_atomic

LAYOUTS = ("table1", "d24", "fig5b", "plain")
LAUNCHERS = ("local", "slurm", "tpu")
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of a sweep: `config` is 'path.py[:arg]' relative to the repository root."""

    name: str
    config: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    paper: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    title: str
    runs: tuple[Run, ...]
    baseline: str
    seeds: int = 1
    layout: str = "plain"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        names = [run.name for run in self.runs]
        if len(set(names)) != len(names):
            raise UserError(f"sweep {self.name}: run names repeat: {names}")
        if self.baseline not in names:
            raise UserError(f"sweep {self.name}: baseline {self.baseline!r} is not one of its runs")
        if self.layout not in LAYOUTS:
            raise UserError(f"sweep {self.name}: layout {self.layout!r}; expected one of {LAYOUTS}")


@dataclasses.dataclass(frozen=True)
class Job:
    """One (run, seed): its workdir, its resolved plan and its command line."""

    run: Run
    seed: int
    workdir: Path
    overrides: tuple[str, ...]  # 'key=value', the sweep's then the run's then the CLI's
    num_steps: int
    total_batch_tokens: int
    flops_per_token: int

    @property
    def total_flops(self) -> float:
        return float(self.num_steps) * self.total_batch_tokens * self.flops_per_token

    def main_flags(self) -> list[str]:
        """The bov_jax.main flags after --config and --workdir."""
        return [f"--config.{item}" for item in self.overrides]

    def command(self, python: str = sys.executable) -> list[str]:
        return [
            python,
            "-m",
            "bov_jax.main",
            f"--config={in_repo(self.run.config)}",
            f"--workdir={self.workdir}",
            *self.main_flags(),
        ]

    def finished(self) -> bool:
        """Whether the workdir's status.json says the run reached its horizon."""
        try:
            status = json.loads((self.workdir / "status.json").read_text())
            return status["step"] >= status["num_steps"]
        except (OSError, ValueError, KeyError, TypeError):
            return False


def in_repo(config: str) -> str:
    """'configs/x.py:arg' with the file made absolute against the repository root."""
    path, sep, arg = config.partition(":")
    return f"{REPO / path}{sep}{arg}"


def load_sweep(path: str | Path) -> Sweep:
    module = load_python_file(path, "sweep file")
    if not hasattr(module, "get_sweep"):
        raise UserError(f"sweep file {path} has no get_sweep()")
    sweep = module.get_sweep()
    if not isinstance(sweep, Sweep):
        raise UserError(f"sweep file {path}: get_sweep() must return a Sweep")
    return sweep


def select_runs(sweep: Sweep, only: Sequence[str]) -> tuple[Run, ...]:
    names = [run.name for run in sweep.runs]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise UserError(
            f"--only: no run named {', '.join(unknown)} in sweep {sweep.name} "
            f"(runs: {', '.join(names)})"
        )
    return tuple(run for run in sweep.runs if not only or run.name in only)


def as_override(key: str, value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def expand(
    sweep: Sweep,
    root: Path,
    seeds: int,
    only: Sequence[str] = (),
    extra_overrides: Sequence[str] = (),
) -> list[Job]:
    """Every (run, seed) job, run-major; each config is built and validated here, so a bad run
    fails before anything is launched."""
    from bov_jax.accounting import training_plan
    from bov_jax.config import validate_config

    if seeds < 1:
        raise UserError(f"--seeds={seeds}; expected at least 1")
    jobs = []
    for run in select_runs(sweep, only):
        base = [as_override(k, v) for k, v in {**sweep.overrides, **run.overrides}.items()]
        for seed in range(seeds):
            overrides = (*base, *extra_overrides, f"seed={seed}")
            config = load_config(in_repo(run.config))
            for item in overrides:
                apply_override(config, item)
            try:
                validate_config(config)
                plan = training_plan(config)
            except ValueError as err:
                raise UserError(f"run {run.name} (seed {seed}): {err}") from err
            jobs.append(
                Job(
                    run,
                    seed,
                    root / run.name / f"seed{seed}",
                    tuple(overrides),
                    plan.num_steps,
                    plan.total_batch_tokens,
                    plan.flops_per_token,
                )
            )
    return jobs


def sweep_record(sweep: Sweep, root: Path, jobs: Sequence[Job]) -> dict[str, Any]:
    """ROOT/sweep.json: the whole sweep (every run, run or not) and the workdirs made so far."""
    previous = {}
    if (root / "sweep.json").exists():
        try:
            previous = json.loads((root / "sweep.json").read_text())
        except ValueError:
            previous = {}
    old_workdirs = {r["name"]: r.get("workdirs", {}) for r in previous.get("runs", [])}
    seeds = sorted(set(previous.get("seeds", [])) | {job.seed for job in jobs})
    runs = []
    for run in sweep.runs:
        workdirs = dict(old_workdirs.get(run.name, {}))
        for job in jobs:
            if job.run.name == run.name:
                workdirs[str(job.seed)] = str(job.workdir.relative_to(root))
        runs.append(
            {
                "name": run.name,
                "config": run.config,
                "overrides": {**sweep.overrides, **run.overrides},
                "paper": run.paper,
                "workdirs": dict(sorted(workdirs.items(), key=lambda kv: int(kv[0]))),
            }
        )
    return {
        "sweep": sweep.name,
        "title": sweep.title,
        "layout": sweep.layout,
        "baseline": sweep.baseline,
        "seeds": seeds,
        "runs": runs,
    }


def write_sweep_record(sweep: Sweep, root: Path, jobs: Sequence[Job]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / "sweep.json", sweep_record(sweep, root, jobs))


def describe(jobs: Sequence[Job]) -> str:
    """The dry-run table: one line per job with its horizon and FLOPs."""
    lines = [
        f"{'run':22} {'seed':>4} {'steps':>8} {'batch tokens':>13} {'FLOPs/token':>14} "
        f"{'total FLOPs':>11}  workdir"
    ]
    for job in jobs:
        lines.append(
            f"{job.run.name:22} {job.seed:>4} {job.num_steps:>8,} "
            f"{job.total_batch_tokens:>13,} {job.flops_per_token:>14,} "
            f"{job.total_flops:>11.3e}  {job.workdir}"
        )
    return "\n".join(lines)


def run_local(jobs: Sequence[Job], log=print) -> list[Job]:
    """Run each unfinished job to its end, one after another; returns the failed ones."""
    failed = []
    for i, job in enumerate(jobs):
        label = f"[{i + 1}/{len(jobs)}] {job.run.name} seed {job.seed}"
        if job.finished():
            log(f"{label}: finished, skipped")
            continue
        log(f"{label}: {shlex.join(job.command())}")
        job.workdir.mkdir(parents=True, exist_ok=True)
        code = subprocess.call(job.command(), cwd=REPO)
        if code != 0 or not job.finished():
            log(
                f"{label}: exited with status {code} before its horizon (log above); "
                "rerun the sweep to resume it"
            )
            failed.append(job)
    return failed


SLURM_HEADER = """#!/usr/bin/env bash
# Sweep {name}: {count} jobs (runs x seeds), one SLURM array task each. Generated by
#   {invocation}
# Submit from the repository root, or export REPO=<checkout> (on a filesystem the nodes see).
# Resources as in launch/slurm.sbatch; change them with the sweep's --sbatch=OPTION flags or on
# the command line, e.g. sbatch --account=A --partition=P {script}. Settings of
# launch/slurm.sbatch (MODE, PYTHON, VENV, MAX_RESTARTS) pass through the environment.
# Every task runs launch/slurm.sbatch for its workdir, which requeues it until it is finished.
"""

# The array's resources: launch/slurm.sbatch's for one node (name -> value, None for a switch).
SLURM_OPTIONS = {
    "nodes": "1",
    "gpus-per-node": "8",
    "ntasks-per-node": "8",
    "cpus-per-task": "8",
    "exclusive": None,
    "time": "24:00:00",
    "signal": "TERM@300",
    "requeue": None,
    "open-mode": "append",
}


def sbatch_options(root: Path, name: str, count: int, extra: Sequence[str]) -> dict[str, Any]:
    """SLURM_OPTIONS with the array's name, tasks and output, then `extra` ('--account=A',
    '--gpus-per-node=4', '--exclusive'): each replaces the option of its name or is added."""
    options = {
        "job-name": f"bov-{name}",
        "array": f"0-{count - 1}",
        **SLURM_OPTIONS,
        "output": f"{root}/slurm-%A_%a.out",
    }
    for option in extra:
        key, sep, value = option.partition("=")
        if not key.startswith("--") or len(key) < 3 or key[2:] == "array":
            raise UserError(
                f"--sbatch={option}: expected an sbatch option such as --account=NAME or "
                "--gpus-per-node=4 (the array itself is fixed)"
            )
        options[key[2:]] = value if sep else None
    return options


def slurm_script(
    sweep: Sweep, root: Path, jobs: Sequence[Job], invocation: str, extra: Sequence[str] = ()
) -> str:
    """A job-array script: task i exports WORKDIR/CONFIG of job i and runs launch/slurm.sbatch
    of the checkout in REPO (default: the submit directory)."""
    script = root / "slurm_array.sbatch"
    text = SLURM_HEADER.format(
        name=sweep.name, count=len(jobs), invocation=invocation, script=script
    )
    for key, value in sbatch_options(root, sweep.name, len(jobs), extra).items():
        text += f"#SBATCH --{key}" + ("" if value is None else f"={value}") + "\n"
    workdirs = " ".join(shlex.quote(str(job.workdir)) for job in jobs)
    configs = " ".join(shlex.quote(job.run.config) for job in jobs)
    flags = " ".join(shlex.quote(shlex.join(job.main_flags())) for job in jobs)
    return text + (
        "set -euo pipefail\n"
        "REPO=${REPO:-${SLURM_SUBMIT_DIR:-$PWD}}\n"
        "if [[ ! -f $REPO/launch/slurm.sbatch ]]; then\n"
        '  echo "error: REPO=$REPO is not a bov_jax checkout (no launch/slurm.sbatch): submit"'
        ' "from the repository root or export REPO=<checkout>" >&2\n'
        "  exit 2\n"
        "fi\n"
        f"workdirs=({workdirs})\n"
        f"configs=({configs})\n"
        f"flags=({flags})\n"
        "i=${SLURM_ARRAY_TASK_ID:?submit with sbatch (an array task)}\n"
        'mkdir -p "${workdirs[i]}"\n'
        'export REPO WORKDIR="${workdirs[i]}" CONFIG="${configs[i]}"\n'
        'eval "set -- ${flags[i]}"\n'
        'exec bash "$REPO/launch/slurm.sbatch" "$@"\n'
    )


def tpu_commands(sweep: Sweep, jobs: Sequence[Job], invocation: str) -> str:
    """The jobs one after another on the slice: launch/tpu_pod.sh `run` starts a job on every
    worker and returns; `wait` returns when it has ended everywhere (status 1 before its
    horizon, which stops the script)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# Sweep {sweep.name}: {len(jobs)} jobs for launch/tpu_pod.sh, one after another."
        " Generated by",
        f"#   {invocation}",
        "# Run it from the repository root with TPU_NAME and ZONE set, once the slice is synced",
        "# and installed. A job that stops before its horizon stops the script; run it again to",
        "# resume (a finished job ends at once).",
        "set -euo pipefail",
        "job() {",
        "  local workdir=$1 config=$2",
        "  shift 2",
        '  WORKDIR=$workdir CONFIG=$config launch/tpu_pod.sh run "$@"',
        "  WORKDIR=$workdir launch/tpu_pod.sh wait",
        "}",
    ]
    for job in jobs:
        args = [str(job.workdir), job.run.config, *job.main_flags()]
        lines.append(f"job {shlex.join(args)}")
    return "\n".join(lines) + "\n"


def write_executable(path: Path, text: str) -> None:
    write_text_atomic(path, text)
    path.chmod(0o755)
