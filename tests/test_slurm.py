"""The SLURM launchers under a real SLURM: Debian's slurm-wlm and munge (.ci/run installs them).

A session fixture starts munged, slurmctld and slurmd for one node on 127.0.0.1 with this
machine's CPUs (tests/slurm/slurm.conf; state, spool and logs in a temp dir) and stops them by
PID at the end, with any job process left behind. Then, with the tiny model of test_resume:
(a) `sbatch launch/slurm.sbatch` in its CPU mode runs 2 tasks (jax.distributed from SLURM's
environment) with the losses of one process over 2 devices; (b) the time-limit signal
(`scancel --signal=TERM`, sent to the job's steps as --signal=TERM@300 does) checkpoints, the
script requeues the job and the resumed run has the uninterrupted losses; (c) the sweep's
slurm_array.sbatch runs 2 jobs and `report` reads both; and a GPU job on CPU jax stops at
start with one line. Without SLURM the tests are skipped with the install line, except under
BOV_REQUIRE_SLURM=1 (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_multiprocess import TWO_DEVICES
from test_resume import (
    REPO,
    SLOW_STEPS,
    STEPS,
    TINY,
    environment,
    metrics,
    run_main,
    trajectory,
)

HERE = Path(__file__).resolve().parent / "slurm"
SCRIPT = REPO / "launch" / "slurm.sbatch"
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE")
CONFIG, *FLAGS = TINY  # --config=... goes to the script as CONFIG
# One CPU device per task, the rows of a step over the 2 tasks, as test_multiprocess.
CPU_JOB = ("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10")
STREAMS = "--config.train.data_streams=2"
# `python` for the job script, with a pause and a "STEP n" line before every training step.
SLOW_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -u && $2 == -m && $3 == bov_jax.main ]]; then
  shift 3
  exec {python} -u -c {code} "$@"
fi
exec {python} "$@"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_to_all(path: Path) -> bool:
    """Whether every directory from / down to `path` lets all users through (o+x): munged
    refuses a socket below one that does not."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def base_open_to_all() -> Path:
    """The directory for the cluster's files: the temp dir, or /tmp where TMPDIR (or one of
    its parents) is closed to others, as a `mktemp -d` TMPDIR is."""
    for base in (Path(tempfile.gettempdir()), Path("/tmp")):
        if base.is_dir() and open_to_all(base):
            return base
    pytest.fail(
        f"munged needs a temp dir open to all (o+x): neither {tempfile.gettempdir()} nor /tmp is"
    )


@dataclasses.dataclass
class Cluster:
    """A running one-node cluster: its directory, the clients' environment, its daemons."""

    dir: Path
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)

    def logs(self) -> str:
        out = []
        for path in sorted((self.dir / "log").iterdir()):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(out)

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(
            args, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{shlex.join(args)}: {done.stderr}\n{self.logs()}"
        return done.stdout

    def submit(self, *args: str, **env: str) -> str:
        """sbatch from the repository root (the submit directory) with the test's environment
        and `env`; the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **env},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, f"sbatch: {done.stderr}\n{self.logs()}"
        return done.stdout.strip().split(";")[0]

    def states(self, job_id: str) -> list[dict[str, str]]:
        """JobState, Restarts and ExitCode of the job (of each task of an array)."""
        out = self.command("scontrol", "show", "job", "-o", job_id)
        fields = ("JobState", "Restarts", "ExitCode")
        return [
            {key: re.search(rf"\b{key}=(\S+)", line)[1] for key in fields}
            for line in out.splitlines()
            if line.strip()
        ]

    def wait(self, job_id: str, output: Path, timeout: float = 240) -> list[dict[str, str]]:
        """The job's final states; the test fails (the job cancelled) after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.states(job_id)
            if states and all(s["JobState"] in DONE for s in states):
                return states
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env, timeout=30)
        text = "\n".join(p.read_text()[-3000:] for p in output.parent.glob(output.name))
        pytest.fail(f"job {job_id} still {states} after {timeout} s:\n{text}\n{self.logs()}")


