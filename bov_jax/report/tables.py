"""The report's markdown tables in the paper's layouts, from a loaded `Sweep`.

Each cell is `mean ± std (n=k)` over the finished seeds; the paired difference to the sweep's
baseline is the mean of the per-seed differences with a 95% t-interval; the paper's number is
printed beside ours where the run has a paper row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bov_jax.report.runs import Run, Sweep, coefficient_sort_key
from bov_jax.report.stats import paired_difference, summarize

CONFIDENCE = 0.95


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def paper_cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def describe_value_path(vp: dict[str, Any]) -> tuple[str, str, str]:
    """(output, target, coefficient) of a value path, in Table 1's words, for runs the paper
    does not describe."""
    if not vp:
        return "?", "?", "?"
    source = {"residual": "V", "x0": "x0WV", "v1": "V1", "bank": "E_v[i]"}[vp["source"]]
    output = source if vp["combine"] == "replace" else f"V+{source}"
    if vp["source"] == "residual" and vp["combine"] == "replace":
        target = "-" if vp["scale"] == "none" else vp["layers"]
    else:
        target = vp["layers"]
    coeff = {"none": "1", "fixed": str(vp.get("fixed_coeff")), "learned": "learned"}[vp["scale"]]
    if output == "V" and vp["scale"] == "none":
        coeff = "-"
    return output, target, coeff


def metric_cells(run: Run, baseline: Run | None, metric: str, digits: int) -> list[str]:
    """[mean ± std (n), paired difference to the baseline] of one metric."""
    values = run.finished_values(metric)
    cells = [summarize(list(values.values())).cell(digits)]
    if baseline is None or baseline is run:
        cells.append("-" if baseline is None else "(baseline)")
    else:
        base = baseline.finished_values(metric)
        cells.append(paired_difference(values, base, CONFIDENCE).cell(digits))
    return cells


def results_table(sweep: Sweep) -> str:
    """Table 1 (output / target / coefficient / val BPB) or the d24 layout (val BPB, CORE)."""
    baseline = next((r for r in sweep.runs if r.name == sweep.baseline), None)
    with_core = any(r.finished_values("core") for r in sweep.runs)
    with_paper_bpb = any("val_bpb" in r.paper for r in sweep.runs)
    with_paper_core = any("core" in r.paper for r in sweep.runs)
    header = ["Run"]
    if sweep.layout == "table1":
        header += ["Output", "Target", "Coeff."]
    header += ["val BPB", "Δ vs baseline (95% CI)"]
    if with_paper_bpb:
        header.append("paper BPB")
    if with_core:
        header += ["CORE", "Δ CORE (95% CI)"]
    if with_paper_core:
        header.append("paper CORE")
    rows = []
    for run in sweep.runs:
        row = [run.name]
        if sweep.layout == "table1":
            described = zip(("output", "target", "coeff"), describe_value_path(run.value_path))
            row += [str(run.paper.get(key, ours)) for key, ours in described]
        row += metric_cells(run, baseline, "val_bpb", 4)
        if with_paper_bpb:
            row.append(paper_cell(run.paper.get("val_bpb")))
        if with_core:
            row += metric_cells(run, baseline, "core", 4)
        if with_paper_core:
            row.append(paper_cell(run.paper.get("core")))
        rows.append(row)
    return markdown_table(header, rows)


def bpb_sources(sweep: Sweep) -> str | None:
    """Which evaluation the val BPB cells show: 'val BPB from <source>: run seed k, ...'."""
    by_source: dict[str, list[str]] = {}
    for run in sweep.runs:
        for seed, s in sorted(run.seeds.items()):
            if s.bpb_source is not None:
                by_source.setdefault(s.bpb_source, []).append(f"{run.name} seed {seed}")
    if not by_source:
        return None
    return "\n".join(f"val BPB from {k}: {', '.join(v)}." for k, v in by_source.items())


def core_tasks_table(sweep: Sweep) -> str | None:
    """Table 4: centered accuracy per CORE task (mean ± std over seeds) for runs with CORE."""
    runs = [r for r in sweep.runs if r.finished_values("core")]
    if not runs:
        return None
    tasks: list[str] = []
    for run in runs:
        for seed_run in run.seeds.values():
            for task in (seed_run.core or {}).get("centered_results", {}):
                if task not in tasks:
                    tasks.append(task)
    rows = []
    for task in [*tasks, "CORE"]:
        row = [task]
        for run in runs:
            values = [
                s.core["core_metric"] if task == "CORE" else s.core["centered_results"][task]
                for s in run.seeds.values()
                if s.finished and s.core and (task == "CORE" or task in s.core["centered_results"])
            ]
            row.append(summarize(values).cell(3))
        rows.append(row)
    limits = sorted(
        {str(s.core.get("max_per_task", "?")) for r in runs for s in r.seeds.values() if s.core}
    )
    note = f"Centered accuracy; examples per task limited to {', '.join(limits)} (-1: all)."
    return markdown_table(["Task", *(r.name for r in runs)], rows) + "\n\n" + note


def status_lines(sweep: Sweep) -> list[str]:
    """One line per seed that is missing, unfinished or has problems."""
    lines = []
    for run in sweep.runs:
        for seed in run.missing_seeds:
            lines.append(f"- {run.name} seed {seed}: missing (no workdir)")
        for seed, s in sorted(run.seeds.items()):
            if s.finished and not s.problems:
                continue
            state = "finished" if s.finished else "unfinished"
            if s.status and not s.finished:
                state += f" (step {s.status.get('step')} of {s.status.get('num_steps')})"
            latest = (
                f"; latest val BPB {s.evals[-1]['val_bpb']:.4f} at step {s.evals[-1]['step']}"
                if s.evals
                else "; no eval yet"
            )
            problems = f"; {', '.join(s.problems)}" if s.problems else ""
            lines.append(f"- {run.name} seed {seed} ({s.workdir}): {state}{latest}{problems}")
    return lines


def coefficient_table(sweep: Sweep) -> str | None:
    """Final learned coefficients (mean ± std over finished seeds) of runs that have any."""
    rows = []
    for run in sweep.runs:
        names: list[str] = []
        for s in run.seeds.values():
            names += [n for n in s.coefficients if n not in names]
        for name in sorted(names, key=coefficient_sort_key):
            values = [s.coefficients[name] for s in run.seeds.values() if name in s.coefficients]
            rows.append([run.name, name, summarize(values).cell(3)])
    return markdown_table(["Run", "Coefficient", "final value"], rows) if rows else None
