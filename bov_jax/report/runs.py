"""Read a sweep root (or one workdir) into runs and seeds, tolerating anything partial.

A root holds `sweep.json` (written by the sweep command) and run workdirs `ROOT/<run>/seed<k>/`;
without sweep.json the runs are inferred from those directories. A workdir holds config.json,
metrics.jsonl (one JSON record per line; eval records carry `val_bpb` and `coefficients`),
status.json ({"step", "num_steps"}) and evals/core_step<N>.json. Whatever is missing or
damaged is noted in `SeedRun.problems` and the rest is still read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from bov_jax.errors import UserError

SEED_DIR = re.compile(r"seed(\d+)$")
CORE_FILE = re.compile(r"core_step(\d+)\.json$")
BASELINE_VALUE_PATH = {"source": "residual", "combine": "replace", "scale": "none"}


@dataclasses.dataclass
class SeedRun:
    """One training run (one seed of a named run) as read from its workdir."""

    seed: int
    workdir: Path
    config: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # by step
    status: dict[str, Any] | None = None
    core: dict[str, Any] | None = None  # the latest evals/core_step<N>.json
    flops_per_step: float | None = None
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        s = self.status
        return bool(s) and s.get("step", -1) >= s.get("num_steps", math.inf)

    @property
    def final_bpb(self) -> float | None:
        """Val BPB at the final step of a finished run (None if unfinished or not evaluated)."""
        if not self.finished or not self.evals:
            return None
        last = self.evals[-1]
        return last["val_bpb"] if last["step"] >= self.status["num_steps"] else None

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients of the last eval record that has them."""
        for record in reversed(self.evals):
            if record.get("coefficients"):
                return record["coefficients"]
        return {}


@dataclasses.dataclass
class Run:
    """A named run of a sweep: its seeds, and the paper's numbers for it if any."""

    name: str
    config_ref: str = ""
    paper: dict[str, Any] = dataclasses.field(default_factory=dict)
    seeds: dict[int, SeedRun] = dataclasses.field(default_factory=dict)
    missing_seeds: list[int] = dataclasses.field(default_factory=list)

    def finished_values(self, metric: str) -> dict[int, float]:
        """{seed: value} of the finished seeds: metric "val_bpb" or "core"."""
        out = {}
        for seed, run in self.seeds.items():
            if metric == "val_bpb" and run.final_bpb is not None:
                out[seed] = run.final_bpb
            elif metric == "core" and run.core is not None and run.finished:
                out[seed] = run.core["core_metric"]
        return out

    @property
    def value_path(self) -> dict[str, Any]:
        for run in self.seeds.values():
            if run.config:
                return run.config.get("model", {}).get("value_path", {})
        return {}


@dataclasses.dataclass
class Sweep:
    root: Path
    name: str
    title: str
    layout: str  # "table1", "d24", "fig5b" or "runs" (inferred)
    baseline: str | None
    runs: list[Run]


