"""The report's figures (matplotlib, Agg backend): curves, coefficients, paired differences and
the cache memory, drawn from `bov_jax.report.plot_data`.

Each function writes one PNG and returns its path, or None when the sweep has nothing to draw.
Spreads are ± the sample std over seeds, as in the tables; each figure's title says so.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bov_jax.files import atomic_file  # noqa: E402
from bov_jax.report import plot_data  # noqa: E402
from bov_jax.report.runs import Run, Sweep  # noqa: E402

DPI = 120
KV_FLOOR = -60.0  # % saved: the kv_cache figure's lower edge
MANY_POINTS = 25  # a series with more points is drawn without markers


def save(fig: plt.Figure, path: Path) -> Path:
    """Write the figure as PNG in one rename and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path) as out:
            fig.savefig(out, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def run_flops_per_step(run: Run) -> float | None:
    values = {s.flops_per_step for s in run.seeds.values()}
    return values.pop() if len(values) == 1 and None not in values else None


def plot_series(ax: plt.Axes, x: np.ndarray, s: plot_data.Series, label: str) -> None:
    """Mean line with a ± std band (where two or more seeds)."""
    marker = "." if len(x) <= MANY_POINTS else None
    (line,) = ax.plot(x, s.mean, marker=marker, label=label)
    ax.fill_between(x, s.mean - s.std, s.mean + s.std, color=line.get_color(), alpha=0.2)


def val_bpb_figure(sweep: Sweep, path: Path) -> Path | None:
    """Val BPB vs step and vs training FLOPs (if every run has a plan): mean, ± std band."""
    runs = [r for r in sweep.runs if any(s.evals for s in r.seeds.values())]
    if not runs:
        return None
    with_flops = all(run_flops_per_step(r) for r in runs)
    fig, axes = plt.subplots(
        1, 2 if with_flops else 1, figsize=(13 if with_flops else 7, 4.5), squeeze=False
    )
    for run in runs:
        s = plot_data.bpb_series(run)
        label = f"{run.name} (n={len(run.seeds)})"
        xs = [s.steps] + ([s.steps * run_flops_per_step(run)] if with_flops else [])
        for ax, x in zip(axes[0], xs):
            plot_series(ax, x, s, label)
    axes[0][0].set_xlabel("step")
    if with_flops:
        axes[0][1].set_xlabel("training FLOPs")
    for ax in axes[0]:
        ax.set_ylabel("val BPB (in-training eval)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{sweep.name}: validation bits per byte (line: mean over seeds, band: ± std)")
    return save(fig, path)


def coefficients_figure(sweep: Sweep, path: Path) -> Path | None:
    """Final learned gamma / alpha / beta per layer (mean over seeds, bars ± std), Fig. 2."""
    kinds = plot_data.coefficient_kinds(sweep.runs)
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        values = plot_data.final_coefficients(sweep, kind)
        for name, v in values.items():
            n = f"n={v.n.min()}" if v.n.min() == v.n.max() else f"n={v.n.min()}-{v.n.max()}"
            ax.errorbar(v.layers, v.mean, yerr=v.std, marker="o", capsize=3, label=f"{name} ({n})")
        ax.set_xticks(sorted({int(i) for v in values.values() for i in v.layers}))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_title(kind)
        ax.set_xlabel("layer (0-based)")
        ax.set_ylabel(f"{kind} at the final step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{sweep.name}: learned coefficients at the end of training "
        "(mean over seeds, bars: ± sample std, as in the table)"
    )
    return save(fig, path)


def coefficients_trajectory_figure(sweep: Sweep, path: Path) -> Path | None:
    """Every learned coefficient over training (mean over seeds, ± std band), one panel per run:
    every record that has them (eval and log steps)."""
    runs = [r for r in sweep.runs if any(s.coefficient_history for s in r.seeds.values())]
    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for name, s in plot_data.coefficient_series(run).items():
            plot_series(ax, s.steps, s, name)
        ax.set_title(f"{run.name} (n={len(run.seeds)})")
        ax.set_xlabel("step")
        ax.set_ylabel("coefficient value")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{sweep.name}: learned coefficients over training (mean over seeds, band: ± std)")
    return save(fig, path)


def paired_figure(sweep: Sweep, path: Path) -> Path | None:
    """Per-seed differences of the final val BPB to the baseline (dots), their mean and 95%
    t-interval (bar) per run: the table's Δ column, seed by seed."""
    paired = plot_data.paired_runs(sweep, "val_bpb")
    if not paired:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(paired) + 2), 4.5))
    for i, p in enumerate(paired):
        seeds = sorted(p.diffs)
        jitter = np.linspace(-0.15, 0.15, len(seeds)) if len(seeds) > 1 else np.zeros(1)
        ax.plot(i + jitter, [p.diffs[s] for s in seeds], "o", color="tab:blue", alpha=0.6)
        m = p.summary
        if m.n >= 2:
            ax.errorbar(
                i + 0.3,
                m.mean,
                yerr=[[m.mean - m.low], [m.high - m.mean]],
                fmt="D",
                capsize=5,
                color="black",
            )
            verdict = "excludes 0" if m.excludes_zero else "contains 0"
            text = f"{m.mean:+.4f}\n[{m.low:+.4f}, {m.high:+.4f}]\n{verdict}"
        else:
            ax.plot(i + 0.3, m.mean, "D", color="black")
            text = f"{m.mean:+.4f}\n(one pair)"
        ax.annotate(text, (i + 0.38, m.mean), fontsize=7, va="center")
    ax.axhline(0.0, color="gray", lw=1)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xticks(range(len(paired)), [f"{p.name}\n(n={p.summary.n})" for p in paired])
    ax.set_xlim(-0.5, len(paired) - 0.5 + 0.6)
    ax.set_ylabel(f"final val BPB − {sweep.baseline} (same seed)")
    ax.grid(alpha=0.3, axis="y")
    ax.plot([], [], "o", color="tab:blue", alpha=0.6, label="one seed")
    ax.plot([], [], "D", color="black", label="mean, 95% Student-t interval")
    ax.legend(fontsize=8)
    ax.set_title(f"{sweep.name}: paired differences to {sweep.baseline} (below 0: better)")
    return save(fig, path)


