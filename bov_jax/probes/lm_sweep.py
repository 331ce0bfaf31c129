"""The language-model probes over a sweep's seeds, paired by seed (issue 54).

Every finished job under the root is probed once at its last checkpoint
(RUN/probes/lm_step<N>.json, see lm.py); then, per probe cell (a slice of positions, an
induction span and distance, a passkey context and depth), each run's mean ± std over seeds and
its paired difference to the baseline run of the same seed with a 95% t-interval. Writes
OUT/lm_probes.md, lm_probes.png and lm_probes.json.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bov_jax.files import write_json_atomic, write_text_atomic
from bov_jax.probes.jobs import finished_jobs, seed_of
from bov_jax.probes.lm import probe_run
from bov_jax.report.stats import paired_difference, summarize

BySeed = dict[int, float]
Cells = dict[str, dict[str, BySeed]]  # cell name -> run -> {seed: value}


def probe_results(
    root: Path, documents: int, rows: int, trials: int
) -> dict[str, dict[int, dict[str, Any]]]:
    """{run: {seed: the lm probe's result}} for every finished job under root, probing a job
    only when its last step has no result yet."""
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for workdir in finished_jobs(root):
        step = json.loads((workdir / "status.json").read_text())["step"]
        path = workdir / "probes" / f"lm_step{step}.json"
        if not path.is_file():
            path = probe_run(workdir, step, documents, rows, trials)
        out[workdir.parent.name][seed_of(workdir)] = json.loads(path.read_text())
    return dict(out)


def cell_values(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One job's result as {table: {cell: value}}: loss per slice of positions, induction
    accuracy and loss per (span, distance), passkey accuracy per (context, depth) and per
    context over every depth."""
    passkey: dict[str, float] = {}
    for context in sorted({r["context"] for r in result["passkey"]}):
        hits = [r["accuracy"] for r in result["passkey"] if r["context"] == context]
        passkey[f"context {context}, every depth"] = float(np.mean(hits))
    passkey.update(
        {
            f"context {r['context']}, depth {r['depth']:.2f}": r["accuracy"]
            for r in result["passkey"]
        }
    )
    return {
        "loss by position (nats)": {
            "every position": result["positions"]["mean"],
            **{
                f"positions {b['first']}-{b['last']}": b["loss"]
                for b in result["positions"]["bins"]
            },
        },
        "induction accuracy": {
            f"span {r['span']}, distance {r['distance']}": r["accuracy"]
            for r in result["induction"]
        },
        "induction loss (nats)": {
            f"span {r['span']}, distance {r['distance']}": r["loss"] for r in result["induction"]
        },
        "passkey accuracy": passkey,
    }


def gather(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Cells]:
    """{table: {cell: {run: {seed: value}}}} over every job, cells in the probes' order."""
    tables: dict[str, Cells] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for run, by_seed in results.items():
        for seed, result in by_seed.items():
            for table, cells in cell_values(result).items():
                for cell, value in cells.items():
                    tables[table][cell][run][seed] = value
    return tables


def markdown(tables: dict[str, Cells], runs: list[str], baseline: str, title: str) -> str:
    """One table per probe: a row per cell, each run's mean ± std (n) and each non-baseline
    run's paired difference to the baseline."""
    others = [r for r in runs if r != baseline]
    lines = [f"# {title}", ""]
    for name, cells in tables.items():
        header = [f"{r}, mean ± std (n)" for r in runs] + [
            f"{r} - {baseline} (95% CI)" for r in others
        ]
        lines += [f"## {name}", "", "| cell | " + " | ".join(header) + " |"]
        lines.append("|---|" + "---|" * len(header))
        for cell, by_run in cells.items():
            means = [summarize(list(by_run.get(r, {}).values())).cell(3) for r in runs]
            diffs = [
                paired_difference(by_run.get(r, {}), by_run.get(baseline, {})).cell(3)
                for r in others
            ]
            lines.append(f"| {cell} | " + " | ".join(means + diffs) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(results: dict[str, dict[int, dict[str, Any]]], runs: list[str], path: Path) -> Path:
    """Three panels: loss by position (mean ± std over seeds), induction accuracy by distance
    (a line per run and span), passkey accuracy by context (over every depth)."""
    from bov_jax.report.figures import plt, save

    fig, (pos_ax, ind_ax, key_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for i, run in enumerate(runs):
        jobs = list(results[run].values())
        n, color = len(jobs), f"C{i}"
        curves = np.array([j["positions"]["by_position"] for j in jobs])
        mean, std = curves.mean(0), curves.std(0, ddof=1) if n > 1 else np.zeros(curves.shape[1])
        x = np.arange(1, len(mean) + 1)
        pos_ax.plot(x, mean, color=color, linewidth=1, label=f"{run} (n={n})")
        pos_ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2)
        for style, span in zip(
            ("-", "--", ":"), sorted({r["span"] for r in jobs[0]["induction"]}), strict=False
        ):
            distances = sorted({r["distance"] for r in jobs[0]["induction"] if r["span"] == span})
            acc = np.array(
                [[r["accuracy"] for r in j["induction"] if r["span"] == span] for j in jobs]
            )
            ind_ax.errorbar(
                distances,
                acc.mean(0),
                yerr=acc.std(0, ddof=1) if n > 1 else None,
                color=color,
                linestyle=style,
                marker="o",
                capsize=3,
                label=f"{run}, span {span} (n={n})",
            )
        contexts = sorted({r["context"] for r in jobs[0]["passkey"]})
        hits = np.array(
            [
                [
                    np.mean([r["accuracy"] for r in j["passkey"] if r["context"] == c])
                    for c in contexts
                ]
                for j in jobs
            ]
        )
        key_ax.errorbar(
            contexts,
            hits.mean(0),
            yerr=hits.std(0, ddof=1) if n > 1 else None,
            color=color,
            marker="o",
            capsize=3,
            label=f"{run} (n={n})",
        )
    pos_ax.set(
        xscale="log",
        xlabel="position (tokens)",
        ylabel="next-token loss (nats)",
        title="loss by position, val documents longer than the context",
    )
    ind_ax.set(
        xscale="log",
        xlabel="distance to the first copy (tokens)",
        ylabel="accuracy on the repeat",
        title="induction: a random span repeated",
        ylim=(-0.02, 1.02),
    )
    ind_ax.set_xscale("log", base=2)
    key_ax.set(
        xlabel="prompt length (tokens)",
        ylabel="read-back accuracy",
        title="passkey, greedy through the engine (every depth)",
        ylim=(-0.02, 1.02),
    )
    for ax in (pos_ax, ind_ax, key_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Language-model probes by value path: mean ± std over seeds", fontsize=9)
    return save(fig, path)


def report(
    root: str | Path, out: str | Path, baseline: str, documents: int, rows: int, trials: int
) -> list[Path]:
    """Probes the root's finished jobs; writes OUT/lm_probes.md, lm_probes.json, lm_probes.png."""
    root, out = Path(root), Path(out)
    results = probe_results(root, documents, rows, trials)
    if baseline not in results:
        raise FileNotFoundError(f"{root} holds no finished job of the baseline run {baseline!r}")
    runs = [baseline, *sorted(r for r in results if r != baseline)]
    tables = gather(results)
    first = next(iter(results[baseline].values()))
    title = (
        f"Language-model probes of {root.name}: {', '.join(runs)} at step {first['step']} "
        f"(context {first['seq_len']}), paired by seed"
    )
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "lm_probes.md", out / "lm_probes.json"]
    write_text_atomic(written[0], markdown(tables, runs, baseline, title))
    write_json_atomic(written[1], {"runs": {r: results[r] for r in runs}})
    written.append(figure(results, runs, out / "lm_probes.png"))
    return written
