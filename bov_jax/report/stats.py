"""Summary statistics over seeds: mean, sample std, paired differences with a t-interval.

Student's t quantiles are computed from the exact CDF for integer degrees of freedom
(Abramowitz & Stegun 26.7.3-4) by bisection, so no table and no scipy are needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

CONFIDENCE = 0.95  # of every interval the report shows


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean and sample standard deviation (ddof=1; nan for one value) of n values."""

    mean: float
    std: float
    n: int

    def cell(self, digits: int = 4) -> str:
        """`mean ± std (n=k)`; a single value has no std."""
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f} (n={self.n})"


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """Mean of the per-seed differences (run - baseline) and its two-sided confidence interval."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0 (False without an interval)."""
        return self.n >= 2 and (self.high < 0.0 or self.low > 0.0)

    def cell(self, digits: int = 4) -> str:
        """`+d [lo, hi] (n=k)`; with one pair there is no interval."""
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.mean:+.{digits}f} (n=1)"
        interval = f"[{self.low:+.{digits}f}, {self.high:+.{digits}f}]"
        return f"{self.mean:+.{digits}f} {interval} (n={self.n})"


def summarize(values: Sequence[float]) -> Summary:
    n = len(values)
    if n == 0:
        return Summary(math.nan, math.nan, 0)
    mean = math.fsum(values) / n
    if n == 1:
        return Summary(mean, math.nan, 1)
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Summary(mean, math.sqrt(var), n)


def t_central_probability(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df >= 1 (A&S 26.7.3 / 26.7.4)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}; expected >= 1")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * sum_{k < df/2} prod_{j<=k} (2j-1)/(2j) cos^2k
        term = total = 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            total += term
        return s * total
    total = 0.0  # odd: (2/pi)(theta + sin cos sum_{k < (df-1)/2} prod (2j)/(2j+1) cos^2k)
    if df > 1:
        term = 1.0
        total = term
        for k in range(1, (df - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c2
            total += term
        total *= s * math.cos(theta)
    return 2.0 / math.pi * (theta + total)


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = confidence (e.g. 0.95 -> 12.706 at df=1, 2.776 at df=4)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence}; expected in (0, 1)")
    low, high = 0.0, 1.0
    while t_central_probability(high, df) < confidence:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_central_probability(mid, df) < confidence:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def paired_diffs(run: Mapping[int, float], baseline: Mapping[int, float]) -> dict[int, float]:
    """{seed: run[seed] - baseline[seed]} over the seeds both have, by seed."""
    return {s: run[s] - baseline[s] for s in sorted(run.keys() & baseline.keys())}


def paired_difference(
    run: Mapping[int, float], baseline: Mapping[int, float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """Mean of run[seed] - baseline[seed] over the seeds both have, with a t-interval."""
    summary = summarize(list(paired_diffs(run, baseline).values()))
    if summary.n < 2:
        return PairedDifference(summary.mean, math.nan, math.nan, summary.n)
    half = t_quantile(confidence, summary.n - 1) * summary.std / math.sqrt(summary.n)
    return PairedDifference(summary.mean, summary.mean - half, summary.mean + half, summary.n)
