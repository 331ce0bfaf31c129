"""The MQAR sweep's answer (configs/sweeps/recall_cpu.py): every finished job scored on the
held-out split (probes/mqar.json in its workdir, computed once), then Zoology's figure
(accuracy vs width, one panel per number of pairs, one line per value path, mean and std over
seeds) and a table (mean +- std (n) per value path, and the paired difference to the baseline
of the same width, pairs and seed with its 95% t-interval).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bov_jax.files import write_json_atomic, write_text_atomic
from bov_jax.probes.jobs import finished_jobs, seed_of
from bov_jax.probes.mqar import probe_run
from bov_jax.report.stats import paired_difference, summarize

BASELINE = "baseline"
Cell = tuple[str, int, int]  # (value path, width, pairs)


def scores(roots: list[Path]) -> dict[Cell, dict[int, float]]:
    """{(path, width, pairs): {seed: held-out accuracy}} over the finished jobs of every root
    (one sweep split over several roots); runs are named <path>_d<W>_n<N>."""
    out: dict[Cell, dict[int, float]] = defaultdict(dict)
    for workdir in (job for root in roots for job in finished_jobs(root)):
        probe = workdir / "probes" / "mqar.json"
        if not probe.is_file():
            probe_run(workdir)
        result = json.loads(probe.read_text())
        path = workdir.parent.name.rsplit("_d", 1)[0]
        seed = seed_of(workdir)
        out[(path, result["model_dim"], result["num_pairs"])][seed] = result["accuracy"]
    return dict(out)


def table(cells: dict[Cell, dict[int, float]], chance: float) -> str:
    """Markdown: one row per (pairs, width, path) with n, accuracy and the paired difference."""
    lines = [
        f"Held-out MQAR accuracy (chance {chance:.4f}); difference to the baseline of the same "
        "width, pairs and seed, with its 95% t-interval.",
        "",
        "| pairs | width | value path | accuracy, mean ± std (n) | vs baseline (95% CI) |",
        "|---:|---:|---|---|---|",
    ]
    for path, width, pairs in sorted(cells, key=lambda c: (c[2], c[1], c[0] != BASELINE, c[0])):
        by_seed = cells[(path, width, pairs)]
        base = cells.get((BASELINE, width, pairs), {})
        diff = "-" if path == BASELINE else paired_difference(by_seed, base).cell(3)
        accuracy = summarize(list(by_seed.values())).cell(3)
        lines.append(f"| {pairs} | {width} | {path} | {accuracy} | {diff} |")
    return "\n".join(lines) + "\n"


def figure(cells: dict[Cell, dict[int, float]], chance: float, path: Path) -> Path:
    """Zoology's layout: accuracy vs width, a panel per number of pairs, a line per path."""
    from bov_jax.report.figures import plt, save

    pair_counts = sorted({c[2] for c in cells})
    paths = sorted({c[0] for c in cells}, key=lambda p: (p != BASELINE, p))
    fig, axes = plt.subplots(
        1, len(pair_counts), figsize=(4 * len(pair_counts), 3.4), squeeze=False, sharey=True
    )
    all_widths = sorted({c[1] for c in cells})
    for ax, pairs in zip(axes[0], pair_counts, strict=True):
        for i, name in enumerate(paths):
            widths = sorted(w for p, w, n in cells if p == name and n == pairs)
            if not widths:
                continue
            shift = 1 + 0.04 * (i - (len(paths) - 1) / 2)  # side by side, not on top
            runs = [cells[(name, w, pairs)] for w in widths]
            stats = [summarize(list(r.values())) for r in runs]
            ax.errorbar(
                np.array(widths) * shift,
                [s.mean for s in stats],
                yerr=[0 if s.n < 2 else s.std for s in stats],
                marker="o",
                capsize=3,
                color=f"C{i}",  # one color per value path in every panel
                label=f"{name} (n={'/'.join(str(s.n) for s in stats)})",
            )
            for w, r in zip(widths, runs, strict=True):  # each seed, to show the spread
                ax.scatter(
                    [w * shift] * len(r),
                    list(r.values()),
                    s=8,
                    alpha=0.5,
                    color=f"C{i}",
                )
        ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_widths, [str(w) for w in all_widths])
        ax.set_xlim(all_widths[0] / 1.4, all_widths[-1] * 1.4)
        ax.set_title(f"{pairs} key-value pairs")
        ax.set_xlabel("model width")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out MQAR accuracy")
    handles, labels = axes[0][-1].get_legend_handles_labels()  # the n of the last panel
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels))
    fig.suptitle(
        "MQAR by value path (depth 3, seq 256): mean ± std over seeds, dots: each seed", fontsize=9
    )
    return save(fig, path)


def report(roots: list[str], out: str | Path) -> list[Path]:
    """Scores the roots' finished jobs; writes OUT/mqar.md, mqar.png and mqar_scores.json."""
    paths, out = [Path(r) for r in roots], Path(out)
    cells = scores(paths)
    if not cells:
        raise FileNotFoundError(f"{roots} hold no finished MQAR job (<run>/seed<k>/status.json)")
    probes = (p for root in paths for p in root.glob("*/seed*/probes/mqar.json"))
    chance = json.loads(next(probes).read_text())["chance"]
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "mqar.md", out / "mqar_scores.json"]
    write_text_atomic(written[0], table(cells, chance))
    records: list[dict[str, Any]] = [
        {"value_path": p, "width": w, "pairs": n, "accuracy_by_seed": cells[(p, w, n)]}
        for p, w, n in sorted(cells)
    ]
    write_json_atomic(written[1], {"chance": chance, "cells": records})
    written.append(figure(cells, chance, out / "mqar.png"))
    return written
