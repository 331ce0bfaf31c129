"""The sweep report on hand-made roots: statistics, partial roots, figures."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from helpers import tiny_config

from bov_jax.errors import UserError
from bov_jax.report import plot_data, stats
from bov_jax.report.markdown import write_report
from bov_jax.report.runs import load_sweep, single_run

BASE_BPB = {0: 1.0, 1: 1.2, 2: 1.1}  # mean 1.1, std 0.1
BOV_BPB = {0: 0.9, 1: 1.0, 2: 1.05}  # differences -0.1, -0.2, -0.05


def config_json(preset: str, seed: int) -> dict:
    config = tiny_config(preset)
    config.seed = seed
    config.train.num_steps = 20
    config.train.total_batch_tokens = 4 * 64
    config.train.device_batch_size = 4
    return json.loads(config.to_json_best_effort())


def coefficients_at(step: int, preset: str) -> dict[str, float]:
    coefficients = {"smear_lambda": 0.1 * step}
    if preset == "d12_bov":
        coefficients |= {f"gamma/{layer}": 1.0 + 0.01 * step * layer for layer in (8, 9, 10, 11)}
    return coefficients


def write_seed(workdir: Path, preset: str, seed: int, final_bpb: float, steps: int = 20) -> None:
    """A finished run: evals at 0, 10 and 20 (the final one), training records in between,
    the coefficients in every record (train.log_every = 1)."""
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps(config_json(preset, seed)))
    lines = []
    for step in range(steps + 1):
        record = {"step": step, "loss": 3.0 - 0.01 * step} if step < steps else {"step": step}
        record["coefficients"] = coefficients_at(step, preset)
        if step % 10 == 0:
            record["val_bpb"] = final_bpb if step == steps else final_bpb + 1.0 - step / steps
        lines.append(json.dumps(record))
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (workdir / "status.json").write_text(json.dumps({"step": steps, "num_steps": steps}))


def write_core(workdir: Path, step: int, centered: dict[str, float]) -> None:
    (workdir / "evals").mkdir(exist_ok=True)
    payload = {
        "step": step,
        "max_per_task": 8,
        "centered_results": centered,
        "results": centered,
        "core_metric": sum(centered.values()) / len(centered),
    }
    (workdir / "evals" / f"core_step{step}.json").write_text(json.dumps(payload))


def make_root(root: Path, with_sweep_json: bool = True) -> Path:
    runs = {"base": ("d12", BASE_BPB), "bov": ("d12_bov", BOV_BPB)}
    for name, (preset, bpbs) in runs.items():
        for seed, bpb in bpbs.items():
            write_seed(root / name / f"seed{seed}", preset, seed, bpb)
    if with_sweep_json:
        sweep = {
            "sweep": "hand",
            "title": "Hand-made sweep",
            "layout": "table1",
            "baseline": "base",
            "seeds": [0, 1, 2],
            "runs": [
                {
                    "name": "base",
                    "config": "x",
                    "overrides": {},
                    "paper": {"output": "V", "target": "-", "coeff": "-", "val_bpb": 0.854},
                },
                {"name": "bov", "config": "y", "overrides": {}, "paper": {}},
            ],
        }
        (root / "sweep.json").write_text(json.dumps(sweep))
    return root


def test_t_quantiles_match_known_values():
    expected = {1: 12.7062, 2: 4.3027, 4: 2.7764, 10: 2.2281, 30: 2.0423}
    for df, t in expected.items():
        assert stats.t_quantile(0.95, df) == pytest.approx(t, abs=1e-4)
    assert stats.t_central_probability(stats.t_quantile(0.9, 7), 7) == pytest.approx(0.9)


def test_summary_and_paired_difference_by_hand():
    s = stats.summarize(list(BASE_BPB.values()))
    assert (s.mean, s.std, s.n) == (pytest.approx(1.1), pytest.approx(0.1), 3)
    d = stats.paired_difference(BOV_BPB, BASE_BPB)
    diffs = [-0.1, -0.2, -0.05]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    half = 4.302653 * std / math.sqrt(3)
    assert d.n == 3
    assert d.mean == pytest.approx(mean)
    assert d.low == pytest.approx(mean - half, abs=1e-6)
    assert d.high == pytest.approx(mean + half, abs=1e-6)
    only_shared = stats.paired_difference({0: 2.0, 5: 9.0}, {0: 1.5, 1: 0.0})
    assert (only_shared.mean, only_shared.n) == (0.5, 1) and math.isnan(only_shared.low)


def test_report_tables_on_a_hand_made_root(tmp_path):
    root = make_root(tmp_path / "root")
    write_core(root / "base" / "seed0", 20, {"copa": 0.2, "piqa": 0.4})
    write_core(root / "base" / "seed1", 20, {"copa": 0.4, "piqa": 0.2})
    write_core(root / "base" / "seed1", 10, {"copa": 9.0, "piqa": 9.0})  # older, ignored
    report = write_report(load_sweep(root), root, with_kv_cache=False).read_text()
    assert "| base | V | - | - | 1.1000 ± 0.1000 (n=3) | (baseline) | 0.854 |" in report
    assert "-0.1167 [-0.3064, +0.0731] (n=3)" in report  # mean -0.11667, half-width 0.18973
    assert "0.9833 ± 0.0764 (n=3)" in report
    assert "| copa | 0.300 ± 0.141 (n=2) |" in report
    assert "| CORE | 0.300 ± 0.000 (n=2) |" in report
    assert "| bov | gamma/11 | 3.200 ± 0.000 (n=3) |" in report
    assert "All runs finished." in report
    for name in ("val_bpb", "paired", "coefficients", "coefficients_trajectory"):
        image = matplotlib.image.imread(root / "figures" / f"{name}.png")
        assert image.ndim == 3 and min(image.shape[:2]) > 100


def test_partial_root_is_reported_not_fatal(tmp_path):
    root = make_root(tmp_path / "root")
    (root / "base" / "seed2" / "metrics.jsonl").unlink()
    with (root / "bov" / "seed1" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 21, "val_b')  # a line cut short by a killed process
    (root / "bov" / "seed2" / "status.json").write_text('{"step": 10, "num_steps": 20}')
    (root / "base" / "seed1" / "metrics.jsonl").write_text(
        '{"step": 0, "val_bpb": 3.0}\n{"step": 10, "val_bpb": NaN}\n'
    )  # finished, but diverged: its last eval is not a final BPB

    shutil.rmtree(root / "bov" / "seed0")
    report = write_report(load_sweep(root), root, with_kv_cache=False).read_text()
    assert "| base | V | - | - | 1.0000 (n=1) |" in report
    assert "non-finite val BPB at step(s) [10], no val BPB at the final step" in report
    assert "- bov seed 0: missing (no workdir)" in report
    assert "base seed 2" in report and "no metrics.jsonl" in report
    assert "1 unreadable line(s) in metrics.jsonl" in report
    assert "bov seed 2" in report and "unfinished (step 10 of 20)" in report
    assert "1.0000 (n=1)" in report  # bov: only seed 1 is finished and readable
    assert "-0.2000 (n=1)" not in report  # base seed 1 has no final BPB to pair with
    assert "| bov | E_v[i] | last_third | learned | 1.0000 (n=1) | - |" in report


def test_inferred_root_and_single_run(tmp_path):
    root = make_root(tmp_path / "root", with_sweep_json=False)
    sweep = load_sweep(root)
    assert sweep.baseline == "base" and [r.name for r in sweep.runs] == ["base", "bov"]
    run = single_run(root / "bov" / "seed1")
    report = write_report(run, tmp_path / "one", with_kv_cache=False).read_text()
    assert "1.0000 (n=1)" in report
    assert (tmp_path / "one" / "figures" / "coefficients.png").is_file()
    with pytest.raises(UserError, match="no sweep.json and no"):
        load_sweep(tmp_path / "one")


def test_kv_cache_figure_data_and_png(tmp_path):
    """Eq. 6 at d24 for both vocabularies; the small model's measured points on that curve
    (just below: the token ids); the points under the floor flagged as clipped."""
    from bov_jax.report.figures import kv_cache_figure

    points = [2**11, 2**14, 2**17, 2**20]
    curves = plot_data.kv_cache_curves([2**20], points, floor=-60.0)
    assert [c.vocab for c in curves] == [32768, 151936]
    for c in curves:
        assert c.fraction[0] == pytest.approx(100 / 6 * (1 - c.vocab / 2**20))
        gap = c.eq6_at_points - c.measured
        assert np.all(gap > 0) and np.all(gap < 0.1)
        assert list(c.clipped) == list(c.measured < -60.0)
    assert [list(c.clipped) for c in curves] == [
        [True, False, False, False],  # 32,768 at 2K: -250%
        [True, True, False, False],  # 151,936 at 2K and 16K: -1220%, -138%
    ]
    assert set(plot_data.VOCAB_NAMES) == {c.vocab for c in curves}
    path = kv_cache_figure(tmp_path / "kv_cache.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape[1] > 400


def test_figure_data_is_the_tables_statistic(tmp_path):
    """Coefficient bars: integer layers, the table's mean and sample std; trajectories: every
    record's coefficients; the paired figure: the per-seed differences and the Δ column."""
    sweep = load_sweep(make_root(tmp_path / "root"))
    bov = next(r for r in sweep.runs if r.name == "bov")
    (gamma,) = plot_data.final_coefficients(sweep, "gamma").values()
    assert gamma.layers.tolist() == [8, 9, 10, 11] and gamma.layers.dtype.kind == "i"
    assert gamma.mean.tolist() == pytest.approx([1 + 0.2 * i for i in (8, 9, 10, 11)])
    assert gamma.std.tolist() == pytest.approx([0.0] * 4) and gamma.n.tolist() == [3] * 4
    series = plot_data.coefficient_series(bov)
    assert list(series) == ["gamma/8", "gamma/9", "gamma/10", "gamma/11", "smear_lambda"]
    assert series["gamma/10"].steps.tolist() == list(range(21))  # not only the 3 evals
    assert series["gamma/10"].mean[5] == pytest.approx(1.5)
    bpb = plot_data.bpb_series(bov)
    assert bpb.steps.tolist() == [0, 10, 20]
    assert bpb.std[-1] == pytest.approx(stats.summarize(list(BOV_BPB.values())).std)
    (paired,) = plot_data.paired_runs(sweep)
    assert paired.name == "bov"
    assert paired.diffs == pytest.approx({0: -0.1, 1: -0.2, 2: -0.05})
    assert paired.summary == stats.paired_difference(BOV_BPB, BASE_BPB)
    assert not paired.summary.excludes_zero  # [-0.3064, +0.0731]
    assert stats.paired_difference({0: 1.0, 1: 1.1}, {0: 1.5, 1: 1.55}).excludes_zero


