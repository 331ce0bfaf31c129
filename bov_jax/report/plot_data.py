"""The numbers behind each report figure, apart from the drawing (bov_jax.report.figures).

Every spread is the sample standard deviation over seeds, the statistic of the report's tables
(`stats.summarize`); intervals are the tables' 95% Student-t intervals (`stats.paired_difference`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from bov_jax.report.runs import Run, Sweep, coefficient_sort_key
from bov_jax.report.stats import (
    CONFIDENCE,
    PairedDifference,
    paired_difference,
    paired_diffs,
    summarize,
)


@dataclasses.dataclass(frozen=True)
class Series:
    """A quantity over training, pooled over seeds at each step.

    steps (S,) int; mean (S,); std (S,) the sample std over the seeds there (nan with one);
    n (S,) int, the number of seeds at each step.
    """

    steps: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: np.ndarray


def series(points: Iterable[tuple[int, float]]) -> Series:
    """(step, value) pairs from any number of seeds -> mean / std / n per step, by step."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for step, value in points:
        by_step[int(step)].append(float(value))
    steps = sorted(by_step)
    summaries = [summarize(by_step[s]) for s in steps]
    return Series(
        np.array(steps, dtype=int),
        np.array([s.mean for s in summaries]),
        np.array([s.std for s in summaries]),
        np.array([s.n for s in summaries], dtype=int),
    )


def bpb_series(run: Run) -> Series:
    """Val BPB of the in-training evals (metrics.jsonl) over the run's seeds."""
    return series((r["step"], r["val_bpb"]) for s in run.seeds.values() for r in s.evals)


def coefficient_series(run: Run) -> dict[str, Series]:
    """{coefficient name: Series} from every record with coefficients (eval and log steps),
    in `coefficient_sort_key` order."""
    points: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in run.seeds.values():
        for step, coefficients in s.coefficient_history:
            for name, value in coefficients.items():
                points[name].append((step, value))
    return {name: series(points[name]) for name in sorted(points, key=coefficient_sort_key)}


@dataclasses.dataclass(frozen=True)
class LayerValues:
    """One coefficient kind of one run at the final step, per layer.

    layers (N,) int; mean (N,); std (N,) sample std over seeds (nan with one seed); n (N,) int.
    """

    layers: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    n: np.ndarray


def coefficient_kinds(runs: Sequence[Run]) -> list[str]:
    """The layer-wise coefficient kinds (gamma, alpha, beta) present in any final record."""
    kinds = {
        n.partition("/")[0]
        for r in runs
        for s in r.seeds.values()
        for n in s.coefficients
        if "/" in n
    }
    order = ["gamma", "alpha", "beta"]
    return sorted(kinds, key=lambda k: (order.index(k) if k in order else len(order), k))


def final_coefficients(sweep: Sweep, kind: str) -> dict[str, LayerValues]:
    """{run name: LayerValues} of `kind` ("gamma", ...) for the runs that learn it: the same
    mean and std over seeds as the report's coefficient table."""
    out = {}
    for run in sweep.runs:
        per_layer: dict[int, list[float]] = defaultdict(list)
        for s in run.seeds.values():
            for name, value in s.coefficients.items():
                k, _, layer = name.partition("/")
                if k == kind and layer.isdigit():
                    per_layer[int(layer)].append(value)
        if per_layer:
            layers = sorted(per_layer)
            summaries = [summarize(per_layer[i]) for i in layers]
            out[run.name] = LayerValues(
                np.array(layers, dtype=int),
                np.array([s.mean for s in summaries]),
                np.array([s.std for s in summaries]),
                np.array([s.n for s in summaries], dtype=int),
            )
    return out


@dataclasses.dataclass(frozen=True)
class PairedRun:
    """A run against the sweep's baseline, seed by seed: {seed: run - baseline} and the mean
    of those differences with its t-interval (the table's Δ column)."""

    name: str
    diffs: dict[int, float]
    summary: PairedDifference


def paired_runs(sweep: Sweep, metric: str = "val_bpb") -> list[PairedRun]:
    """Every non-baseline run with at least one seed paired with the baseline's."""
    baseline = next((r for r in sweep.runs if r.name == sweep.baseline), None)
    if baseline is None:
        return []
    base = baseline.finished_values(metric)
    out = []
    for run in sweep.runs:
        values = run.finished_values(metric)
        if run is baseline or not (values.keys() & base.keys()):
            continue
        out.append(
            PairedRun(
                run.name, paired_diffs(values, base), paired_difference(values, base, CONFIDENCE)
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class CacheCurve:
    """Fig. 5(a) for one vocabulary: Eq. 6 at d24 and the fractions measured on a small model.

    contexts (C,) and fraction (C,) in %: Eq. 6's curve; points (P,) and measured (P,) in %:
    the measured net saving; eq6_at_points (P,) in %: the curve there; clipped (P,) bool: the
    measured point lies below the figure's floor.
    """

    vocab: int
    contexts: np.ndarray
    fraction: np.ndarray
    points: np.ndarray
    measured: np.ndarray
    eq6_at_points: np.ndarray
    clipped: np.ndarray


SMALL_MODEL = "d12 layout at width 128 (L = 12, n_t = 4, d = 128)"
VOCAB_NAMES = {32768: "nanochat's tokenizer", 151936: "Qwen3's tokenizer"}


def kv_cache_curves(
    contexts: Sequence[int], points: Sequence[int], floor: float
) -> list[CacheCurve]:
    """Eq. 6's K+V fraction saved by d24 BoV (L = 24, n_t = 8) and the net fraction measured
    from the decode-cache arrays of a small BoV model, at each vocabulary of Fig. 5(a).

    Eq. 6's fraction, (n_t / 2L)(1 - |V|/T), depends on neither the width nor the depth when
    n_t = L/3, so the small model's points fall on the d24 curve, below it by the int32
    token-id history its cache also keeps (4 bytes a token against 2·L·d bf16 K+V values).
    """
    import jax.numpy as jnp

    from bov_jax.inference import memory
    from bov_jax.presets import config_for

    d24 = config_for("d24_bov")
    small = config_for("d12_bov")
    small.model.update(model_dim=128, head_dim=64)
    curves = []
    for vocab in memory.DOC_VOCABS:
        spec = memory.vocab_spec(d24, vocab)
        small_spec = memory.vocab_spec(small, vocab)
        bank = memory.bank_size(small_spec, jnp.bfloat16)
        measured = np.array(
            [
                100 * memory.memory_report(small_spec, 1, t, jnp.bfloat16, bank).net_fraction
                for t in points
            ]
        )
        curves.append(
            CacheCurve(
                vocab,
                np.asarray(contexts),
                np.array([100 * memory.eq6(spec, 1, int(t)).fraction for t in contexts]),
                np.asarray(points),
                measured,
                np.array([100 * memory.eq6(spec, 1, int(t)).fraction for t in points]),
                measured < floor,
            )
        )
    return curves
