"""The statistics a report states: exact McNemar, Holm's correction, Clopper-Pearson and
bootstrap intervals.

Plain functions of numbers, so tests check them against values worked out by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

CORRECT_AT = 0.5  # a row is correct when its score is at least this (every report's
# paired tests, the folder comparison and decided_early: one threshold)

BOOTSTRAP_REPS = 2000
BOOTSTRAP_SEED = 0  # fixed: a rebuilt report draws the same intervals


def mcnemar_exact(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of wins vs losses at p = 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def clopper_pearson(successes: int, failures: int, level: float = 0.95
                    ) -> tuple[float, float] | None:
    """Exact (Clopper-Pearson) two-sided interval of a binomial proportion at `level`, from
    the beta quantiles; None without a trial. It excludes 1/2 exactly when the two-sided
    exact binomial test (`mcnemar_exact`) gives p < 1 - level."""
    from scipy.stats import beta

    n = successes + failures
    if n == 0:
        return None
    alpha = 1 - level
    low = 0.0 if successes == 0 else float(beta.ppf(alpha / 2, successes, failures + 1))
    high = 1.0 if failures == 0 else float(beta.ppf(1 - alpha / 2, successes + 1, failures))
    return low, high


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided exact p of the 2x2 table [[a, b], [c, d]] (Fisher: the hypergeometric
    probabilities of every table with these margins no likelier than the observed one)."""
    n, row, col = a + b + c + d, a + b, a + c
    if n == 0:
        return 1.0

    def prob(x: int) -> float:
        return math.comb(row, x) * math.comb(n - row, col - x) / math.comb(n, col)

    observed = prob(a)
    tables = range(max(0, col - (n - row)), min(row, col) + 1)
    return min(1.0, sum(q for x in tables if (q := prob(x)) <= observed * (1 + 1e-9)))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (same order as given): controls the family-wise
    error over all comparisons of a report, uniformly more powerful than Bonferroni."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def bootstrap_mean_ci(per_dataset: Mapping[str, Sequence[float]], level: float = 0.95,
                      reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED
                      ) -> tuple[float, float, float]:
    """(mean, low, high): the mean over datasets of each dataset's mean value, and its
    percentile bootstrap interval from resampling samples within each dataset.

    Pass per-sample differences of two cells (paired on the same samples) to get the
    interval of a difference; pass row scores for the interval of a cell's mean score.
    """
    rng = np.random.default_rng(seed)
    values = [np.asarray(v, dtype=np.float64) for v in per_dataset.values() if len(v)]
    if not values:
        raise ValueError("no values to bootstrap")
    point = float(np.mean([v.mean() for v in values]))
    draws = np.zeros(reps)
    for v in values:
        idx = rng.integers(0, len(v), size=(reps, len(v)))
        draws += v[idx].mean(axis=1)
    draws /= len(values)
    alpha = (1 - level) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha])
    return point, float(low), float(high)


def format_p(p: float) -> str:
    """A p-value as tables print it: three decimals, or two significant digits below 0.001."""
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"
