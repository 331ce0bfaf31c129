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
import subprocess
import sys
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
