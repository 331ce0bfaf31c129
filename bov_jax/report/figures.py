"""The report's figures (matplotlib, Agg backend): curves, coefficients and the cache memory.

Each function writes one PNG and returns its path, or None when the sweep has nothing to draw.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bov_jax.files import atomic_file
from bov_jax.report.runs import Run, Sweep, coefficient_sort_key  # noqa: E402

DPI = 120


def save(fig: plt.Figure, path: Path) -> Path:
    """Write the figure as PNG in one rename and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path) as out:
            fig.savefig(out, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def curve(run: Run, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) over the seeds of one eval-record field (nan-free steps)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for s in run.seeds.values():
        for record in s.evals:
            if key in record:
                by_step[record["step"]].append(float(record[key]))
    steps = np.array(sorted(by_step))
    values = [by_step[s] for s in steps]
    return (
        steps,
        np.array([np.mean(v) for v in values]),
        np.array([np.min(v) for v in values]),
        np.array([np.max(v) for v in values]),
    )


def run_flops_per_step(run: Run) -> float | None:
    values = {s.flops_per_step for s in run.seeds.values()}
    return values.pop() if len(values) == 1 and None not in values else None


def val_bpb_figure(sweep: Sweep, path: Path) -> Path | None:
    """Val BPB vs step and vs training FLOPs (if every run has a plan): mean line, min..max band."""
    runs = [r for r in sweep.runs if any(s.evals for s in r.seeds.values())]
    if not runs:
        return None
    with_flops = all(run_flops_per_step(r) for r in runs)
    fig, axes = plt.subplots(
        1, 2 if with_flops else 1, figsize=(13 if with_flops else 7, 4.5), squeeze=False
    )
    for run in runs:
        steps, mean, low, high = curve(run, "val_bpb")
        label = f"{run.name} (n={len(run.seeds)})"
        xs = [steps] + ([steps * run_flops_per_step(run)] if with_flops else [])
        for ax, x in zip(axes[0], xs):
            (line,) = ax.plot(x, mean, marker=".", label=label)
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    axes[0][0].set_xlabel("step")
    if with_flops:
        axes[0][1].set_xlabel("training FLOPs")
    for ax in axes[0]:
        ax.set_ylabel("val BPB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{sweep.name}: validation bits per byte (line: mean over seeds, band: min..max)")
    return save(fig, path)


def coefficient_kinds(runs: list[Run]) -> list[str]:
    """The layer-wise coefficient names (gamma, alpha, beta) present in any final record."""
    kinds = {
        n.partition("/")[0]
        for r in runs
        for s in r.seeds.values()
        for n in s.coefficients
        if "/" in n
    }
    order = ["gamma", "alpha", "beta"]
    return sorted(kinds, key=lambda k: (order.index(k) if k in order else len(order), k))


def coefficients_figure(sweep: Sweep, path: Path) -> Path | None:
    """Final learned gamma / alpha / beta per layer (mean over seeds, bars min..max), Fig. 2."""
    kinds = coefficient_kinds(sweep.runs)
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for run in sweep.runs:
            per_layer: dict[int, list[float]] = defaultdict(list)
            for s in run.seeds.values():
                for name, value in s.coefficients.items():
                    k, _, layer = name.partition("/")
                    if k == kind and layer.isdigit():
                        per_layer[int(layer)].append(value)
            if not per_layer:
                continue
            layers = sorted(per_layer)
            mean = np.array([np.mean(per_layer[i]) for i in layers])
            low = np.array([min(per_layer[i]) for i in layers])
            high = np.array([max(per_layer[i]) for i in layers])
            err = np.clip([mean - low, high - mean], 0.0, None)  # rounding can go below 0
            ax.errorbar(layers, mean, yerr=err, marker="o", capsize=3, label=run.name)
        ax.set_title(kind)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{sweep.name}: learned coefficients at the end of training")
    return save(fig, path)


def coefficients_trajectory_figure(sweep: Sweep, path: Path) -> Path | None:
    """Every learned coefficient over training (mean over seeds), one panel per run."""
    runs = [r for r in sweep.runs if any(s.coefficients for s in r.seeds.values())]
    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for s in run.seeds.values():
            for record in s.evals:
                for name, value in record.get("coefficients", {}).items():
                    series[name][record["step"]].append(value)
        for name in sorted(series, key=coefficient_sort_key):
            steps = sorted(series[name])
            ax.plot(steps, [np.mean(series[name][t]) for t in steps], marker=".", label=name)
        ax.set_title(run.name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{sweep.name}: learned coefficients over training (mean over seeds)")
    return save(fig, path)


def kv_cache_figure(path: Path) -> Path:
    """Fig. 5(a): the K+V cache fraction BoV saves vs context, Eq. 6 at d24 for the two
    vocabularies, with the fractions measured from a small model's decode-cache arrays."""
    import jax.numpy as jnp

    from bov_jax import memory
    from bov_jax.presets import config_for

    d24 = config_for("d24_bov")
    small = config_for("d12_bov")
    small.model.update(model_dim=128, head_dim=64)
    contexts = np.unique(np.logspace(11, 20, 64, base=2).astype(int))
    points = [2**11, 2**14, 2**17, 2**20]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for vocab in memory.DOC_VOCABS:
        spec = memory.vocab_spec(d24, vocab)
        fractions = [memory.eq6(spec, 1, int(t)).fraction for t in contexts]
        (line,) = ax.plot(contexts, 100 * np.array(fractions), label=f"Eq. 6, d24, |V| = {vocab:,}")
        small_spec = memory.vocab_spec(small, vocab)
        bank = memory.bank_size(small_spec, jnp.bfloat16)
        measured = [
            memory.memory_report(small_spec, 1, t, jnp.bfloat16, bank).net_fraction for t in points
        ]
        ax.plot(
            points,
            100 * np.array(measured),
            "o",
            color=line.get_color(),
            label=f"measured cache bytes, d12 width 128, |V| = {vocab:,}",
        )
    ax.axhline(100 / 6, color="gray", ls=":", label="1/6 asymptote")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        [2**k for k in range(11, 21)],
        [f"{2**k // 2**20}M" if k >= 20 else f"{2**k // 2**10}K" for k in range(11, 21)],
    )
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("K+V cache saved (%)")
    ax.set_ylim(-60, 20)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Fig. 5(a): cache memory saved by BoV (bank bytes subtracted)")
    return save(fig, path)
