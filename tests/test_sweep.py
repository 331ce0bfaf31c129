"""Sweeps: expansion into jobs, the paper's horizons, the engines' scripts, skipping finished
runs, and overrides read like --config flags."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bov_jax.config import load_config_file
from bov_jax.errors import UserError
from bov_jax.sweep import jobs as sweeps
from bov_jax.sweep.config_files import apply_override

REPO = Path(__file__).resolve().parents[1]


def jobs_of(name: str, root: Path, **kwargs) -> list[sweeps.Job]:
    sweep = sweeps.load_sweep(REPO / "configs" / "sweeps" / f"{name}.py")
    return sweeps.expand(sweep, root, kwargs.pop("seeds", sweep.seeds), **kwargs)


def steps_by_run(jobs: list[sweeps.Job]) -> dict[str, int]:
    return {job.run.name: job.num_steps for job in jobs}


def test_paper_horizons(tmp_path):
    table1 = steps_by_run(jobs_of("table1", tmp_path))
    assert (table1["d12"], table1["d12_bov"]) == (3766, 3838)
    assert len(table1) == 14
    table3 = steps_by_run(jobs_of("table3", tmp_path))
    assert (table3["d24"], table3["d24_bov"]) == (7809, 7998)
    assert set(steps_by_run(jobs_of("table2", tmp_path)).values()) == {95367}
    assert len(jobs_of("fig5b", tmp_path)) == 5


def test_d24_ablation_presets_default_to_the_paper_budget(tmp_path):
    """Only d24 and d24_bov default to 100B tokens; the ablation rows to 3.91e19 FLOPs."""
    from bov_jax.accounting import training_plan
    from bov_jax.presets import config_for

    assert training_plan(config_for("d24_bov")).num_steps == 95367
    assert training_plan(config_for("d24_x0_learn")).num_steps == 7809
    assert config_for("d24_v1_every_layer").train.eval_every == 50


def test_seeds_workdirs_and_commands(tmp_path):
    jobs = jobs_of(
        "table1_cpu",
        tmp_path,
        seeds=2,
        only=["d12", "d12_bov"],
        extra_overrides=["train.num_steps=6"],
    )
    assert [(j.run.name, j.seed) for j in jobs] == [
        ("d12", 0),
        ("d12", 1),
        ("d12_bov", 0),
        ("d12_bov", 1),
    ]
    assert jobs[1].workdir == tmp_path / "d12" / "seed1"
    assert all(j.num_steps == 6 for j in jobs)
    command = jobs[1].command()
    assert "--config.seed=1" in command and "--config.train.num_steps=6" in command
    assert command[3].endswith("configs/quickstart.py:d12")


def test_unknown_run_and_key_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no run named d13"):
        jobs_of("table1_cpu", tmp_path, only=["d13"])
    with pytest.raises(UserError, match="did you mean train.num_steps"):
        jobs_of("table1_cpu", tmp_path, only=["d12"], extra_overrides=["train.num_stepz=3"])


def test_overrides_take_the_type_of_the_default():
    config = load_config_file(str(REPO / "configs/quickstart.py:d12"))
    assert apply_override(config, "train.target_flops=3.91e19") == ("train.target_flops", 3.91e19)
    assert apply_override(config, "train.skip_nonfinite=true")[1] is True
    assert apply_override(config, "optim.embedding_betas=(0.9, 0.99)")[1] == (0.9, 0.99)
    with pytest.raises(UserError, match="train.num_steps=abc"):
        apply_override(config, "train.num_steps=abc")


def run_probe(text: str, **env: str) -> subprocess.CompletedProcess:
    """The array script with its last line (the exec of launch/slurm.sbatch) printing REPO,
    WORKDIR and the arguments instead."""
    probe = text.replace(
        'exec bash "$REPO/launch/slurm.sbatch" "$@"',
        'echo "$REPO"; echo "$WORKDIR"; printf "%s\\n" "$@"',
    )
    return subprocess.run(
        ["bash", "-c", probe], env={"PATH": "/bin:/usr/bin", **env}, capture_output=True, text=True
    )


def test_slurm_script_is_valid_bash_and_tpu_commands(tmp_path):
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table3.py")
    jobs = sweeps.expand(sweep, tmp_path, 2)
    script = tmp_path / "slurm_array.sbatch"
    sweeps.write_executable(script, sweeps.slurm_script(sweep, tmp_path, jobs, "test"))
    text = script.read_text()
    assert "#SBATCH --array=0-11" in text and "launch/slurm.sbatch" in text
    assert str(REPO) not in text  # the checkout is the submit directory's, or REPO
    subprocess.run(["bash", "-n", str(script)], check=True)
    # task 5's arguments as bash sees them, submitted from the repository root
    done = run_probe(text, SLURM_ARRAY_TASK_ID="5", SLURM_SUBMIT_DIR=str(REPO))
    out = done.stdout.split()
    assert done.returncode == 0 and out[0] == str(REPO), done.stderr
    assert out[1] == str(tmp_path / "d24_x0_learn" / "seed1")
    assert "--config.train.target_flops=3.91e+19" in out and "--config.seed=1" in out
    # REPO wins over the submit directory; a directory without the launcher is refused
    moved = run_probe(text, SLURM_ARRAY_TASK_ID="0", SLURM_SUBMIT_DIR="/", REPO=str(REPO))
    assert moved.stdout.split()[0] == str(REPO)
    wrong = run_probe(text, SLURM_ARRAY_TASK_ID="0", SLURM_SUBMIT_DIR=str(tmp_path))
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.startswith(f"error: REPO={tmp_path} is not a bov_jax checkout")
    tpu = sweeps.tpu_commands(sweep, jobs, "test")
    assert tpu.count("\njob ") == 12 and "launch/tpu_pod.sh wait" in tpu
    subprocess.run(["bash", "-n", "-c", tpu], check=True)


def record_of(sweep: sweeps.Sweep, root: Path, seeds: int, only: list, overrides=()) -> dict:
    jobs = sweeps.expand(sweep, root, seeds, only, overrides)
    selection = sweeps.invocation_record(only, seeds, overrides)
    return sweeps.write_sweep_record(sweep, root, jobs, selection)


def test_sweep_record_says_what_ran(tmp_path):
    """--only, --seeds and every --override reach the title and sweep.json; an override of a
    key the sweep sets replaces it (once in the command line); left-out runs are listed."""
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table1_cpu.py")
    record = record_of(sweep, tmp_path, 1, ["d12", "d12_bov"], ["train.num_steps=4"])
    assert record == json.loads((tmp_path / "sweep.json").read_text())
    title = record["title"]
    assert "120" not in title and "4 steps of 4,096 tokens" in title
    assert "2 of 14 runs x 1 seed" in title and title.endswith("override train.num_steps=4")
    assert [r["name"] for r in record["runs"]] == ["d12", "d12_bov"]
    assert len(record["left_out"]) == 12 and "d12_x0_learn" in record["left_out"]
    job = record["runs"][1]["jobs"]["0"]
    assert job["num_steps"] == 4 and job["total_batch_tokens"] == 4096
    assert job["overrides"] == ["train.num_steps=4", "train.eval_every=20", "seed=0"]
    assert record["invocations"] == [
        {"only": ["d12", "d12_bov"], "seeds": 1, "overrides": ["train.num_steps=4"]}
    ]
    (bov,) = sweeps.expand(sweep, tmp_path, 1, ["d12_bov"], ["train.num_steps=4"])
    assert [f for f in bov.command() if "num_steps" in f] == ["--config.train.num_steps=4"]
    full = record_of(sweep, tmp_path / "full", 1, [])
    horizon = r"\), 120 steps of 4,096 tokens, \d\.\de13-\d\.\de13 FLOPs; 14 runs x 1 seed$"
    assert re.search(horizon, full["title"]), full["title"]
    assert full["left_out"] == []


def test_slurm_options_replace_the_defaults_or_are_added(tmp_path):
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table3.py")
    jobs = sweeps.expand(sweep, tmp_path, 1, ["d24"])
    extra = ["--account=proj", "--partition=gpu", "--gpus-per-node=4", "--exclusive=user"]
    lines = sweeps.slurm_script(sweep, tmp_path, jobs, "test", extra).splitlines()
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert "#SBATCH --account=proj" in sbatch and "#SBATCH --partition=gpu" in sbatch
    assert "#SBATCH --gpus-per-node=4" in sbatch and "#SBATCH --gpus-per-node=8" not in sbatch
    assert "#SBATCH --exclusive=user" in sbatch and "#SBATCH --exclusive" not in sbatch
    assert len(sbatch) == len({line.split("=")[0] for line in sbatch})  # each option once
    for bad in ("account=proj", "--array=0-3", "--"):
        with pytest.raises(UserError, match="expected an sbatch option"):
            sweeps.slurm_script(sweep, tmp_path, jobs, "test", [bad])


def test_sweep_record_merges_invocations(tmp_path):
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table1_cpu.py")
    record_of(sweep, tmp_path, 1, ["d12"])
    record_of(sweep, tmp_path, 1, ["d12"])  # the same invocation again: recorded once
    record = record_of(sweep, tmp_path, 2, ["d12_bov"], ["train.num_steps=6"])
    assert record["baseline"] == "d12" and record["seeds"] == [0, 1]
    runs = {r["name"]: r for r in record["runs"]}
    assert list(runs) == ["d12", "d12_bov"] and runs["d12"]["paper"]["val_bpb"] == 0.854
    assert runs["d12"]["workdirs"] == {"0": "d12/seed0"}
    assert runs["d12_bov"]["workdirs"] == {"0": "d12_bov/seed0", "1": "d12_bov/seed1"}
    assert [i["only"] for i in record["invocations"]] == [["d12"], ["d12_bov"]]
    assert "6-120 steps" in record["title"] and "2 of 14 runs x 1-2 seeds" in record["title"]
    assert record["title"].endswith("override train.num_steps=6")


def test_local_launcher_skips_finished_runs(tmp_path):
    jobs = jobs_of("table1_cpu", tmp_path, seeds=1, only=["d12"])
    jobs[0].workdir.mkdir(parents=True)
    (jobs[0].workdir / "status.json").write_text(json.dumps({"step": 120, "num_steps": 120}))
    lines = []
    assert sweeps.run_local(jobs, log=lines.append) == []
    assert lines == ["[1/1] d12 seed 0: finished, skipped"]


def test_dry_run_cli(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bov_jax.sweep",
            "--sweep=configs/sweeps/table3.py",
            f"--root={tmp_path}",
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "7,809" in out and "7,998" in out
    assert not (tmp_path / "sweep.json").exists()


EXPAND_EVERY_SWEEP = """
import sys
from pathlib import Path
from jax._src import xla_bridge
from bov_jax.sweep import jobs
for path in sorted(Path("configs/sweeps").glob("*.py")):
    jobs.expand(jobs.load_sweep(path), Path(sys.argv[1]), 2)
