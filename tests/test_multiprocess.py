"""Several processes (jax.distributed over gloo on 127.0.0.1) as a stand-in for several hosts.

launch/local_multiprocess.sh 2 runs 2 processes x 1 CPU device; the reference is 1 process x
2 devices reading the same 2 data streams. Both must give the same losses, the 2-process run
must leave one metrics file written by process 0 and a checkpoint with both processes' shards
and data positions, and the 1-process run must be able to continue it. The val BPB of the
same weights (the initial ones) must not depend on the layout: 2 processes x 2 rows per device
and 1 process x 1 row per device (4 micro-batches, one data stream) score the same val tokens.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import (
    REPO,
    STEPS,
    checkpoint_steps,
    environment,
    main_args,
    metrics,
    run_main,
    trajectory,
)

from bov_jax.train.checkpoint import verify_manifest

LAUNCH = REPO / "launch" / "local_multiprocess.sh"
TWO_DEVICES = "--config.train.device_batch_size=2"  # the 4 rows of a step over 2 devices


def run_two_processes(workdir: Path, *flags: str) -> str:
    done = subprocess.run(
        ["bash", str(LAUNCH), "2", *main_args(workdir, TWO_DEVICES, *flags)],
        cwd=REPO,
        # the processes run under this test's interpreter (a venv need not be on PATH)
        env={**environment(), "PYTHON": sys.executable, "LOG_DIR": str(workdir / "process_logs")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def test_two_processes_match_one_process_with_two_devices(tmp_path):
    two_procs, one_proc = tmp_path / "two_processes", tmp_path / "one_process"
    output = run_two_processes(two_procs, "--config.train.stop_after_steps=4")
    assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in output and "2 data streams" in output
    other_log = (two_procs / "process_logs" / "process_1.log").read_text()
    assert "Validation bpb" not in other_log and "step 00000" not in other_log
    step_dir = two_procs / "checkpoints" / "4"
    assert {p.name for p in (step_dir / "data").glob("stream_*")} == {
        "stream_0-of-2.json",
        "stream_1-of-2.json",
    }
    assert {p.name for p in (step_dir / "state").glob("ocdbt.process_*")} == {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }

    one_row = tmp_path / "one_row_per_device"
    run_main(one_row, "--config.train.device_batch_size=1", "--config.train.stop_after_steps=1")
    assert json.loads((one_row / "config.json").read_text())["train"]["data_streams"] == 1
    initial_bpb = [metrics(w)[0]["val_bpb"] for w in (two_procs, one_row)]
    assert initial_bpb[0] == pytest.approx(initial_bpb[1], rel=1e-6)

    streams = "--config.train.data_streams=2"
    run_main(one_proc, TWO_DEVICES, streams, devices=2)
    run_main(
        two_procs, TWO_DEVICES, streams, devices=2
    )  # the 2-process run, continued by 1 process
    assert checkpoint_steps(two_procs)[-1] == STEPS
    assert [r["step"] for r in metrics(two_procs)] == list(range(STEPS + 1))
    assert trajectory(two_procs) == trajectory(one_proc)  # bit for bit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_peer_stops_the_other_in_seconds_and_the_rerun_resumes(tmp_path):
    """kill -9 of process 1 mid-run: process 0 stops within 30 s (the peer watch's 10 s, where
    it waited 86 s for jax.distributed's heartbeat and died in a 99-line dump), in one line,
    and the checkpoints written before are intact: a rerun resumes from the last one."""
    workdir, port = tmp_path / "run", free_port()
    long_run = ("--config.train.num_steps=1000", "--config.checkpoint.save_every=2")
    args = main_args(workdir, TWO_DEVICES, *long_run, "--config.train.eval_every=1000")
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bov_jax.main",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                "--local_device_count=1",
                *args,
            ],
            cwd=REPO,
            env=environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        while not (workdir / "checkpoints" / "4").is_dir():
            assert time.monotonic() < deadline and processes[0].poll() is None
            time.sleep(0.2)
        processes[1].kill()
        killed = time.monotonic()
        stderr = processes[0].communicate(timeout=60)[1]
        waited = time.monotonic() - killed
    finally:
        for process in processes:
            process.kill()
            process.wait(30)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert processes[0].returncode == 1 and waited < 30, (waited, stderr[-3000:])
    assert len(errors) == 1 and "process 1 of 2 gave no heartbeat" in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr and "Terminating process" not in stderr
    last = checkpoint_steps(workdir)[-1]
    verify_manifest(workdir / "checkpoints" / str(last), last)
    output = run_two_processes(workdir, *long_run, "--config.train.stop_after_steps=1")
    assert f"resumed from {workdir / 'checkpoints' / str(last)}" in output
    assert checkpoint_steps(workdir)[-1] == last + 1
