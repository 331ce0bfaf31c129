"""Faults a user meets, through `python -m bov_jax.main` as they would meet them.

A non-finite update (injected with the test-only key train.fault_nonfinite_step) never
reaches a checkpoint and the rerun continues from the last good one; data is recognised by
content (same shards elsewhere resume, edited or swapped shards are refused by name and no
checkpoint is moved); bad flags and values end in one line without a traceback; a save that
fails in the background stops the run at once with the earlier checkpoints intact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from test_resume import REPO, STEPS, checkpoint_steps, environment, main_args, metrics, run_main

from bov_jax.config import default_config, validate_config
from bov_jax.data import identity, shards
from bov_jax.data.config import EMBEDDED_DIR
from bov_jax.data.identity import data_fingerprint
from bov_jax.errors import ConfigError
from bov_jax.train import workdir_lock
from bov_jax.train.checkpoint import (
    CheckpointError,
    Checkpoints,
    DataChangedError,
    DataStateError,
    experiment_differences,
    verify_manifest,
)
from bov_jax.train.loop import truncate_metrics
from bov_jax.train.state import TrainState

NO_CACHE = "--config.data.use_cache=False"  # copied data dirs: no token cache to build


def run_failing(workdir: Path, *flags: str, driver: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run bov_jax.main (or a driver: code and its own arguments) expected to fail:
    (exit status, stderr)."""
    command = ["-c", *driver] if driver else ["-m", "bov_jax.main"]
    done = subprocess.run(
        [sys.executable, *command, *main_args(workdir, *flags)],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.returncode, done.stderr


def assert_one_line(stderr: str) -> str:
    """The stderr's `error:` message: exactly one, and no traceback or asyncio noise."""
    assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def test_nonfinite_update_never_reaches_a_checkpoint(tmp_path):
    status, stderr = run_failing(tmp_path, "--config.train.fault_nonfinite_step=3")
    message = assert_one_line(stderr)
    last_good = tmp_path / "checkpoints" / "2"
    assert status == 1 and "at step 3" in message and str(last_good) in message
    assert checkpoint_steps(tmp_path) == [2]
    verify_manifest(last_good, 2)
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask
    # The fault was transient: the rerun continues from step 2 to the end, every step once.
    output = run_main(tmp_path)
    assert f"resumed from {last_good}" in output
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records[:STEPS])
    # A finished run extended on purpose: the listed key is accepted with a warning.
    output = run_main(
        tmp_path,
        f"--config.train.num_steps={STEPS + 2}",
        "--config.checkpoint.allow_changes=train.num_steps",
    )
    assert "train.num_steps: 8 -> 10" in output and "schedules follow the new values" in output
    assert [r["step"] for r in metrics(tmp_path)] == list(range(STEPS + 3))


def copy_data(destination: Path) -> Path:
    """The embedded corpus' shards and tokenizer (not its token cache) in `destination`."""
    destination.mkdir()
    for path in EMBEDDED_DIR.glob("*.parquet"):
        shutil.copy(path, destination)
    shutil.copytree(EMBEDDED_DIR / "tokenizer", destination / "tokenizer")
    return destination


def rewrite_shard(path: Path, keep_documents: int | None = None) -> None:
    """Edit a shard in place: its first document altered, or only the first documents kept."""
    table = pq.read_table(path)
    texts = table[shards.TEXT_COLUMN].to_pylist()
    sources = table[shards.SOURCE_COLUMN].to_pylist()
    if keep_documents is None:
        texts[0] = texts[0].upper()
    else:
        texts, sources = texts[:keep_documents], sources[:keep_documents]
    shards.write_shard(path, texts, sources, row_group_size=16)


@pytest.fixture(scope="module")
def trained_on_a_copy(tmp_path_factory) -> tuple[Path, Path]:
    """(data dir, workdir) of a run on a copy of the embedded corpus stopped at step 2."""
    root = tmp_path_factory.mktemp("data_identity")
    data = copy_data(root / "data")
    workdir = root / "run"
    run_main(
        workdir, NO_CACHE, f"--config.data.data_dir={data}", "--config.train.stop_after_steps=2"
    )
    assert checkpoint_steps(workdir) == [2]
    recorded = json.loads((workdir / "config.json").read_text())
    assert recorded["model"]["compute_dtype"] == "float32"  # "auto", resolved on this CPU
    assert set(recorded["data_files"]) >= {p.name for p in data.glob("*.parquet")}
    return data, workdir


def resume_on(data: Path, workdir: Path, *flags: str) -> tuple[int, str]:
    return run_failing(workdir, NO_CACHE, f"--config.data.data_dir={data}", *flags)