def job_processes(marker: bytes) -> list[int]:
    """Processes (not this one) whose environment holds `marker`: every process of a job and
    its slurmstepd carries the cluster's SLURM_CONF."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def start(cluster: Cluster, name: str, *args: str) -> None:
    log = open(cluster.dir / "log" / f"{name}.out", "w")  # noqa: SIM115 (the daemon's stdout)
    cluster.daemons[name] = subprocess.Popen(
        args, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()


def wait_until(ready, what: str, cluster: Cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [name for name, p in cluster.daemons.items() if p.poll() is not None]
        if dead:
            pytest.fail(f"{', '.join(dead)} exited while waiting for {what}:\n{cluster.logs()}")
        time.sleep(0.2)
    pytest.fail(f"no {what} after {timeout} s:\n{cluster.logs()}")


def stop(cluster: Cluster) -> None:
    """Cancel what is left, stop the daemons by PID, then kill any job process left behind."""
    if cluster.daemons.get("slurmctld") and cluster.daemons["slurmctld"].poll() is None:
        subprocess.run(["scancel", "--partition=test"], env=cluster.env, timeout=30)
    for name in ("slurmd", "slurmctld", "munged"):
        daemon = cluster.daemons.get(name)
        if daemon is None:
            continue
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=15)
    for pid in job_processes(f"SLURM_CONF={cluster.dir}/slurm.conf".encode()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    missing = [
        t for t in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch") if not shutil.which(t)
    ]
    if missing:
        # A machine without SLURM skips these tests, saying so; CI (.ci/run installs SLURM and
        # sets BOV_REQUIRE_SLURM=1) fails instead, so that they cannot vanish from it.
        message = f"SLURM not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
        if os.environ.get("BOV_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # munged wants its socket's directory open to all; pytest's temp dirs are 0700.
    root = Path(tempfile.mkdtemp(prefix="bov_jax_slurm_", dir=base_open_to_all()))
    root.chmod(0o755)
    for sub in ("state", "spool", "log", "munge"):
        (root / sub).mkdir(mode=0o755)
    conf = string.Template((HERE / "slurm.conf").read_text()).substitute(
        dir=root,
        ctld_port=free_port(),
        slurmd_port=free_port(),
        cpus=len(os.sched_getaffinity(0)),
    )
    (root / "slurm.conf").write_text(conf)
    env = {**environment(), "SLURM_CONF": str(root / "slurm.conf")}
    cluster = Cluster(root, env)
    try:
        munge = root / "munge"
        cluster.command("mungekey", "--create", f"--keyfile={munge / 'munge.key'}")
        start(
            cluster,
            "munged",
            "munged",
            "--foreground",
            f"--key-file={munge / 'munge.key'}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        wait_until((munge / "munge.socket").exists, "munge socket", cluster)
        start(cluster, "slurmctld", "slurmctld", "-D", "-i", "-f", str(root / "slurm.conf"))
        start(cluster, "slurmd", "slurmd", "-D", "-N", "localhost", "-f", str(root / "slurm.conf"))

        def idle() -> bool:
            done = subprocess.run(
                ["sinfo", "--noheader", "--format=%T"],
                env=env,
                capture_output=True,
                text=True,
                timeout=10,
            )
            return done.returncode == 0 and done.stdout.strip() == "idle"

        wait_until(idle, "idle node", cluster)
        yield cluster
    finally:
        stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def job_output(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def submit_two_tasks(cluster, workdir: Path, output: Path, python: str) -> str:
    """launch/slurm.sbatch, MODE=cpu, 2 tasks of the tiny config on `workdir`; the job id."""
    return cluster.submit(
        *CPU_JOB,
        "--ntasks-per-node=2",
        f"--output={output}",
        str(SCRIPT),
        *FLAGS,
        TWO_DEVICES,
        STREAMS,
        MODE="cpu",
        WORKDIR=str(workdir),
        CONFIG=CONFIG.partition("=")[2],
        PYTHON=python,
    )


@pytest.fixture(scope="module")
def two_tasks(cluster, tmp_path_factory) -> tuple[Path, str, list[dict[str, str]]]:
    """(a)'s job: launch/slurm.sbatch, MODE=cpu, 2 tasks to the end (workdir, output, states)."""
    workdir = tmp_path_factory.mktemp("slurm_two_tasks")
    output = workdir.parent / f"{workdir.name}.out"
    job = submit_two_tasks(cluster, workdir, output, sys.executable)
    states = cluster.wait(job, output)
    return workdir, job_output(output), states


def test_sbatch_two_tasks_have_the_losses_of_one_process(two_tasks, tmp_path):
    workdir, output, states = two_tasks
    assert states == [{"JobState": "COMPLETED", "Restarts": "0", "ExitCode": "0:0"}], output
    assert "1 nodes x 2 processes (cpu)" in output and "run complete" in output
    assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in output and "2 data streams" in output
    assert "INFO [process 0/2]" in output and "INFO [process 1/2]" not in output
    run_main(tmp_path, TWO_DEVICES, STREAMS, devices=2)  # 1 process x 2 devices
    assert trajectory(workdir) == trajectory(tmp_path)


