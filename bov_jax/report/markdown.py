"""The sweep report: report.md with the paper-layout tables and figures/*.png.

`write_report(sweep, out)` only reads the runs' workdirs; a partial root (runs missing,
unfinished or damaged) is reported as such, never an error.
"""

from __future__ import annotations

from pathlib import Path

from bov_jax.files import write_text_atomic
from bov_jax.report import figures, tables
from bov_jax.report.runs import Sweep

LAYOUT_TITLES = {
    "table1": "Table 1 layout (d12 value paths)",
    "d24": "d24 layout (val BPB and CORE)",
    "fig5b": "Fig. 5(b) layout (BoV component ablation)",
    "runs": "Runs",
}


def write_figures(sweep: Sweep, out: Path, with_kv_cache: bool) -> list[Path]:
    fig_dir = out / "figures"
    drawn = [
        figures.val_bpb_figure(sweep, fig_dir / "val_bpb.png"),
        figures.coefficients_figure(sweep, fig_dir / "coefficients.png"),
        figures.coefficients_trajectory_figure(sweep, fig_dir / "coefficients_trajectory.png"),
    ]
    if with_kv_cache:
        drawn.append(figures.kv_cache_figure(fig_dir / "kv_cache.png"))
    return [p for p in drawn if p is not None]


def render_report(sweep: Sweep, out: Path, figure_paths: list[Path]) -> str:
    seeds = sorted({s for r in sweep.runs for s in [*r.seeds, *r.missing_seeds]})
    parts = [
        f"# {sweep.title or sweep.name}",
        f"Root: `{sweep.root}`; {len(sweep.runs)} run(s), seeds {seeds}; baseline: "
        f"{sweep.baseline or 'none'}.",
        f"## {LAYOUT_TITLES.get(sweep.layout, sweep.layout)}",
        "Cells: mean ± sample std over the finished seeds (n = their number). Δ: the mean of the "
        "per-seed differences to the baseline (same seed), with a 95% Student-t interval; "
        "negative BPB Δ is better. The paper's numbers are single runs at the paper's scale.",
        tables.results_table(sweep),
    ]
    if sources := tables.bpb_sources(sweep):
        parts.append(sources)
    if core := tables.core_tasks_table(sweep):
        parts += ["## CORE per task (Table 4 layout)", core]
    if coefficients := tables.coefficient_table(sweep):
        parts += ["## Learned coefficients (final eval record)", coefficients]
    status = tables.status_lines(sweep)
    parts += ["## Run status", "\n".join(status) if status else "All runs finished."]
    if figure_paths:
        parts += [
            "## Figures",
            "\n\n".join(f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in figure_paths),
        ]
    return "\n\n".join(parts) + "\n"


def write_report(sweep: Sweep, out: str | Path, with_kv_cache: bool = True) -> Path:
    """Write out/report.md and out/figures/*.png; returns the report's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figure_paths = write_figures(sweep, out, with_kv_cache)
    path = out / "report.md"
    write_text_atomic(path, render_report(sweep, out, figure_paths))
    return path