def test_same_data_at_another_path_resumes(trained_on_a_copy, tmp_path):
    data, workdir = trained_on_a_copy
    moved_data, moved_run = tmp_path / "elsewhere", tmp_path / "run"
    shutil.copytree(data, moved_data)
    shutil.copytree(workdir, moved_run)
    output = run_main(
        moved_run,
        NO_CACHE,
        f"--config.data.data_dir={moved_data}",
        "--config.model.compute_dtype=float32",  # what "auto" was: the same experiment
        "--config.train.stop_after_steps=1",
    )
    assert f"resumed from {moved_run / 'checkpoints' / '2'}" in output
    assert checkpoint_steps(moved_run) == [2, 3]


@pytest.mark.parametrize("change", ["edited", "swapped"])
def test_changed_data_is_refused_by_name_and_no_checkpoint_moves(
    trained_on_a_copy, tmp_path, change
):
    data, workdir = trained_on_a_copy
    changed, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(data, changed)
    shutil.copytree(workdir, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    if change == "edited":  # same documents, one text altered
        rewrite_shard(changed / "shard_00001.parquet")
        status, stderr = resume_on(changed, run)
    else:  # another document count; fallback asked for, and still nothing is moved
        rewrite_shard(changed / "shard_00001.parquet", keep_documents=40)
        status, stderr = resume_on(changed, run, "--config.checkpoint.fallback=True")
    assert_one_line(stderr)
    assert status == 1 and "is not the data of checkpoint" in stderr
    assert "shard_00001.parquet:" in stderr and "shard_00000.parquet:" not in stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_other_width_with_allow_changes_and_fallback_keeps_every_checkpoint(
    trained_on_a_copy, tmp_path
):
    """The remedy of a mismatch error taken too far: another width is another experiment
    (exit 1, in one error), not a damaged checkpoint to move aside."""
    data, workdir = trained_on_a_copy
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    status, stderr = resume_on(
        data,
        run,
        "--config.model.model_dim=192",
        "--config.checkpoint.allow_changes=model.model_dim",
        "--config.checkpoint.fallback=True",
    )
    message = assert_one_line(stderr)
    assert status == 1 and "written by a different experiment" in message
    assert "model.model_dim: 128 -> 192" in stderr and "cannot accept model.model_dim" in stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_damaged_checkpoint_without_manifest_is_named_in_one_line(tmp_path):
    """A checkpoint from before manifests, its array file cut short: Orbax's error (a whole
    TensorStore spec) is cut to its first line; it counts as damage, so fallback may act."""
    state = TrainState(jnp.int32(2), {"w": jnp.arange(4096.0)}, {}, jax.random.key(0))
    streams = SimpleNamespace(count=1, iterators={0: Position(100)})
    checkpoints = Checkpoints(tmp_path, keep=2, async_save=False)
    checkpoints.save(2, state, streams, {})
    step_dir = tmp_path / "checkpoints" / "2"
    (step_dir / "bov_manifest.json").unlink()
    victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=os.path.getsize)
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        checkpoints.restore_latest(state, streams, {})
    message = str(err.value)
    assert "\n" not in message and len(message) < 600 and message.startswith("checkpoint at step 2")
    assert err.value.damaged and "no manifest to check it by" in message
    checkpoints.close()


def test_in_place_edit_of_a_large_shard_is_refused_on_resume(tmp_path):
    """A shard over 8 MiB (every ClimbMix shard is) with bytes of its documents rewritten in
    place, size and parquet footer unchanged: its whole-content digest differs."""
    data = tmp_path / "data"
    shutil.copytree(EMBEDDED_DIR / "tokenizer", data / "tokenizer")
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    texts = [rng.choice(letters, 1 << 20).tobytes().decode() for _ in range(16)]
    shards.write_shard(data / "shard_00000.parquet", texts, ["big"] * 16, row_group_size=4)
    shutil.copy(EMBEDDED_DIR / "shard_00004.parquet", data / "shard_00001.parquet")
    big = data / "shard_00000.parquet"
    assert big.stat().st_size > 8 << 20
    data_cfg = SimpleNamespace(data_dir=str(data), tokenizer_dir="")
    saved = data_fingerprint(data_cfg)
    config = {"data": {"data_dir": str(data), "tokenizer_dir": ""}, "data_files": saved}
    checkpoints = Checkpoints(tmp_path / "run", keep=1)
    # A checkpoint of an older version named the large shard by its footer: still resumes.
    legacy = {**saved, big.name: {**saved[big.name], "sha256": identity.footer_digest(big)}}
    checkpoints.check_data(2, {"data_files": legacy}, config)
    with open(big, "r+b") as f:  # inside the first row group's text: not the footer
        f.seek(1 << 20)
        original = f.read(64)
        f.seek(1 << 20)
        f.write(bytes(reversed(original)))
    config["data_files"] = data_fingerprint(data_cfg)
    with pytest.raises(DataChangedError, match="shard_00000.parquet: same size, other content"):
        checkpoints.check_data(2, {"data_files": saved}, config)
    checkpoints.close()


