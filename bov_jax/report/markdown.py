"""The sweep report: report.md with the paper-layout tables and figures/*.png.

`write_report(sweep, out)` only reads the runs' workdirs; a partial root (runs missing,
unfinished or damaged) is reported as such, never an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bov_jax.files import write_text_atomic
from bov_jax.report import figures, tables
from bov_jax.report.runs import Sweep

LAYOUT_TITLES = {
    "table1": "Table 1 layout (d12 value paths)",
    "d24": "d24 layout (val BPB and CORE)",
    "fig5b": "Fig. 5(b) layout (BoV component ablation)",
    "runs": "Runs",
}


CAPTIONS = {
    "val_bpb": "Val BPB of the in-training evals (metrics.jsonl) over training: the mean over "
    "seeds, the band ± the sample std (two or more seeds).",
    "paired": "Final val BPB minus the baseline's, seed by seed (dots), with their mean and 95% "
    "Student-t interval (the table's Δ column); below 0: better than the baseline.",
    "coefficients": "Learned coefficients per layer (0-based) at the final step: the mean over "
    "seeds, error bars ± the sample std, the statistic of the coefficient table.",
    "coefficients_trajectory": "Every learned coefficient at every record that holds it (each "
    "eval and log step): the mean over seeds, the band ± the sample std.",
    "kv_cache": "Fig. 5(a): the K+V cache fraction BoV saves (bank bytes subtracted), Eq. 6 at "
    "d24 for the paper's vocabularies (32,768: nanochat's; 151,936: Qwen3's, drawn from Eq. 6 "
    "only), and the fraction measured on a small model's cache arrays, which falls on the d24 "
    "curve because Eq. 6's fraction depends only on n_t/L = 1/3 and |V|/T. Open triangles: "
    "measured points below the axis, with their value.",
}


def write_figures(sweep: Sweep, out: Path, with_kv_cache: bool) -> list[Path]:
    fig_dir = out / "figures"
    drawn = [
        figures.val_bpb_figure(sweep, fig_dir / "val_bpb.png"),
        figures.paired_figure(sweep, fig_dir / "paired.png"),
        figures.coefficients_figure(sweep, fig_dir / "coefficients.png"),
        figures.coefficients_trajectory_figure(sweep, fig_dir / "coefficients_trajectory.png"),
    ]
    if with_kv_cache:
        drawn.append(figures.kv_cache_figure(fig_dir / "kv_cache.png"))
    return [p for p in drawn if p is not None]


def shown_root(root: Path) -> str:
    """The root as the user named it; an absolute one relative to the working directory, so
    that a committed report names no folder of the machine that wrote it."""
    return (Path(os.path.relpath(root)) if root.is_absolute() else root).as_posix()


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def run_count(sweep: Sweep) -> str:
    """'15 workdirs (5 runs x seeds [0, 1, 2])', or 'k of n' when some are missing."""
    present = sum(len(r.seeds) for r in sweep.runs)
    planned = present + sum(len(r.missing_seeds) for r in sweep.runs)
    seed_sets = {tuple(sorted([*r.seeds, *r.missing_seeds])) for r in sweep.runs}
    runs = plural(len(sweep.runs), "run")
    if len(seed_sets) == 1:
        shape = f"{runs} x seeds {list(seed_sets.pop())}"
    else:
        shape = f"{runs}, seeds {sorted({s for t in seed_sets for s in t})}"
    count = plural(planned, "workdir") if present == planned else f"{present} of {planned} workdirs"
    return f"{count} ({shape})"


def invocation_flags(invocation: dict[str, Any]) -> str:
    """One sweep command's selection as its flags: --only, --seeds and every --override."""
    flags = [f"--only={','.join(invocation['only'])}"] if invocation.get("only") else []
    flags.append(f"--seeds={invocation.get('seeds')}")
    flags += [f"--override={item}" for item in invocation.get("overrides", [])]
    return " ".join(flags)


def provenance(sweep: Sweep) -> list[str]:
    """The lines under the title: the root and counts, the sweep commands, the BPB's source."""
    lines = [
        f"Root: `{shown_root(sweep.root)}`; {run_count(sweep)}; baseline: "
        f"{sweep.baseline or 'none'}."
    ]
    if sweep.invocations:
        commands = "; ".join(f"`{invocation_flags(i)}`" for i in sweep.invocations)
        lines.append(f"Sweep command(s), besides --sweep and --root: {commands}.")
    if sweep.left_out:
        lines.append(f"Not run (no invocation selected them): {', '.join(sweep.left_out)}.")
    sources = sorted({s.bpb_source for r in sweep.runs for s in r.seeds.values() if s.finished})
    if sources:
        lines.append(f"Final val BPB from {'; '.join(sources)}.")
    return lines


def figure_section(out: Path, figure_paths: list[Path]) -> str:
    return "\n\n".join(
        f"![{p.stem}]({p.relative_to(out).as_posix()})\n\n{CAPTIONS[p.stem]}" for p in figure_paths
    )


def render_report(sweep: Sweep, out: Path, figure_paths: list[Path]) -> str:
    parts = [
        f"# {sweep.title or sweep.name}",
        "\n".join(provenance(sweep)),
        f"## {LAYOUT_TITLES.get(sweep.layout, sweep.layout)}",
        "Cells: mean ± sample std over the finished seeds (n = their number). Δ: the mean of the "
        "per-seed differences to the baseline (same seed), with a 95% Student-t interval; "
        "negative BPB Δ is better. The paper's numbers are single runs at the paper's scale.",
        tables.results_table(sweep),
    ]
    if core := tables.core_tasks_table(sweep):
        parts += ["## CORE per task (Table 4 layout)", core]
    if coefficients := tables.coefficient_table(sweep):
        parts += ["## Learned coefficients (final step)", coefficients]
    status = tables.status_lines(sweep)
    parts += ["## Run status", "\n".join(status) if status else "All runs finished."]
    if figure_paths:
        parts += ["## Figures", figure_section(out, figure_paths)]
    return "\n\n".join(parts) + "\n"


def write_report(sweep: Sweep, out: str | Path, with_kv_cache: bool = True) -> Path:
    """Write out/report.md and out/figures/*.png; returns the report's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figure_paths = write_figures(sweep, out, with_kv_cache)
    path = out / "report.md"
    write_text_atomic(path, render_report(sweep, out, figure_paths))
    return path
