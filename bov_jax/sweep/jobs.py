"""Sweeps: named runs x seeds -> workdirs -> an existing engine.

A sweep file (configs/sweeps/<name>.py) defines `get_sweep() -> Sweep`: the runs (a name, a
config such as 'configs/ablations.py:d12_bov', per-run overrides and the paper's numbers for
that row), the baseline the report pairs every run with, the default number of seeds and the
table layout. Expanding it gives one `Job` per (run, seed): the workdir ROOT/<run>/seed<k>/ and
the exact `python -m bov_jax.main` command line, with `--config.seed=k` so that the seed
changes the model init and the data order. The engines only receive those command lines:

  local   runs them on this machine, one after another or --parallel=N at a time, each
          pinned to its share of the CPUs (a finished run is skipped, an interrupted one
          resumes from its checkpoint, a failed one does not stop the rest, one whose
          workdir another run holds is not started); the trainers get the sweep's SIGTERM /
          SIGINT and die with it (kill -9 included), checkpointing first;
  slurm   writes ROOT/slurm_array.sbatch, one array task per job, each task running
          launch/slurm.sbatch of the checkout it is submitted from (requeue until finished, as
          for a single run);
  tpu     writes ROOT/tpu_commands.sh, the jobs one after another through launch/tpu_pod.sh.

ROOT/sweep.json records what ran for the report (bov_jax.report.markdown): the runs selected
by every invocation so far, each workdir's horizon and overrides, and the title with both.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bov_jax.config import load_config_file, load_python_file, validate_config
from bov_jax.errors import UserError
from bov_jax.files import write_json_atomic, write_text_atomic
from bov_jax.sweep.config_files import apply_override
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
    overrides: tuple[str, ...]  # 'key=value' once a key: the sweep's, the run's, the CLI's
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


def merge_overrides(items: Sequence[str]) -> tuple[str, ...]:
    """'key=value' items with each key once: the last value given, at the key's first place
    (a --override of a key the sweep sets replaces it, in the command line and the record)."""
    merged: dict[str, str] = {}
    for item in items:
        merged[item.partition("=")[0]] = item
    return tuple(merged.values())


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

    if seeds < 1:
        raise UserError(f"--seeds={seeds}; expected at least 1")
    jobs = []
    for run in select_runs(sweep, only):
        base = [as_override(k, v) for k, v in {**sweep.overrides, **run.overrides}.items()]
        for seed in range(seeds):
            overrides = merge_overrides([*base, *extra_overrides, f"seed={seed}"])
            config = load_config_file(in_repo(run.config))
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


def invocation_record(only: Sequence[str], seeds: int, overrides: Sequence[str]) -> dict:
    """What one sweep command selected: --only (empty: every run), --seeds and --override."""
    return {"only": list(only), "seeds": seeds, "overrides": list(overrides)}


def job_record(job: Job) -> dict[str, Any]:
    """One workdir's plan as sweep.json keeps it: its horizon and its exact overrides."""
    return {
        "num_steps": job.num_steps,
        "total_batch_tokens": job.total_batch_tokens,
        "total_flops": job.total_flops,
        "overrides": list(job.overrides),
    }


def span(values: Sequence[Any], fmt: Callable[[Any], str]) -> str:
    """fmt of the one value, or 'fmt(min)-fmt(max)' when they differ once formatted."""
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}-{high}"


def short_float(x: float) -> str:
    """1.5e+18 -> '1.5e18' (two significant digits)."""
    return f"{x:.2g}".replace("e+", "e")


def horizon(jobs: Sequence[dict[str, Any]]) -> str:
    """'120 steps of 4,096 tokens, 4.7e12 FLOPs' over job records (ranges where they differ)."""
    steps = span([j["num_steps"] for j in jobs], "{:,}".format)
    tokens = span([j["total_batch_tokens"] for j in jobs], "{:,}".format)
    flops = span([j["total_flops"] for j in jobs], short_float)
    return f"{steps} steps of {tokens} tokens, {flops} FLOPs"


def record_title(sweep: Sweep, runs: Sequence[dict[str, Any]], invocations: Sequence[dict]) -> str:
    """The sweep's title with what ran: the horizon, the runs x seeds, every --override."""
    jobs = [job for run in runs for job in run["jobs"].values()]
    title = f"{sweep.title}, {horizon(jobs)}" if jobs else sweep.title
    counts = sorted({len(run["workdirs"]) for run in runs})
    seeds = span(counts, str) + (" seed" if counts == [1] else " seeds")
    selected = (
        f"{len(runs)}" if len(runs) == len(sweep.runs) else f"{len(runs)} of {len(sweep.runs)}"
    )
    parts = [title, f"{selected} runs x {seeds}"]
    overrides = list(dict.fromkeys(o for inv in invocations for o in inv["overrides"]))
    if overrides:
        parts.append(f"override {', '.join(overrides)}")
    return "; ".join(parts)


def by_seed(entries: dict[str, Any]) -> dict[str, Any]:
    """{"10": .., "2": ..} -> in seed order {"2": .., "10": ..}."""
    return dict(sorted(entries.items(), key=lambda kv: int(kv[0])))