def test_digests_are_cached_by_path_size_mtime_and_inode(tmp_path, monkeypatch):
    shard, cache = tmp_path / "shard.parquet", tmp_path / "digests.json"
    shard.write_bytes(b"x" * 1000)
    os.utime(shard, (1e9, 1e9))  # long settled
    first = identity.content_digests([shard], cache)
    opened = []
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k)
    )
    assert identity.content_digests([shard], cache) == first and opened == []
    shard.write_bytes(b"y" * 1000)  # same size, new mtime (too recent to cache yet)
    assert identity.content_digests([shard], cache)[shard] != first[shard] and opened == [shard]
    monkeypatch.undo()


def test_an_edit_whose_mtime_was_set_back_is_hashed_again(tmp_path):
    shard, cache = tmp_path / "shard.parquet", tmp_path / "digests.json"
    shard.write_bytes(b"x" * 1000)
    os.utime(shard, (1e9, 1e9))  # long settled: its digest is cached
    first = identity.content_digests([shard], cache)[shard]
    assert len(identity.read_cache(cache)) == 1
    time.sleep(0.01)  # a later ctime tick
    with open(shard, "r+b") as f:  # same size, same inode, the mtime set back: only the ctime
        f.write(b"y")  # tells (keyed by path, size, mtime and inode this resumed silently)
    os.utime(shard, (1e9, 1e9))
    assert identity.content_digests([shard], cache)[shard] != first


class Position:
    """A data iterator stand-in: its state, and a set_state that refuses what does not fit."""

    def __init__(self, documents: int):
        self.documents, self.position = documents, 0

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        if state["position"] > self.documents:
            raise ValueError(f"position {state['position']} beyond {self.documents} documents")
        self.position = state["position"]


def test_data_position_that_no_longer_fits_is_not_a_damaged_checkpoint(tmp_path):
    state = TrainState(jnp.int32(2), {"w": jnp.ones(3)}, {}, jax.random.key(0))
    streams = SimpleNamespace(count=1, iterators={0: Position(100)})
    streams.iterators[0].position = 50
    checkpoints = Checkpoints(tmp_path, keep=2, async_save=False)
    checkpoints.save(2, state, streams, {})
    fewer = SimpleNamespace(count=1, iterators={0: Position(40)})
    with pytest.raises(DataStateError, match="stream_0-of-1.json: the saved data position"):
        checkpoints.restore_latest(state, fewer, {}, fallback=True)
    assert checkpoint_steps(tmp_path) == [2] and not list(
        (tmp_path / "checkpoints").glob("*corrupt*")
    )
    checkpoints.close()


def test_auto_choices_are_compared_resolved():
    saved = {"model": {"compute_dtype": "bfloat16"}, "optim": {"matrix_lr": math.nan}}
    current = {"model": {"compute_dtype": "float32"}, "optim": {"matrix_lr": math.nan}}
    assert experiment_differences(saved, current) == [
        "model.compute_dtype: 'bfloat16' -> 'float32'"
    ]


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.num_steps", 0),
        ("train.num_steps", -5),
        ("checkpoint.save_every", -3),
        ("train.total_batch_tokens", -4096),
        ("train.target_flops", 0.0),
        ("train.stop_after_steps", 0),
        ("model.model_dim", -64),
        ("optim.matrix_lr", math.nan),
        ("optim.matrix_lr", math.inf),
        ("optim.warmdown_ratio", 1.5),
        ("optim.embedding_betas", (0.8, 1.0)),
    ],
)
def test_out_of_range_values_are_refused_naming_the_key(key, value):
    config = default_config()
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=rf"^{key}="):
        validate_config(config)


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.train.num_step=5", "did you mean train.num_steps?"),
        ("--config.train.num_steps=0", "train.num_steps=0; expected -1"),
        ("--config=configs/no_such_file.py", "config file configs/no_such_file.py not found"),
    ],
)
def test_bad_flags_end_in_one_line(tmp_path, flag, expected):
    status, stderr = run_failing(tmp_path, flag)
    assert status == 2 and expected in assert_one_line(stderr)