def test_report_of_a_sweep_run_with_only_seeds_and_overrides(tmp_path, monkeypatch):
    """A root as `sweep --only=d12,d12_bov --seeds=3 --override=train.num_steps=20` leaves it:
    the title, the counts and the commands say what ran, the left-out runs are not missing,
    and the absolute root is shown relative to the working directory."""
    from bov_jax.sweep import jobs as sweeps

    root = tmp_path / "root"
    sweep = sweeps.load_sweep(Path(__file__).resolve().parents[1] / "configs/sweeps/table1_cpu.py")
    only, overrides = ["d12", "d12_bov"], ["train.num_steps=20"]
    jobs = sweeps.expand(sweep, root, 3, only, overrides)
    record = sweeps.write_sweep_record(
        sweep, root, jobs, sweeps.invocation_record(only, 3, overrides)
    )
    for preset, bpbs in (("d12", BASE_BPB), ("d12_bov", BOV_BPB)):
        for seed, bpb in bpbs.items():
            write_seed(root / preset / f"seed{seed}", preset, seed, bpb)
    monkeypatch.chdir(tmp_path)
    report = write_report(load_sweep(root), root, with_kv_cache=False).read_text()
    assert report.startswith(f"# {record['title']}\n")
    assert "20 steps" in record["title"] and "120" not in report.splitlines()[0]
    assert "Root: `root`; 6 workdirs (2 runs x seeds [0, 1, 2]); baseline: d12." in report
    assert "`--only=d12,d12_bov --seeds=3 --override=train.num_steps=20`" in report
    assert "Not run (no invocation selected them): d12_v_learn, d12_v1_every_layer," in report
    assert "missing" not in report and str(tmp_path) not in report
    results = report.split("## Learned coefficients")[0].splitlines()
    assert [line.split(" |")[0] for line in results if line.startswith("| d12")] == [
        "| d12",
        "| d12_bov",
    ]
    assert "metrics.jsonl (the in-training eval at the final step" in report
    shutil.rmtree(root / "d12_bov" / "seed2")
    report = write_report(load_sweep(root), root, with_kv_cache=False).read_text()
    assert "5 of 6 workdirs (2 runs x seeds [0, 1, 2])" in report
    assert "- d12_bov seed 2: missing (no workdir)" in report
    assert report.count("missing") == 1


