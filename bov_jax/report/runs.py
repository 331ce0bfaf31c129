"""Read a sweep root (or one workdir) into runs and seeds, tolerating anything partial.

A root holds `sweep.json` (written by the sweep command: the runs its invocations selected,
their workdirs `ROOT/<run>/seed<k>/`, the invocations and the runs none selected) or, without
it, run workdirs from which the runs are inferred. A workdir holds config.json, metrics.jsonl
(one JSON record per line; eval records carry `val_bpb`, eval and log-step records
`coefficients`), status.json ({"step", "num_steps"}), evals/core_step<N>.json and
evals/bpb_step<N>.json (the full-split val BPB of `python -m bov_jax.evals.bpb`). Whatever is
missing or damaged is noted in `SeedRun.problems` and the rest is still read.
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
    # (step, {name: value}) of every record with coefficients (eval and log steps), by step
    coefficient_history: list[tuple[int, dict[str, float]]] = dataclasses.field(
        default_factory=list
    )
    status: dict[str, Any] | None = None
    core: dict[str, Any] | None = None  # the latest evals/core_step<N>.json
    bpb_file: dict[str, Any] | None = None  # evals/bpb_step<N>.json at the end, when preferred
    flops_per_step: float | None = None
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        s = self.status
        return bool(s) and s.get("step", -1) >= s.get("num_steps", math.inf)

    @property
    def final_bpb(self) -> float | None:
        """Val BPB at the final step of a finished run (None if unfinished or not evaluated):
        the full-split evals/bpb_step<N>.json where `prefer_full_split_bpb` found one, else
        the in-training eval of metrics.jsonl."""
        if not self.finished:
            return None
        if self.bpb_file is not None:
            return float(self.bpb_file["val_bpb"])
        if not self.evals:
            return None
        last = self.evals[-1]
        return last["val_bpb"] if last["step"] >= self.status["num_steps"] else None

    @property
    def bpb_source(self) -> str:
        """Where `final_bpb` comes from, in words."""
        if self.bpb_file is not None:
            tokens = self.bpb_file.get("tokens")
            size = f", {tokens:,} tokens" if isinstance(tokens, int) else ""
            return f"evals/bpb_step{self.bpb_file.get('step')}.json (full val split{size})"
        tokens = ((self.config or {}).get("train") or {}).get("eval_tokens")
        size = f", train.eval_tokens = {tokens:,}" if isinstance(tokens, int) else ""
        return f"metrics.jsonl (the in-training eval at the final step{size})"

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients of the last record that has them."""
        return self.coefficient_history[-1][1] if self.coefficient_history else {}


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
    root: Path  # as the user named it
    name: str
    title: str
    layout: str  # "table1", "d24", "fig5b" or "runs" (inferred)
    baseline: str | None
    runs: list[Run]
    invocations: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # sweep.json's
    left_out: list[str] = dataclasses.field(default_factory=list)  # runs no invocation selected


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


def read_metrics(path: Path, problems: list[str]) -> tuple[list[dict], list[tuple[int, dict]]]:
    """metrics.jsonl's eval records (a finite val_bpb; one per step, the last wins) and its
    (step, coefficients) history, both by step."""
    if not path.is_file():
        problems.append("no metrics.jsonl")
        return [], []
    evals: dict[int, dict[str, Any]] = {}
    coefficients: dict[int, dict[str, float]] = {}
    bad, non_finite = 0, []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
            step = int(record["step"])
            bpb = float(record["val_bpb"]) if "val_bpb" in record else None
        except (ValueError, TypeError, KeyError):  # not UTF-8, not JSON, not a number
            bad += 1
            continue
        if isinstance(record.get("coefficients"), dict) and record["coefficients"]:
            coefficients[step] = record["coefficients"]
        if bpb is None:
            continue  # a training record without an eval
        if math.isfinite(bpb):
            evals[step] = record
        else:
            non_finite.append(step)
    if bad:
        problems.append(f"{bad} unreadable line(s) in metrics.jsonl")
    if non_finite:
        problems.append(f"non-finite val BPB at step(s) {non_finite}")
    return [evals[s] for s in sorted(evals)], sorted(coefficients.items())


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
    run.evals, run.coefficient_history = read_metrics(workdir / "metrics.jsonl", run.problems)
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
    """The runs sweep.json lists. A run whose `workdirs` is empty was never selected (left out
    by --only); a hand-written entry without `workdirs` takes ROOT/<run>/seed<k> for `seeds`."""
    path = root / "sweep.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        planned, left_out = [], list(spec.get("left_out", []))
        for entry in spec["runs"]:
            if "workdirs" in entry:
                workdirs = {int(k): v for k, v in entry["workdirs"].items()}
            else:
                workdirs = {int(s): f"{entry['name']}/seed{s}" for s in spec.get("seeds", [])}
            if not workdirs:
                left_out.append(entry["name"])
                continue
            run = Run(entry["name"], entry.get("config", ""), entry.get("paper") or {})
            planned.append((run, sorted((seed, root / rel) for seed, rel in workdirs.items())))
        invocations = list(spec.get("invocations", []))
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
        invocations=invocations,
        left_out=left_out,
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


def prefer_full_split_bpb(run: SeedRun) -> None:
    """Take a finished run's final val BPB from evals/bpb_step<N>.json at its final step N (a
    full pass of the val split) instead of the in-training eval, where that file exists."""
    if not run.finished:
        return
    path = run.workdir / "evals" / f"bpb_step{run.status['step']}.json"
    if not path.is_file():
        return
    payload = read_json(path, run.problems)
    try:
        if math.isfinite(float(payload["val_bpb"])):
            run.bpb_file = payload
            return
    except (TypeError, KeyError, ValueError):
        pass
    run.problems.append(f"{path.name} holds no finite val_bpb")


def single_run(workdir: str | Path) -> Sweep:
    """One workdir as a sweep of one run and one seed (the config's seed)."""
    workdir = Path(workdir)
    if not (workdir / "config.json").is_file():
        raise UserError(f"--workdir={workdir}: no config.json; is it a bov_jax workdir?")
    seed_run = read_seed_run(workdir, 0)
    prefer_full_split_bpb(seed_run)
    seed_run.seed = int((seed_run.config or {}).get("seed", 0))
    name = (seed_run.config or {}).get("name") or workdir.name
    run = Run(name, seeds={seed_run.seed: seed_run})
    return Sweep(workdir, name, "", "runs", None, [run])


def coefficient_sort_key(name: str) -> tuple[str, float]:
    """`gamma/10` after `gamma/9`; names without a layer first."""
    kind, _, layer = name.partition("/")
    return kind, float(layer) if layer.isdigit() else -math.inf