print("backend started:", xla_bridge.backends_are_initialized())
"""


def test_planning_a_sweep_starts_no_device_backend(tmp_path):
    """The sweep's own process validates and counts every job without starting a backend: on
    a GPU node a started one would hold the memory its training jobs need."""
    out = subprocess.run(
        [sys.executable, "-c", EXPAND_EVERY_SWEEP, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "backend started: False"


# A sweep of one job whose trainer stands in for bov_jax.main: it records its PID, and on
# SIGTERM writes `stopped` (as the trainer's checkpoint) and exits 0.
TRAINER = """
import os, signal, sys, time
from pathlib import Path
workdir = Path(sys.argv[1])
def stop(signum, frame):
    (workdir / "stopped").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(workdir / "pid").write_text(str(os.getpid()))
time.sleep(120)
"""
SWEEP = """
import sys
from pathlib import Path
from bov_jax.sweep import jobs
root, trainer, parallel = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
class StandIn(jobs.Job):
    def command(self, python=sys.executable):
        return [python, "-c", trainer, str(self.workdir)]
run = jobs.Run("stand_in", "configs/quickstart.py")
stand_ins = [StandIn(run, k, root / f"seed{k}", (), 1, 1, 1) for k in range(parallel)]
print(len(jobs.run_local(stand_ins, parallel=parallel)), flush=True)
"""


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(
    "signum, parallel", [(signal.SIGTERM, 1), (signal.SIGKILL, 1), (signal.SIGTERM, 2)]
)
def test_stopping_the_sweep_leaves_no_trainer_behind(tmp_path, signum, parallel):
    """SIGTERM: forwarded to every running trainer, which checkpoints; the sweep waits for
    them. kill -9: the trainer gets SIGTERM as its parent dies (it would run on as an orphan
    otherwise)."""
    workdirs = [tmp_path / f"seed{k}" for k in range(parallel)]
    pid_files = [workdir / "pid" for workdir in workdirs]
    sweep = subprocess.Popen(
        [sys.executable, "-c", SWEEP, str(tmp_path), TRAINER, str(parallel)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = []
    try:
        assert wait_for(lambda: all(f.is_file() and f.read_text() for f in pid_files))
        pids = [int(f.read_text()) for f in pid_files]
        sweep.send_signal(signum)
        output = sweep.communicate(timeout=30)[0]
        gone = wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10)
        assert gone, "a trainer outlived the sweep"
        assert all((w / "stopped").read_text() == "SIGTERM" for w in workdirs)
        if signum == signal.SIGTERM:
            assert output.count("stopped by SIGTERM") == parallel
            assert output.splitlines()[-1] == str(parallel)
    finally:
        sweep.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# Stands in for bov_jax.main in a parallel sweep: records its CPUs, waits (30 s at most) until
# two stand-ins have started, then finishes its run, or fails when its seed is 2.
CONCURRENT_TRAINER = """
import json, os, sys, time
from pathlib import Path
workdir = Path(sys.argv[1])
(workdir / "cpus").write_text(json.dumps(sorted(os.sched_getaffinity(0))))
deadline = time.monotonic() + 30
while len(list(workdir.parent.glob("*/cpus"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
print("started with", len(list(workdir.parent.glob("*/cpus"))), "stand-ins", flush=True)
if workdir.name == "seed2":
    sys.exit(3)
(workdir / "status.json").write_text(json.dumps({"step": 1, "num_steps": 1}))
"""


class ConcurrentStandIn(sweeps.Job):
    def command(self, python: str = sys.executable) -> list[str]:
        return [python, "-c", CONCURRENT_TRAINER, str(self.workdir)]


def test_parallel_jobs_run_at_once_on_their_own_cpus(tmp_path):
    """--parallel=2: two jobs at once on disjoint halves of the CPUs, each logging to its
    workdir's train.log; the third starts when one has ended; the failed one is returned."""
    run = sweeps.Run("stand_in", "configs/quickstart.py")
    jobs = [ConcurrentStandIn(run, k, tmp_path / f"seed{k}", (), 1, 1, 1) for k in range(3)]
    lines = []
    assert sweeps.run_local(jobs, log=lines.append, parallel=2) == [jobs[2]]
    cpus = [set(json.loads((job.workdir / "cpus").read_text())) for job in jobs[:2]]
    assert not cpus[0] & cpus[1] and cpus[0] | cpus[1] == os.sched_getaffinity(0)
    for job in jobs:
        assert "started with" in (job.workdir / "train.log").read_text()
    assert [job.finished() for job in jobs] == [True, True, False]
    assert any("seed 2: exited with status 3" in line and "train.log" in line for line in lines)
    assert sum(line.endswith(": finished") for line in lines) == 2


def test_cpu_slots_deal_the_cpus_into_contiguous_groups(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert sweeps.cpu_slots(2) == [{0, 1, 2}, {3, 4}]
    assert sweeps.cpu_slots(5) == [{0}, {1}, {2}, {3}, {4}]
    for bad in (0, 6):
        with pytest.raises(UserError, match=f"--parallel={bad}: expected 1 to 5"):
            sweeps.cpu_slots(bad)


def test_sweep_does_not_start_a_job_on_a_held_workdir(tmp_path):
    from bov_jax.train import workdir_lock

    jobs = jobs_of("table1_cpu", tmp_path, seeds=1, only=["d12"])
    jobs[0].workdir.mkdir(parents=True)
    lines = []
    with workdir_lock.hold(jobs[0].workdir):
        assert sweeps.run_local(jobs, log=lines.append) == jobs
    assert len(lines) == 1 and f"PID {os.getpid()}" in lines[0] and "not started" in lines[0]


def test_a_sweep_with_unfinished_jobs_exits_1(tmp_path, monkeypatch, command_flags):
    """After a forwarded SIGTERM (run_local returns the stopped job and those after it) the
    sweep ends with status 1, as docs/reliability.md says (it was 2, a bad-input status)."""
    from bov_jax.sweep import __main__ as sweep_command

    monkeypatch.setattr(sweeps, "run_local", lambda jobs, parallel: list(jobs))
    sweep_file = REPO / "configs/sweeps/table1_cpu.py"
    command_flags(
        sweep_command.define_flags, f"--sweep={sweep_file}", f"--root={tmp_path}", "--only=d12"
    )
    with pytest.raises(sweep_command.UnfinishedJobs, match="3 of 3 jobs did not finish") as err:
        sweep_command.main(["sweep"])
    assert err.value.exit_status == 1