def test_single_run_prefers_the_full_split_bpb(tmp_path):
    """report --workdir takes evals/bpb_step<N>.json at the final step and says so; a file of
    another step, or without a finite val_bpb, leaves the in-training eval."""
    workdir = tmp_path / "run"
    write_seed(workdir, "d12", 0, 1.25)
    (workdir / "evals").mkdir()
    (workdir / "evals" / "bpb_step10.json").write_text('{"step": 10, "val_bpb": 0.5}')
    run = single_run(workdir)
    assert run.runs[0].finished_values("val_bpb") == {0: 1.25}
    assert "metrics.jsonl" in run.runs[0].seeds[0].bpb_source
    full = {"step": 20, "val_bpb": 1.125, "tokens": 123456}
    (workdir / "evals" / "bpb_step20.json").write_text(json.dumps(full))
    report = write_report(single_run(workdir), tmp_path / "out", with_kv_cache=False).read_text()
    assert "1.1250 (n=1)" in report
    assert "Final val BPB from evals/bpb_step20.json (full val split, 123,456 tokens)." in report
    (workdir / "evals" / "bpb_step20.json").write_text('{"step": 20, "val_bpb": NaN}')
    seed = single_run(workdir).runs[0].seeds[0]
    assert seed.final_bpb == 1.25 and "bpb_step20.json holds no finite val_bpb" in seed.problems


def test_report_command(tmp_path):
    root = make_root(tmp_path / "root")
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def report(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "bov_jax.report", *args]
        return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)

    done = report(f"--root={root}", f"--out={tmp_path / 'out'}", "--nokv_cache")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(n=3)" in (tmp_path / "out" / "report.md").read_text()
    bad = report(f"--root={tmp_path / 'nowhere'}")
    assert (
        bad.returncode == 2 and "error: --root=" in bad.stderr and "not a directory" in bad.stderr
    )


def test_metrics_line_that_is_not_utf8_is_counted_not_blamed_on_sweep_json(tmp_path):
    root = make_root(tmp_path / "root")
    with (root / "bov" / "seed1" / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 21, "note": "\xff\xfe"}\n')
    report = write_report(load_sweep(root), root, with_kv_cache=False).read_text()
    assert "bov seed 1" in report and "1 unreadable line(s) in metrics.jsonl" in report
    assert "0.9833 ± 0.0764 (n=3)" in report  # the run's readable records still count