def kv_cache_figure(path: Path) -> Path:
    """Fig. 5(a): the K+V cache fraction BoV saves vs context, Eq. 6 at d24 for the paper's two
    vocabularies, with the fractions measured on a small model's decode-cache arrays; points
    below the floor are drawn on it as open triangles with their value."""
    contexts = np.unique(np.logspace(11, 20, 64, base=2).astype(int))
    points = [2**11, 2**14, 2**17, 2**20]
    fig, ax = plt.subplots(figsize=(8, 5))
    curves = plot_data.kv_cache_curves(contexts, points, KV_FLOOR)
    gap = max(float(np.max(c.eq6_at_points - c.measured)) for c in curves)
    for k, c in enumerate(curves):
        name = f"|V| = {c.vocab:,} ({plot_data.VOCAB_NAMES.get(c.vocab, 'vocabulary')})"
        (line,) = ax.plot(c.contexts, c.fraction, label=f"Eq. 6, d24, {name}")
        color = line.get_color()
        inside = ~c.clipped
        ax.plot(c.points[inside], c.measured[inside], "o", color=color, label="  measured")
        for t, value in zip(c.points[c.clipped], c.measured[c.clipped]):
            ax.plot(t, KV_FLOOR, "v", mfc="none", color=color, ms=9, clip_on=False)
            ax.annotate(
                f"{value:.0f}%",
                (t, KV_FLOOR),
                (0, 10 + 11 * k),  # one line per vocabulary where both are clipped
                textcoords="offset points",
                fontsize=7,
                color=color,
                ha="center",
            )
    ax.plot([], [], "v", mfc="none", color="gray", label=f"measured, below {KV_FLOOR:.0f}% (value)")
    ax.axhline(100 / 6, color="gray", ls=":", label="1/6 asymptote")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        [2**k for k in range(11, 21)],
        [f"{2**k // 2**20}M" if k >= 20 else f"{2**k // 2**10}K" for k in range(11, 21)],
    )
    ax.set_xlabel("context length T (tokens), batch 1")
    ax.set_ylabel("K+V cache saved, bank bytes subtracted (%)")
    ax.set_ylim(KV_FLOOR, 20)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Fig. 5(a): cache memory saved by BoV")
    note = (
        f"Measured: cache arrays of a {plot_data.SMALL_MODEL}, bf16. Eq. 6's fraction "
        "(n_t/2L)(1 - |V|/T) depends on neither width nor depth when n_t = L/3, so these points "
        f"sit on the d24 curve ({gap:.2f} points below it: the int32 token ids the cache also "
        "keeps). The paper draws the Qwen3 curve from Eq. 6 only; no Qwen3 model is trained."
    )
    ax.text(0, -0.14, textwrap.fill(note, 120), transform=ax.transAxes, fontsize=7, va="top")
    return save(fig, path)
