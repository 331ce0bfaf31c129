"""Resuming from the command line, as a user would: `python -m bov_jax.main` in subprocesses.

A tiny BoV model (2 layers, width 128, 4 rows of 128 tokens per step) keeps each run to
seconds. The uninterrupted run is the reference: a run chunked by `train.stop_after_steps`,
one whose process was killed (-9) during an asynchronous save, one stopped by SIGTERM and one
moved from 8 devices to 2 must all give its losses, with every step once in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
TINY = (
    "--config=configs/quickstart.py",
    "--config.model.depth=2",
    "--config.model.model_dim=128",
    "--config.model.head_dim=64",
    "--config.model.seq_len=128",
    "--config.train.total_batch_tokens=512",
    "--config.train.device_batch_size=4",
    f"--config.train.num_steps={STEPS}",
    "--config.train.eval_every=4",
    "--config.train.eval_tokens=512",
    "--config.train.log_every=1",
    "--config.train.sample_tokens=0",  # no sampler to compile
    "--config.checkpoint.save_every=2",
    "--config.checkpoint.keep=5",
)

# Runs bov_jax.main with Orbax's final rename of one step (argv[1]) blocked: the process is
# then killed in the middle of that asynchronous save.
HANG_IN_SAVE = """
import runpy, sys, time
from orbax.checkpoint._src.checkpointers import async_checkpointer
hang_step = sys.argv.pop(1)
commit = async_checkpointer._on_commit_callback
def hang(tmpdir, *args, **kwargs):
    if tmpdir.get_final().name == hang_step:
        print("HANGING IN SAVE", flush=True)
        time.sleep(600)
    commit(tmpdir, *args, **kwargs)
async_checkpointer._on_commit_callback = hang
sys.argv[0] = "bov_jax.main"
runpy.run_module("bov_jax.main", run_name="__main__")
"""

# Runs bov_jax.main with a pause and a marker before every step, to signal it mid-run.
SLOW_STEPS = """
import runpy, sys, time
from bov_jax.train import loop
advance = loop.Trainer.advance
def slow(self, state, step):
    print(f"STEP {step}", flush=True)
    time.sleep(0.3)
    return advance(self, state, step)
loop.Trainer.advance = slow
sys.argv[0] = "bov_jax.main"
runpy.run_module("bov_jax.main", run_name="__main__")
"""


def environment(devices: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    return env


def main_args(workdir: Path, *flags: str) -> list[str]:
    return [*TINY, f"--workdir={workdir}", *flags]


def run_main(workdir: Path, *flags: str, devices: int = 1) -> str:
    """Run bov_jax.main to completion; its combined output (the test fails if rc != 0)."""
    done = subprocess.run(
        [sys.executable, "-m", "bov_jax.main", *main_args(workdir, *flags)],
        cwd=REPO,
        env=environment(devices),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def start_driver(code: str, *args: str) -> subprocess.Popen:
    """Run a driver script (-c code) with merged, line-buffered text output."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(process: subprocess.Popen, marker: str, timeout: float = 180) -> str:
    """The output up to and including the first line containing `marker` (the process is
    killed if that takes longer than `timeout` seconds)."""
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    seen = []
    try:
        for line in process.stdout:
            seen.append(line)
            if marker in line:
                return "".join(seen)
    finally:
        watchdog.cancel()
    process.wait()
    raise AssertionError(f"{marker!r} never printed; output:\n{''.join(seen)[-3000:]}")


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def trajectory(workdir: Path) -> list[tuple]:
    """(step, loss, val_bpb) of every record, in file order."""
    return [(r["step"], r.get("loss"), r.get("val_bpb")) for r in metrics(workdir)]


def checkpoint_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run_main(workdir)
    assert [r["step"] for r in metrics(workdir)] == list(range(STEPS + 1))
    return workdir


def test_chunked_run_gives_the_uninterrupted_losses(reference, tmp_path):
    run_main(tmp_path, "--config.train.stop_after_steps=4")
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2, 3]
    assert checkpoint_steps(tmp_path) == [2, 4]
    output = run_main(tmp_path)
    assert "resumed from" in output and f"checkpoints{os.sep}4" in output
    assert trajectory(tmp_path) == trajectory(reference)


def test_kill_during_async_save_leaves_the_previous_checkpoint(reference, tmp_path):
    driver = start_driver(HANG_IN_SAVE, "4", *main_args(tmp_path))
    try:
        read_until(driver, "HANGING IN SAVE")
    finally:
        driver.kill()  # SIGKILL: no handler, no cleanup
        driver.wait()
    assert driver.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "4.orbax-checkpoint-tmp").is_dir()
    assert checkpoint_steps(tmp_path) == [2]
    output = run_main(tmp_path)
    assert f"checkpoints{os.sep}2" in output
    assert trajectory(tmp_path) == trajectory(reference)
    assert checkpoint_steps(tmp_path) == [2, 4, 6, 8]


def test_sigterm_checkpoints_and_exits_0(reference, tmp_path):
    driver = start_driver(SLOW_STEPS, *main_args(tmp_path))
    try:
        output = read_until(driver, "STEP 2")
        driver.send_signal(signal.SIGTERM)
        output += driver.communicate(timeout=120)[0]
    finally:
        driver.kill()
    assert driver.returncode == 0, output[-3000:]
    assert "(SIGTERM)" in output
    done = len(metrics(tmp_path))
    assert done < STEPS and [r["step"] for r in metrics(tmp_path)] == list(range(done))
    assert checkpoint_steps(tmp_path)[-1] == done
    run_main(tmp_path)
    assert trajectory(tmp_path) == trajectory(reference)


def test_restore_onto_fewer_devices_reshards(reference, tmp_path):
    """8 devices (parameters split 2 x 2 x 2) -> 2 devices (fsdp 2), with the batches of the
    1-device reference: its losses, up to the order of reductions over devices."""
    mesh8 = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    stop = "--config.train.stop_after_steps=4"
    run_main(tmp_path, *mesh8, "--config.train.device_batch_size=1", stop, devices=8)
    assert checkpoint_steps(tmp_path) == [2, 4]
    mesh2 = ("--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.tensor=1")
    output = run_main(tmp_path, *mesh2, "--config.train.device_batch_size=2", devices=2)
    assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 1}" in output
    assert f"checkpoints{os.sep}4" in output
    resumed, uninterrupted = metrics(tmp_path), metrics(reference)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1))
    for key in ("loss", "val_bpb"):
        np.testing.assert_allclose(
            [r.get(key, 0.0) for r in resumed], [r.get(key, 0.0) for r in uninterrupted], rtol=1e-5
        )