def read_json(path: Path, problems: list[str]) -> Any:
    """The JSON in `path`, or None with a note in `problems`."""
    if not path.is_file():
        problems.append(f"no {path.name}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        problems.append(f"unreadable {path.name} ({err})")
        return None


def read_eval_records(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    """metrics.jsonl's records with a finite val_bpb, one per step (the last wins), by step."""
    if not path.is_file():
        problems.append("no metrics.jsonl")
        return []
    by_step: dict[int, dict[str, Any]] = {}
    bad, non_finite = 0, []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
            step, bpb = int(record["step"]), float(record["val_bpb"])
        except KeyError:
            continue  # a training record without an eval
        except (ValueError, TypeError):  # not UTF-8, not JSON, not a number
            bad += 1
            continue
        if math.isfinite(bpb):
            by_step[step] = record
        else:
            non_finite.append(step)
    if bad:
        problems.append(f"{bad} unreadable line(s) in metrics.jsonl")
    if non_finite:
        problems.append(f"non-finite val BPB at step(s) {non_finite}")
    return [by_step[s] for s in sorted(by_step)]


def latest_core(workdir: Path, problems: list[str]) -> dict[str, Any] | None:
    """The evals/core_step<N>.json of the largest N, if any."""
    files = [
        (int(m.group(1)), p)
        for p in (workdir / "evals").glob("core_step*.json")
        if (m := CORE_FILE.search(p.name))
    ]
    if not files:
        return None
    return read_json(max(files)[1], problems)


def flops_per_step(config: dict[str, Any] | None) -> float | None:
    """Training FLOPs of one optimizer step, or None if the config cannot be planned."""
    if config is None:
        return None
    from bov_jax.accounting import training_plan
    from bov_jax.config import config_from_record

    try:
        plan = training_plan(config_from_record(config))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return float(plan.flops_per_token) * plan.total_batch_tokens


def read_seed_run(workdir: Path, seed: int) -> SeedRun:
    run = SeedRun(seed=seed, workdir=workdir)
    if not workdir.is_dir():
        run.problems.append("workdir missing")
        return run
    run.config = read_json(workdir / "config.json", run.problems)
    run.evals = read_eval_records(workdir / "metrics.jsonl", run.problems)
    run.status = read_json(workdir / "status.json", run.problems)
    if run.finished and run.final_bpb is None:
        run.problems.append("no val BPB at the final step")
    run.core = latest_core(workdir, run.problems)
    run.flops_per_step = flops_per_step(run.config)
    return run


def is_baseline(value_path: dict[str, Any]) -> bool:
    return all(value_path.get(k) == v for k, v in BASELINE_VALUE_PATH.items())


def load_sweep(root: str | Path) -> Sweep:
    """The sweep under `root`, from sweep.json or inferred from `<run>/seed<k>/` directories."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--root={root}: not a directory")
    if (root / "sweep.json").is_file():
        return sweep_from_file(root)
    return infer_sweep(root)


def sweep_from_file(root: Path) -> Sweep:
    path = root / "sweep.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        planned = []
        for entry in spec["runs"]:
            workdirs = {int(k): v for k, v in entry.get("workdirs", {}).items()}
            seeds = workdirs or {int(s): f"{entry['name']}/seed{s}" for s in spec.get("seeds", [])}
            run = Run(entry["name"], entry.get("config", ""), entry.get("paper") or {})
            planned.append((run, sorted((seed, root / rel) for seed, rel in seeds.items())))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(
            f"{path}: not a sweep description ({type(err).__name__}: {err}); expected "
            '{"sweep", "layout", "baseline", "seeds", "runs": [{"name", ...}]}'
        ) from err
    runs = []
    for run, seeds in planned:  # a run's own files are the run's problems, not sweep.json's
        for seed, workdir in seeds:
            if workdir.is_dir():
                run.seeds[seed] = read_seed_run(workdir, seed)
            else:
                run.missing_seeds.append(seed)
        runs.append(run)
    return Sweep(
        root=root,
        name=spec.get("sweep", root.name),
        title=spec.get("title", ""),
        layout=spec.get("layout", "runs"),
        baseline=spec.get("baseline"),
        runs=runs,
    )


def infer_sweep(root: Path) -> Sweep:
    runs = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        seed_dirs = sorted(
            (int(m.group(1)), p) for p in run_dir.iterdir() if (m := SEED_DIR.match(p.name))
        )
        if seed_dirs:
            run = Run(run_dir.name)
            run.seeds = {seed: read_seed_run(path, seed) for seed, path in seed_dirs}
            runs.append(run)
    if not runs:
        raise UserError(f"--root={root}: no sweep.json and no <run>/seed<k>/ workdirs")
    baseline = next((r.name for r in runs if r.value_path and is_baseline(r.value_path)), None)
    return Sweep(root, root.name, "", "runs", baseline, runs)


def single_run(workdir: str | Path) -> Sweep:
    """One workdir as a sweep of one run and one seed (the config's seed)."""
    workdir = Path(workdir)
    if not (workdir / "config.json").is_file():
        raise UserError(f"--workdir={workdir}: no config.json; is it a bov_jax workdir?")
    seed_run = read_seed_run(workdir, 0)
    seed_run.seed = int((seed_run.config or {}).get("seed", 0))
    name = (seed_run.config or {}).get("name") or workdir.name
    run = Run(name, seeds={seed_run.seed: seed_run})
    return Sweep(workdir, name, "", "runs", None, [run])


def coefficient_sort_key(name: str) -> tuple[str, float]:
    """`gamma/10` after `gamma/9`; names without a layer first."""
    kind, _, layer = name.partition("/")
    return kind, float(layer) if layer.isdigit() else -math.inf
