"""launch/tpu_pod.sh and the sweep's tpu_commands.sh against a fake gcloud (tests/launch/gcloud:
a slice of one worker, this machine): `sync` ships the checkout without its virtual
environments; the generated script runs its jobs one after another (`run`, then `wait` until
the job has ended on every worker) and stops at a job that ends before its horizon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from bov_jax.sweep import jobs as sweeps

REPO = Path(__file__).resolve().parents[1]
FAKE_GCLOUD = REPO / "tests" / "launch"
# The fake worker's venv python (~/bov_jax/.venv/bin/python, what `install` builds):
# bov_jax.main logs its start and end around a 1 s pause and writes
# status.json, short of the horizon for the workdir named in $FAIL_WORKDIR.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -u && $2 == -m && $3 == bov_jax.main ]]; then
  for arg; do [[ $arg == --workdir=* ]] && workdir=${arg#--workdir=}; done
  echo "start $workdir" >>"$JOBS_LOG"
  sleep 1
  step=5
  [[ $workdir == "${FAIL_WORKDIR:-}" ]] && step=2
  mkdir -p "$workdir" && printf '{"step": %d, "num_steps": 5}' "$step" >"$workdir/status.json"
  echo "end $workdir" >>"$JOBS_LOG"
  exit 0
fi
exec {python} "$@"
"""


def worker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of launch/tpu_pod.sh with the fake gcloud first on PATH and the fake
    worker's venv python in place."""
    home = tmp_path / "home"
    venv_bin = home / "bov_jax" / ".venv" / "bin"
    venv_bin.mkdir(parents=True, exist_ok=True)
    (venv_bin / "python").write_text(FAKE_PYTHON.replace("{python}", sys.executable))
    (venv_bin / "python").chmod(0o755)
    path = f"{FAKE_GCLOUD}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "HOME": str(home), "TPU_NAME": "t", "ZONE": "z", **extra}


def test_sync_leaves_out_virtual_environments(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "tpu_pod.sh", checkout / "launch")
    files = {
        "train.py": "tracked",
        "notes.txt": "untracked",
        "tools/keep.py": "untracked",
        ".venv/pyvenv.cfg": "home = /usr/bin",
        ".venv/lib/big.py": "a venv",
        "tools/env/pyvenv.cfg": "home = /usr/bin",
        "tools/env/bin/python": "another venv",
    }
    for name, text in files.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "train.py", "launch"], cwd=checkout, check=True)
    env = worker_env(tmp_path)
    done = subprocess.run(
        ["bash", "launch/tpu_pod.sh", "sync"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "home" / "bov_jax_code.tgz") as archive:
        shipped = set(archive.getnames())
    assert shipped == {
        "launch/tpu_pod.sh",
        "train.py",
        "notes.txt",
        "tools/keep.py",
        ".revision.json",  # the commit, for the run record on the workers
    }
    assert (tmp_path / "home" / "bov_jax" / "tools" / "keep.py").read_text() == "untracked"


def run_commands(
    tmp_path: Path, jobs: list[sweeps.Job], **extra: str
) -> tuple[int, list[str], str]:
    """Run the generated tpu_commands.sh from the repository root; (status, the jobs' log, its
    output)."""
    script = tmp_path / "tpu_commands.sh"
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table3.py")
    sweeps.write_executable(script, sweeps.tpu_commands(sweep, jobs, "test"))
    log = tmp_path / "jobs.log"
    env = worker_env(tmp_path, JOBS_LOG=str(log), POLL="0.2", **extra)
    done = subprocess.run(
        ["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    jobs_log = log.read_text().splitlines() if log.exists() else []
    return done.returncode, jobs_log, done.stdout + done.stderr


def test_tpu_commands_run_the_jobs_one_after_another(tmp_path):
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table3.py")
    first, second = sweeps.expand(sweep, tmp_path / "root", 1, ["d24", "d24_bov"])
    status, log, output = run_commands(tmp_path, [first, second])
    assert status == 0, output
    assert log == [
        f"start {first.workdir}",
        f"end {first.workdir}",
        f"start {second.workdir}",
        f"end {second.workdir}",
    ]


def test_tpu_commands_stop_at_a_job_short_of_its_horizon(tmp_path):
    sweep = sweeps.load_sweep(REPO / "configs/sweeps/table3.py")
    first, second = sweeps.expand(sweep, tmp_path / "root", 1, ["d24", "d24_bov"])
    status, log, output = run_commands(tmp_path, [first, second], FAIL_WORKDIR=str(first.workdir))
    assert status == 1 and "error: the run in" in output, output
    assert log == [f"start {first.workdir}", f"end {first.workdir}"]
