"""Sweeps: named runs x seeds -> workdirs -> an existing engine.

A sweep file (configs/sweeps/<name>.py) defines `get_sweep() -> Sweep`: the runs (a name, a
config such as 'configs/ablations.py:d12_bov', per-run overrides and the paper's numbers for
that row), the baseline the report pairs every run with, the default number of seeds and the
table layout. Expanding it gives one `Job` per (run, seed): the workdir ROOT/<run>/seed<k>/ and
the exact `python -m bov_jax.main` command line, with `--config.seed=k` so that the seed
changes the model init and the data order. The engines only receive those command lines:

  local   runs them one after another on this machine (a finished run is skipped, an
          interrupted one resumes from its checkpoint, a failed one does not stop the rest,
          one whose workdir another run holds is not started); the trainer gets the sweep's
          SIGTERM / SIGINT and dies with it (kill -9 included), checkpointing first;
  slurm   writes ROOT/slurm_array.sbatch, one array task per job, each task running
          launch/slurm.sbatch (requeue until finished, as for a single run);
  tpu     writes ROOT/tpu_commands.sh, one launch/tpu_pod.sh command per job.

ROOT/sweep.json records the expanded sweep for the report (bov_jax.report.markdown).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bov_jax.errors import UserError
from bov_jax.files import write_json_atomic, write_text_atomic
from bov_jax.sweep.config_files import apply_override, load_config, load_python_file
from bov_jax.train import workdir_lock

LAYOUTS = ("table1", "d24", "fig5b", "plain")
LAUNCHERS = ("local", "slurm", "tpu")
REPO = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


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


def die_with(parent: int) -> None:
    """In a child before exec (Linux): SIGTERM when the sweep (`parent`) dies, even by kill -9,
    so that the trainer checkpoints and ends instead of running on as an orphan."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the sweep died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)


def run_child(command: list[str]) -> tuple[int, str | None]:
    """Run one job to its end: (exit status, the signal that stopped the sweep, if any).

    The child runs in its own process group, so a terminal's Ctrl-C reaches it once, through
    the sweep: SIGTERM / SIGINT to the sweep are forwarded to it, and the sweep waits for it
    to checkpoint and exit.
    """
    parent = os.getpid()
    child = subprocess.Popen(
        command, cwd=REPO, process_group=0, preexec_fn=lambda: die_with(parent)
    )
    received: list[str] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait(), (received[0] if received else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_local(jobs: Sequence[Job], log=print) -> list[Job]:
    """Run each unfinished job to its end, one after another; returns the failed ones.

    A job whose workdir another run holds (an earlier sweep's trainer still running) is not
    started. A SIGTERM / SIGINT stops the sweep after the running job has checkpointed.
    """
    failed = []
    for i, job in enumerate(jobs):
        label = f"[{i + 1}/{len(jobs)}] {job.run.name} seed {job.seed}"
        if job.finished():
            log(f"{label}: finished, skipped")
            continue
        busy = workdir_lock.holder(job.workdir)
        if busy:
            log(f"{label}: {job.workdir} is in use by another run ({busy}); not started")
            failed.append(job)
            continue
        log(f"{label}: {shlex.join(job.command())}")
        job.workdir.mkdir(parents=True, exist_ok=True)
        code, stopped_by = run_child(job.command())
        if stopped_by:
            log(f"{label}: stopped by {stopped_by} (status {code}); rerun the sweep to resume it")
            failed.extend(jobs[i:])
            break
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
# Submit from the repository root (resources as in launch/slurm.sbatch; override on the command
# line, e.g. sbatch --nodes=1 --gpus-per-node=8 --ntasks-per-node=8 {script}).
# Every task runs launch/slurm.sbatch for its workdir, which requeues it until it is finished.
#SBATCH --job-name=bov-{name}
#SBATCH --array=0-{last}
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={root}/slurm-%A_%a.out
set -euo pipefail
"""


def slurm_script(sweep: Sweep, root: Path, jobs: Sequence[Job], invocation: str) -> str:
    """A job-array script: task i exports WORKDIR/CONFIG of job i and runs launch/slurm.sbatch."""
    script = root / "slurm_array.sbatch"
    text = SLURM_HEADER.format(
        name=sweep.name,
        count=len(jobs),
        invocation=invocation,
        script=script,
        last=len(jobs) - 1,
        root=root,
    )
    workdirs = " ".join(shlex.quote(str(job.workdir)) for job in jobs)
    configs = " ".join(shlex.quote(job.run.config) for job in jobs)
    flags = " ".join(shlex.quote(shlex.join(job.main_flags())) for job in jobs)
    return text + (
        f"REPO=${{REPO:-{shlex.quote(str(REPO))}}}\n"
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
    """One launch/tpu_pod.sh command per job (run them one at a time on the slice: `run`
    starts a job in the background; `status` tells when its status.json is finished)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# Sweep {sweep.name}: {len(jobs)} jobs for launch/tpu_pod.sh. Generated by",
        f"#   {invocation}",
        "# With TPU_NAME and ZONE set, run one line at a time: each starts a job on every",
        "# worker; wait for `launch/tpu_pod.sh status` to show it finished before the next.",
        "set -euo pipefail",
    ]
    for job in jobs:
        env = f"WORKDIR={shlex.quote(str(job.workdir))} CONFIG={shlex.quote(job.run.config)}"
        lines.append(f"{env} launch/tpu_pod.sh run {shlex.join(job.main_flags())}")
    return "\n".join(lines) + "\n"


def write_executable(path: Path, text: str) -> None:
    write_text_atomic(path, text)
    path.chmod(0o755)
