"""Eval results written into a run: CORE at the end of training, the BPB command's file, the
final sample, and the values analysis on the trained checkpoint (one tiny in-process run)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import matplotlib.image
import pytest
from helpers import meshes_on_one_device

from bov_jax.analysis.values import analyze_values
from bov_jax.evals import bpb, core
from bov_jax.report.markdown import write_report
from bov_jax.report.runs import single_run
from bov_jax.train import loop
from configs import quickstart

BUNDLE = Path(__file__).parent / "data" / "core" / "bundle"
STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A finished 2-step BoV run (depth 3: layer 2 is the bank layer) with train.core_at_end=2;
    returns the workdir and the run's log."""
    config = quickstart.get_config()
    config.model.update(depth=3, model_dim=128, head_dim=64, seq_len=128)
    config.mesh.update(data=1, fsdp=1, tensor=1)
    config.train.update(
        num_steps=STEPS,
        total_batch_tokens=512,
        device_batch_size=4,
        eval_every=2,
        eval_tokens=512,
        sample_tokens=4,
        core_at_end=2,
    )
    assert config.train.sample_every > STEPS
    workdir = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    mp.setattr(core, "DEFAULT_BUNDLE_DIR", BUNDLE)
    handler = logging.Handler()
    records: list[str] = []
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("bov_jax").addHandler(handler)
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    try:
        with meshes_on_one_device():
            loop.run(config, workdir)
    finally:
        logging.getLogger("bov_jax").removeHandler(handler)
        mp.undo()
    return workdir, "\n".join(records)


def test_core_at_end_writes_the_run_result(trained):
    workdir, log = trained
    saved = json.loads((workdir / "evals" / f"core_step{STEPS}.json").read_text())
    assert saved["step"] == STEPS and saved["max_per_task"] == 2
    assert saved["num_examples"] == {"copa": 2, "lambada_openai": 2, "winograd": 2}
    assert math.isfinite(saved["core_metric"]) and saved["num_tasks"] == 3
    assert "CORE examples: 6/6 (100%)" in log


def test_short_run_logs_a_sample_at_the_end(trained):
    _, log = trained
    assert log.count("sample: ") == 1


def test_bpb_command_writes_its_result(trained):
    workdir, _ = trained
    result = bpb.evaluate_workdir(workdir, eval_tokens=512, batch_rows=4)
    saved = json.loads((workdir / "evals" / f"bpb_step{STEPS}.json").read_text())
    assert saved == result and saved["tokens"] == 512 and not saved["capped_at_one_pass"]
    final = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert saved["val_bpb"] == pytest.approx(final[-1]["val_bpb"], rel=1e-4)  # same val batch


def test_values_analysis_of_the_trained_run(trained):
    workdir, _ = trained
    path = analyze_values(workdir, tokens=256, rows=2, step=None)
    result = json.loads(path.read_text())
    assert [row["target"] for row in result["layers"]] == [False, False, True]
    assert result["layers"][2]["values"] == 1.0  # BoV: the bank values depend on the id alone
    assert result["layers"][1]["values"] < 1.0 and result["tokens"] == 256
    assert matplotlib.image.imread(path.with_suffix(".png")).ndim == 3


def test_report_of_one_run(trained, tmp_path):
    workdir, _ = trained
    report = write_report(single_run(workdir), tmp_path).read_text()
    assert "(n=1)" in report and "All runs finished." in report
    assert matplotlib.image.imread(tmp_path / "figures" / "val_bpb.png").ndim == 3
