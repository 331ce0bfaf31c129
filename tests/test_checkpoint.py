"""Checkpoint contents and failure handling, in process (loop runs on one device; the round
trip uses the 8 fake devices of conftest).

What a checkpoint must restore exactly (optimizer counts and buffers, RNG, step, data
position), onto the same or a smaller mesh; damaged checkpoints named by step and file, with
a fallback; a config from another experiment refused with its keys listed, or its parameters
taken explicitly for fine-tuning; a non-finite step stopping the run with the last good
checkpoint intact, or skipped when asked.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import meshes_on_one_device

from bov_jax import sharding
from bov_jax.accounting import training_plan
from bov_jax.data.config import tokenizer_path
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.train import loop
from bov_jax.train.checkpoint import (
    CheckpointError,
    Checkpoints,
    ConfigMismatchError,
    experiment_differences,
    load_parameters,
    verify_manifest,
)
from bov_jax.train.layout import BatchLayout
from bov_jax.train.state import create_train_state
from bov_jax.train.step import make_train_step
from configs import quickstart

STEPS = 4


def tiny_config(**train):
    """The quickstart at 2 layers of width 128, 4 rows of 128 tokens per step, one device."""
    config = quickstart.get_config()
    config.model.update(depth=2, model_dim=128, head_dim=64, seq_len=128)
    config.mesh.update(data=1, fsdp=1, tensor=1)
    settings = dict(
        num_steps=STEPS,
        total_batch_tokens=512,
        device_batch_size=4,
        eval_every=2,
        log_every=1,  # coefficients in every record
        eval_tokens=512,
        sample_tokens=0,  # no sampler to compile
    )
    config.train.update({**settings, **train})
    config.checkpoint.update(save_every=2, keep=5)
    return config


@pytest.fixture(scope="module", autouse=True)
def one_device():
    """The loop runs here test checkpoints, not sharding (the round trip below and
    tests/test_resume.py move checkpoints between meshes): they run on one device."""
    with meshes_on_one_device():
        yield


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    workdir = tmp_path_factory.mktemp("trained")
    loop.run(tiny_config(), workdir)
    assert checkpoint_steps(workdir) == [2, 4]
    return workdir


@pytest.fixture
def copy_of(trained, tmp_path) -> Path:
    workdir = tmp_path / "copy"
    shutil.copytree(trained, workdir)
    return workdir


def largest_state_file(step_dir: Path) -> Path:
    return max(
        (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )


def train_two_steps(config, mesh):
    """(state after 2 steps, its data streams, tokenizer) on `mesh`, through the real step."""
    plan = training_plan(config)
    layout = BatchLayout.resolve(config, plan, mesh)
    tokenizer = load_tokenizer(tokenizer_path(config.data), config.model.vocab_size)
    graphdef, state, shardings, tx = create_train_state(config, plan, mesh)
    train_step = make_train_step(graphdef, tx, shardings, mesh)
    data = loop.DataStreams(config, "train", 1, layout.rows_per_process, tokenizer)
    for _ in range(2):
        batch = sharding.global_batch(data.next_local(layout.accum), mesh, leading=1)
        state, _ = train_step(state, batch)
    return state, data, tokenizer


def test_state_and_data_round_trip_exactly_onto_other_meshes(tmp_path):
    """Saved on 1 device; restored onto 8 (2 x 2 x 2) and 2 (fsdp) with the targets' layout."""
    config = tiny_config()
    state, data, tokenizer = train_two_steps(
        config, sharding.make_mesh(config.mesh, jax.devices()[:1])
    )
    checkpoints = Checkpoints(tmp_path, keep=2)
    checkpoints.save(2, state, data, {"train": {}})
    checkpoints.wait()
    expected_next = data.next_local(1)
    saved = jax.tree.map(np.asarray, state)
    counts = [x for x in jax.tree.leaves(saved.opt_state) if x.dtype == np.int32]
    assert counts and all(int(c) == 2 for c in counts)  # Muon's and every Adam's count
    buffers = [x for x in jax.tree.leaves(saved.opt_state) if x.dtype == np.float32]
    assert np.mean([np.any(x != 0) for x in buffers]) > 0.9  # momenta, second moments
    for mesh_shape in ((2, 2, 2), (1, 2, 1)):
        config.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
        devices = jax.devices()[: int(np.prod(mesh_shape))]
        _, target, _, _ = create_train_state(
            config, training_plan(config), sharding.make_mesh(config.mesh, devices)
        )
        fresh = loop.DataStreams(config, "train", 1, 4, tokenizer)
        restored = checkpoints.restore(2, target, fresh)
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        for got, want, like in zip(
            jax.tree.leaves(restored), jax.tree.leaves(saved), jax.tree.leaves(target)
        ):
            np.testing.assert_array_equal(np.asarray(got), want)
            assert got.sharding == like.sharding and got.sharding.device_set == set(devices)
        upcoming = fresh.next_local(1)
        assert all(np.array_equal(upcoming[k], expected_next[k]) for k in expected_next)
    checkpoints.close()


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "delete"])
def test_damaged_file_is_named_with_its_step(copy_of, damage):
    step_dir = copy_of / "checkpoints" / "4"
    victim = largest_state_file(step_dir)
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-10])
    elif damage == "flip a byte":
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match=f"step 4: {re.escape(str(victim))}") as err:
        verify_manifest(step_dir, 4)
    assert err.value.step == 4 and err.value.path == victim