def test_core_without_workdir_names_the_workdir(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bov_jax.evals.core", f"--workdir={tmp_path / 'nope'}"]
        + [f"--bundle_dir={tmp_path / 'no_bundle'}"],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and f"{tmp_path / 'nope'}" in assert_one_line(done.stderr)


def test_unwritable_workdir_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    status, stderr = run_failing(blocker / "run")
    assert status == 2 and f"workdir {blocker / 'run'} is not writable" in assert_one_line(stderr)


# Runs bov_jax.main with the commit of one step's save (argv[1]) failing as on a full disk, with
# the echoes a real full disk leaves from Orbax's threads (seen on a 40 MB tmpfs: 58-114
# "Event loop is closed" tracebacks): TensorStore completing a write on the event loop that
# the failure closed (an unraisable error), and a gathered write whose error nobody retrieves.
FULL_DISK_AT_SAVE = """
import asyncio, errno, gc, runpy, sys, threading
import tensorstore as ts
from orbax.checkpoint._src.checkpointers import async_checkpointer
failing_step = sys.argv.pop(1)
commit = async_checkpointer._on_commit_callback

def echoes():
    promise, write = ts.Promise.new()
    async def fail():
        raise OSError(errno.ENOSPC, "No space left on device")
    async def writes():
        pending = [asyncio.ensure_future(write), asyncio.gather(fail())]
        await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(writes())
    loop.close()
    gc.collect()
    for _ in range(20):
        threading.Thread(target=promise.set_result, args=(None,)).start()

def full_disk(tmpdir, *args, **kwargs):
    if tmpdir.get_final().name == failing_step:
        echoes()
        raise OSError(errno.ENOSPC, "No space left on device", str(tmpdir.get()))
    commit(tmpdir, *args, **kwargs)
async_checkpointer._on_commit_callback = full_disk
sys.argv[0] = "bov_jax.main"
runpy.run_module("bov_jax.main", run_name="__main__")
"""


def test_failed_save_stops_the_run_and_keeps_earlier_checkpoints(tmp_path):
    every_step = "--config.checkpoint.save_every=1"
    status, stderr = run_failing(tmp_path, every_step, driver=(FULL_DISK_AT_SAVE, "2"))
    message = assert_one_line(stderr)
    assert status == 1 and "step 2" in message and "No space left on device" in message
    beyond_the_log = [line for line in stderr.splitlines() if " INFO " not in line]
    assert len(beyond_the_log) <= 3, stderr[-3000:]
    assert checkpoint_steps(tmp_path) == [1]
    verify_manifest(tmp_path / "checkpoints" / "1", 1)
    assert [r["step"] for r in metrics(tmp_path)][-1] <= 3  # within a step of the save


def test_metrics_line_that_is_not_utf8_is_dropped_on_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "loss": 9.0}\n{"step": 1, "note": "\xff"}\n{"step": 2}\n')
    with caplog.at_level(logging.WARNING, logger="bov_jax"):
        truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 0, "loss": 9.0}\n'
    assert "dropped 1 unreadable line(s)" in caplog.text


def test_second_run_on_a_workdir_stops_naming_the_first(tmp_path, caplog):
    with workdir_lock.hold(tmp_path):
        status, stderr = run_failing(tmp_path)
    message = assert_one_line(stderr)
    assert status == 1 and "in use by another run" in message and f"PID {os.getpid()}" in message
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    # The lock file of a run that crashed (its flock gone with it) is taken over, with a warning.
    (tmp_path / "run.lock").write_text('{"host": "h", "pid": 1, "started": "then"}')
    with caplog.at_level(logging.WARNING, logger="bov_jax"), workdir_lock.hold(tmp_path):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        assert workdir_lock.holder(tmp_path).startswith("host ")
    assert "taking over" in caplog.text and "PID 1, started then" in caplog.text
    assert workdir_lock.holder(tmp_path) is None and (tmp_path / "run.lock").read_text() == ""


def damage_shard(path: Path, row_group: int = 1) -> None:
    """Zero 4 KiB inside a row group's text pages: same size, footer intact, mtime set back."""
    stat = path.stat()
    column = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    with open(path, "r+b") as f:
        f.seek(column.data_page_offset + 200)
        f.write(bytes(4096))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("use_cache", [True, False])
def test_damaged_shard_stops_training_in_one_line_naming_it(tmp_path, use_cache):
    data = copy_data(tmp_path / "data")
    damage_shard(data / "shard_00001.parquet")
    flags = [f"--config.data.data_dir={data}", f"--config.data.use_cache={use_cache}"]
    status, stderr = run_failing(tmp_path / "run", *flags, f"--config.data.cache_dir={tmp_path}")
    message = assert_one_line(stderr)
    assert status == 1, stderr[-2000:]
    assert f"shard {data / 'shard_00001.parquet'}, row group 1: cannot be read" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_damaged_shard_stops_tokenizer_training_naming_it(tmp_path):
    from bov_jax.data.tokenizer import _training_lines

    data = copy_data(tmp_path / "data")
    damage_shard(data / "shard_00001.parquet", row_group=3)
    with pytest.raises(shards.DamagedShardError, match=r"shard_00001.parquet, row group 3: cannot"):
        list(_training_lines(sorted(data.glob("*.parquet"))))