def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster, two_tasks, tmp_path):
    workdir, output = tmp_path / "run", tmp_path / "job.out"
    slow = tmp_path / "slow_python"
    slow.write_text(
        SLOW_PYTHON.format(python=shlex.quote(sys.executable), code=shlex.quote(SLOW_STEPS))
    )
    slow.chmod(0o755)
    job = submit_two_tasks(cluster, workdir, output, str(slow))
    deadline = time.monotonic() + 180
    while "STEP 3" not in job_output(output):
        assert time.monotonic() < deadline, job_output(output)[-3000:] + cluster.logs()
        time.sleep(0.2)
    # What SLURM does --signal=TERM@300 before the time limit: SIGTERM to the job's steps,
    # not to the batch shell (which then requeues the job).
    cluster.command("scancel", "--signal=TERM", job)
    states = cluster.wait(job, output)
    text = job_output(output)
    assert states == [{"JobState": "COMPLETED", "Restarts": "1", "ExitCode": "0:0"}], text
    assert "(SIGTERM)" in text and "requeueing job" in text and "(restart 1)" in text
    assert text.count("run complete") == 1
    resumed_from = int(re.search(r"resumed from .*checkpoints/(\d+)", text)[1])
    assert 3 <= resumed_from < STEPS  # stopped mid-run
    assert trajectory(workdir) == trajectory(two_tasks[0])  # every step once, same losses


def test_sweep_array_runs_both_jobs_and_report_reads_them(cluster, tmp_path):
    root = tmp_path / "sweep"
    venv = tmp_path / "venv"  # a stand-in virtual environment: VENV/bin/python
    (venv / "bin").mkdir(parents=True)
    # A script that runs this interpreter, not a symlink to it: a symlinked venv python
    # resolves to the base interpreter, without the venv's packages (pytest in a venv).
    stand_in = venv / "bin" / "python"
    marker = f"stand-in python of {venv}"
    stand_in.write_text(
        f'#!/bin/sh\necho "{marker}" >&2\nexec {shlex.quote(sys.executable)} "$@"\n'
    )
    stand_in.chmod(0o755)
    overrides = [f"--override={flag.removeprefix('--config.')}" for flag in FLAGS]
    # the array's resources: one CPU each, both tasks at once (not the default --exclusive)
    options = (*CPU_JOB, "--ntasks-per-node=1", "--exclusive=user")
    sbatch = [f"--sbatch={option}" for option in options]
    generate = subprocess.run(
        [
            sys.executable,
            "-m",
            "bov_jax.sweep",
            f"--sweep={HERE / 'tiny_sweep.py'}",
            f"--root={root}",
            "--launcher=slurm",
            *overrides,
            *sbatch,
        ],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generate.returncode == 0, generate.stderr
    script = root / "slurm_array.sbatch"
    code = [line for line in script.read_text().splitlines() if not line.startswith("# ")]
    assert str(REPO) not in "\n".join(code)  # the checkout: REPO or the submit directory
    job = cluster.submit(str(script), MODE="cpu", VENV=str(venv))
    states = cluster.wait(job, root / "slurm-*.out")
    logs = "\n".join(p.read_text() for p in sorted(root.glob("slurm-*.out")))
    assert len(states) == 2 and all(s["JobState"] == "COMPLETED" for s in states), logs[-4000:]
    assert logs.count(marker) >= 2 and logs.count(f"under {sys.executable}: cpu") == 2
    assert "#SBATCH --exclusive=user\n" in script.read_text()
    for seed in (0, 1):
        assert [r["step"] for r in metrics(root / "tiny" / f"seed{seed}")] == list(range(STEPS + 1))
    report = subprocess.run(
        [sys.executable, "-m", "bov_jax.report", f"--root={root}", "--nokv_cache"],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    text = (root / "report.md").read_text()
    finals = [metrics(root / "tiny" / f"seed{seed}")[-1]["val_bpb"] for seed in (0, 1)]
    assert f"| tiny | {sum(finals) / 2:.4f} ± " in text and "(n=2)" in text, text
    assert "All runs finished." in text


def test_gpu_job_on_cpu_jax_stops_at_start_with_one_line(cluster, tmp_path):
    output = tmp_path / "job.out"
    job = cluster.submit(
        *CPU_JOB,
        "--ntasks-per-node=1",
        f"--output={output}",
        str(SCRIPT),
        WORKDIR=str(tmp_path / "run"),
        PYTHON=sys.executable,  # MODE: per-gpu, the default
    )
    states = cluster.wait(job, output, timeout=60)
    text = job_output(output)
    assert states == [{"JobState": "FAILED", "Restarts": "0", "ExitCode": "2:0"}], text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "asked for gpu" in errors[0] and "runs on cpu" in errors[0]
    assert "Traceback" not in text and not (tmp_path / "run").exists()