def test_damaged_checkpoint_stops_main_or_falls_back_when_asked(trained, copy_of):
    victim = largest_state_file(copy_of / "checkpoints" / "4")
    victim.write_bytes(victim.read_bytes()[:-10])
    named = rf"step 4: {re.escape(str(victim))}: truncated.*fallback=True"
    with pytest.raises(CheckpointError, match=named):
        loop.run(tiny_config(), copy_of)
    config = tiny_config()
    config.checkpoint.fallback = True
    final = loop.run(config, copy_of)
    assert final["step"] == STEPS
    assert list((copy_of / "checkpoints").glob("4.corrupt-*"))
    assert [(r["step"], r.get("loss")) for r in metrics(copy_of)] == [
        (r["step"], r.get("loss")) for r in metrics(trained)
    ]


def test_other_experiment_is_refused_listing_the_keys(copy_of):
    config_json = (copy_of / "config.json").read_text()
    config = tiny_config(eval_every=3)  # harmless: not listed
    config.seed = 7
    config.optim.matrix_lr = 0.03
    with pytest.raises(ConfigMismatchError) as err:
        loop.run(config, copy_of)
    message = str(err.value)
    assert "seed: 42 -> 7" in message and "optim.matrix_lr: 0.02 -> 0.03" in message
    assert "eval_every" not in message and "init_params_from" in message
    assert (copy_of / "config.json").read_text() == config_json


def test_init_params_from_takes_the_parameters_only(trained, tmp_path):
    config = tiny_config(num_steps=2)
    config.optim.matrix_lr = 0.03
    config.checkpoint.init_params_from = str(trained)
    final = loop.run(config, tmp_path)
    first = metrics(tmp_path)[0]
    assert first["step"] == 0 and final["step"] == 2
    assert first["val_bpb"] == metrics(trained)[-1]["val_bpb"]  # the step-4 parameters
    config = tiny_config()
    config.model.depth = 3
    config.checkpoint.init_params_from = str(trained / "checkpoints" / "2")
    with pytest.raises(ValueError, match=r"parameters differ(.|\n)*blocks/2/attn(.|\n)*<absent>"):
        loop.run(config, tmp_path / "deeper")


def test_records_carry_the_learned_coefficients(trained):
    """Every eval record and every log-step record (train.log_every = 1: all of them) holds
    gamma per BoV layer and smear_lambda, equal to the parameters of that step (the final
    record's to the saved step-4 parameters); they change from step to step."""
    from bov_jax.model.gpt import learned_coefficients

    records = metrics(trained)
    assert [r["step"] for r in records if "val_bpb" in r] == [0, 2, 4]
    assert [r["step"] for r in records if "coefficients" in r] == [0, 1, 2, 3, 4]
    assert all(set(r["coefficients"]) == {"gamma/1", "smear_lambda"} for r in records)
    assert records[0]["coefficients"] == {"gamma/1": 1.0, "smear_lambda": 0.0}
    gammas = [r["coefficients"]["gamma/1"] for r in records]
    # the zero-initialised output projections give gamma no gradient in step 0; from then on
    # it moves at every step, between the evals too
    assert gammas[1] == 1.0 and len(set(gammas[1:])) == 4
    config = tiny_config()
    mesh = sharding.make_mesh(config.mesh)
    _, state, _, _ = create_train_state(config, training_plan(config), mesh)
    params = load_parameters(trained / "checkpoints" / "4", state.params)
    saved = learned_coefficients(params)
    assert saved["gamma/1"] != 1.0 and saved["smear_lambda"] != 0.0  # they did train
    assert records[-1]["coefficients"] == saved
    step2 = load_parameters(trained / "checkpoints" / "2", state.params)
    assert records[2]["coefficients"] == learned_coefficients(step2)