def sweep_record(
    sweep: Sweep, root: Path, jobs: Sequence[Job], invocation: dict[str, Any]
) -> dict[str, Any]:
    """ROOT/sweep.json: the runs that have workdirs (this invocation's and earlier ones'), each
    workdir's horizon and overrides, every invocation, and the runs no invocation selected."""
    previous = {}
    if (root / "sweep.json").exists():
        try:
            previous = json.loads((root / "sweep.json").read_text())
        except ValueError:
            previous = {}
    old = {r["name"]: r for r in previous.get("runs", [])}
    invocations = [i for i in previous.get("invocations", []) if i != invocation] + [invocation]
    runs, left_out = [], []
    for run in sweep.runs:
        workdirs = dict(old.get(run.name, {}).get("workdirs", {}))
        planned = dict(old.get(run.name, {}).get("jobs", {}))
        for job in jobs:
            if job.run.name == run.name:
                workdirs[str(job.seed)] = str(job.workdir.relative_to(root))
                planned[str(job.seed)] = job_record(job)
        if not workdirs:
            left_out.append(run.name)
            continue
        runs.append(
            {
                "name": run.name,
                "config": run.config,
                "paper": run.paper,
                "workdirs": by_seed(workdirs),
                "jobs": by_seed(planned),
            }
        )
    seeds = sorted({int(s) for run in runs for s in run["workdirs"]})
    return {
        "sweep": sweep.name,
        "title": record_title(sweep, runs, invocations),
        "layout": sweep.layout,
        "baseline": sweep.baseline,
        "seeds": seeds,
        "invocations": invocations,
        "runs": runs,
        "left_out": left_out,
    }


def write_sweep_record(
    sweep: Sweep, root: Path, jobs: Sequence[Job], invocation: dict[str, Any]
) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    record = sweep_record(sweep, root, jobs, invocation)
    write_json_atomic(root / "sweep.json", record)
    return record


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


def cpu_slots(parallel: int) -> list[set[int]]:
    """This process's CPUs dealt into `parallel` contiguous groups, one per concurrent job."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= parallel <= len(cpus):
        raise UserError(
            f"--parallel={parallel}: expected 1 to {len(cpus)}, the CPUs this process may use"
        )
    share, extra = divmod(len(cpus), parallel)
    bounds = [i * share + min(i, extra) for i in range(parallel + 1)]
    return [set(cpus[a:b]) for a, b in zip(bounds, bounds[1:])]


def start_child(command: list[str], cpus: set[int] | None, log_path: Path | None):
    """Start one job in its own process group (a terminal's Ctrl-C reaches it once, through the
    sweep), pinned to `cpus` when given, its output appended to `log_path` when given."""
    parent = os.getpid()

    def prepare() -> None:
        die_with(parent)
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") if log_path else contextlib.nullcontext() as output:
        return subprocess.Popen(
            command,
            cwd=REPO,
            process_group=0,
            preexec_fn=prepare,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
        )


def run_local(jobs: Sequence[Job], log=print, parallel: int = 1) -> list[Job]:
    """Run each unfinished job to its end, `parallel` at a time; returns the failed ones.

    With parallel > 1 each running job is pinned to its own share of this process's CPUs
    (small models train faster two at a time on one core each than one at a time on two) and
    writes its output to <workdir>/train.log. A job whose workdir another run holds (an
    earlier sweep's trainer still running) is not started. A SIGTERM / SIGINT to the sweep is
    forwarded to every running job; the sweep waits for them to checkpoint, starts no more
    and returns them with the jobs it did not start.
    """
    slots = cpu_slots(parallel) if parallel > 1 else [None]
    running: dict[subprocess.Popen, tuple[int, str, Job, set[int] | None, Path | None]] = {}
    received: list[str] = []
    failed: list[tuple[int, Job]] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        for child in running:
            child.send_signal(signum)

    def reap() -> None:
        """Wait for a running job to end; collect every one that has, freeing its CPUs."""
        while not (ended := [child for child in running if child.poll() is not None]):
            time.sleep(0.1)
        for child in ended:
            i, label, job, cpus, log_path = running.pop(child)
            slots.append(cpus)
            status = child.returncode
            if received:
                log(
                    f"{label}: stopped by {received[0]} (status {status}); "
                    "rerun the sweep to resume it"
                )
                failed.append((i, job))
            elif status != 0 or not job.finished():
                log(
                    f"{label}: exited with status {status} before its horizon "
                    f"(log {log_path or 'above'}); "
                    "rerun the sweep to resume it"
                )
                failed.append((i, job))
            elif log_path:
                log(f"{label}: finished")

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, job in enumerate(jobs):
            label = f"[{i + 1}/{len(jobs)}] {job.run.name} seed {job.seed}"
            while not slots and not received:
                reap()
            if received:
                failed.extend((k, jobs[k]) for k in range(i, len(jobs)))
                break
            if job.finished():
                log(f"{label}: finished, skipped")
                continue
            busy = workdir_lock.holder(job.workdir)
            if busy:
                log(f"{label}: {job.workdir} is in use by another run ({busy}); not started")
                failed.append((i, job))
                continue
            job.workdir.mkdir(parents=True, exist_ok=True)
            cpus = slots.pop()
            log_path = job.workdir / "train.log" if cpus else None
            where = f" (CPUs {sorted(cpus)}, log {log_path})" if cpus else ""
            log(f"{label}: {shlex.join(job.command())}{where}")
            running[start_child(job.command(), cpus, log_path)] = (i, label, job, cpus, log_path)
        while running:
            reap()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return [job for _, job in sorted(failed, key=lambda item: item[0])]


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