def poison_call(bad_calls: set[int]):
    """A make_train_step whose calls with the given indices see a NaN parameter."""
    make_train_step = loop.make_train_step

    def make(*args):
        train_step = make_train_step(*args)
        calls = itertools.count()

        def step(state, batch):
            if next(calls) not in bad_calls:
                return train_step(state, batch)
            good = state.params["smear_lambda"]  # not passed to the step, so not donated
            nan = {**state.params, "smear_lambda": good * jnp.nan}
            state, out = train_step(state._replace(params=nan), batch)
            return state._replace(params={**state.params, "smear_lambda": good}), out

        return step

    return make


def test_a_step_is_checked_only_once_the_next_is_dispatched(monkeypatch, tmp_path):
    """No host round trip between steps: the loop reads a step's finiteness and loss after the
    next step is dispatched, except where the state is used at once (the save after step 3)."""
    events = []

    class Logged:
        """A step output whose every read by the host is logged."""

        def __init__(self, value: jax.Array, call: int):
            self.value, self.call = value, call

        def __bool__(self) -> bool:
            events.append(("read", self.call))
            return bool(self.value)

        def __float__(self) -> float:
            events.append(("read", self.call))
            return float(self.value)

    make_train_step = loop.make_train_step

    def make(*args):
        train_step = make_train_step(*args)
        calls = itertools.count()

        def step(state, batch):
            call = next(calls)
            events.append(("dispatch", call))
            state, out = train_step(state, batch)
            return state, {name: Logged(value, call) for name, value in out.items()}

        return step

    monkeypatch.setattr(loop, "make_train_step", make)
    config = tiny_config(num_steps=6, eval_every=100)
    config.checkpoint.save_every = 4
    final = loop.run(config, tmp_path)
    assert final["finished"] and checkpoint_steps(tmp_path) == [4, 6]
    first_read = {call: events.index(("read", call)) for call in range(6)}
    dispatched = {call: events.index(("dispatch", call)) for call in range(6)}
    for call in (0, 1, 2, 4):
        assert first_read[call] > dispatched[call + 1], events
    assert dispatched[3] < first_read[3] < dispatched[4], events  # saved before step 4 runs
    losses = [r["loss"] for r in metrics(tmp_path)[:6]]
    assert all(np.isfinite(losses)) and len(set(losses)) == 6


def test_nonfinite_step_stops_at_that_step_or_is_skipped(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(loop, "make_train_step", poison_call({3}))
    with pytest.raises(
        loop.NonFiniteLossError, match="at step 3 .*checkpoints/2, where a rerun continues"
    ):
        loop.run(tiny_config(), tmp_path)
    assert checkpoint_steps(tmp_path) == [2]
    verify_manifest(tmp_path / "checkpoints" / "2", 2)
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2]
    # Resumed with skipping allowed (a harmless key), the bad batch of step 2 is redrawn.
    monkeypatch.setattr(loop, "make_train_step", poison_call({0}))
    with caplog.at_level(logging.WARNING, logger="bov_jax"):
        final = loop.run(tiny_config(skip_nonfinite=True), tmp_path)
    assert (
        "non-finite loss, gradient or update at step 2" in caplog.text and "skipped" in caplog.text
    )
    assert final["step"] == STEPS
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in records[:STEPS])


def test_fallback_that_moved_every_checkpoint_is_not_a_fresh_start(copy_of):
    """Every checkpoint damaged: the fallback moves them aside and stops; a plain rerun is then
    refused (not a silent start from step 0 over the run's records) until start_over."""
    for step in (2, 4):
        victim = largest_state_file(copy_of / "checkpoints" / str(step))
        victim.write_bytes(victim.read_bytes()[:-10])
    records = (copy_of / "metrics.jsonl").read_text()
    config = tiny_config()
    config.checkpoint.fallback = True
    with pytest.raises(CheckpointError, match=r"no earlier checkpoint.*4\.corrupt-.*2\.corrupt-"):
        loop.run(config, copy_of)
    with pytest.raises(loop.NoUsableCheckpointError, match=r"start_over=True") as err:
        loop.run(tiny_config(), copy_of)
    assert err.value.exit_status == 1 and "4.corrupt-" in str(err.value)
    assert (copy_of / "metrics.jsonl").read_text() == records
    config = tiny_config(num_steps=2)
    config.checkpoint.start_over = True
    assert loop.run(config, copy_of)["step"] == 2
    assert [p.read_text() for p in copy_of.glob("metrics.before-*.jsonl")] == [records]
    assert [r["step"] for r in metrics(copy_of)] == [0, 1, 2]


def test_rerun_of_a_run_stopped_before_its_first_save_keeps_its_metrics(tmp_path):
    """The workdir of a run that stopped (crashed, diverged) before its first checkpoint: the
    rerun starts from step 0, says so, and keeps the earlier records beside."""
    records = "".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(3))
    (tmp_path / "metrics.jsonl").write_text(records)
    loop.run(tiny_config(num_steps=2), tmp_path)
    assert [p.read_text() for p in tmp_path.glob("metrics.before-*.jsonl")] == [records]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2]


def test_changed_width_is_another_experiment_even_when_allowed(copy_of):
    """A state of other shapes is never a damaged checkpoint: allow_changes refuses the key,
    and the shape check (from the saved metadata) would stop it anyway; nothing moves."""
    config = tiny_config()
    config.model.model_dim = 192
    config.checkpoint.update(allow_changes="model.model_dim", fallback=True)
    with pytest.raises(ConfigMismatchError, match="cannot accept model.model_dim") as err:
        loop.run(config, copy_of)
    assert err.value.exit_status == 1
    assert checkpoint_steps(copy_of) == [2, 4] and not list(copy_of.glob("checkpoints/*corrupt*"))
    checkpoints = Checkpoints(copy_of, keep=5, async_save=False)
    _, wider, _, _ = create_train_state(
        config, training_plan(config), sharding.make_mesh(config.mesh)
    )
    with pytest.raises(ConfigMismatchError, match=r"wte/embedding: \(8192, 128\) -> \(8192, 192\)"):
        checkpoints.restore(4, wider)
    checkpoints.close()
    assert checkpoint_steps(copy_of) == [2, 4]


def test_export_then_import_of_a_run_is_bit_identical(trained, tmp_path):
    """Our own run through the authors' format and back: the same weights bit for bit (fp32
    tables stay fp32), its SentencePiece tokenizer, its val BPB in meta and on evaluation."""
    from bov_jax.evals.bpb import evaluate_model
    from bov_jax.evals.loading import load_checkpoint
    from bov_jax.interop.checkpoints import export_checkpoint, import_checkpoint

    model_file = export_checkpoint(trained, tmp_path / "exported")
    meta = json.loads((tmp_path / "exported" / "meta_000004.json").read_text())
    assert meta["val_bpb"] == metrics(trained)[-1]["val_bpb"]
    assert (tmp_path / "exported" / "tokenizer.model").is_file()
    assert import_checkpoint(model_file.parent, tmp_path / "imported") == 4
    _, run_model, tokenizer, config = load_checkpoint(trained)
    _, imported, _, imported_config = load_checkpoint(tmp_path / "imported")
    assert imported_config.model.table_dtype == "float32"
    run_params = nnx.to_flat_state(nnx.state(run_model, nnx.Param))
    imported_params = dict(nnx.to_flat_state(nnx.state(imported, nnx.Param)))
    assert len(run_params) == len(imported_params)
    for path, value in run_params:
        got = np.asarray(imported_params[path].get_value())
        want = np.asarray(value.get_value())
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    bpb = [evaluate_model(m, tokenizer, config, 512, 2)["val_bpb"] for m in (run_model, imported)]
    assert bpb[0] == bpb[1] and np.isfinite(bpb[0])


def test_data_streams_cannot_be_allowed_and_the_refusal_says_so(tmp_path):
    """train.data_streams is a train.* key that allow_changes refuses (the saved data positions
    are per stream): the message says so, where it listed train.* as acceptable at 49cab77."""
    saved = {"train": {"data_streams": 1, "num_steps": 8}, "checkpoint": {}}
    current = {
        "train": {"data_streams": 2, "num_steps": 8},
        "checkpoint": {"allow_changes": "train.data_streams"},
    }
    checkpoints = Checkpoints(tmp_path, keep=1, async_save=False)
    with pytest.raises(ConfigMismatchError) as err:
        checkpoints.check_experiment(2, saved, current)
    checkpoints.close()
    assert "cannot accept train.data_streams" in str(err.value)
    assert "train.* but train.data_streams" in str(err.value)


def test_turning_the_token_cache_off_resumes():
    """data.use_cache reads the same stream (test_data_pipeline): not another experiment."""
    saved = {"data": {"use_cache": True, "shuffle": True}}
    assert experiment_differences(saved, {"data": {"use_cache": False, "shuffle": True}}) == []
    assert experiment_differences(saved, {"data": {"use_cache": True, "shuffle": False}})
