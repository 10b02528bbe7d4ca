"""`experiments.stats`: Holm's correction, exact and bootstrap intervals against values by hand."""

import numpy as np
import pytest

from experiments.stats import bootstrap_mean_ci, clopper_pearson, holm, mcnemar_exact


def test_holm_by_hand():
    # sorted: 0.01 (x3 = 0.03), 0.02 (x2 = 0.04), 0.04 (x1 = 0.04); back in the given order.
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    # monotone: a later rank never gets a smaller adjusted p than an earlier one
    assert holm([0.01, 0.011, 0.5]) == pytest.approx([0.03, 0.03, 0.5])
    assert holm([0.6, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    values = {"a": [0.0, 1.0] * 20, "b": [1.0] * 10}
    mean, low, high = bootstrap_mean_ci(values)
    assert mean == pytest.approx((0.5 + 1.0) / 2)  # mean over datasets of dataset means
    assert low < mean < high and high <= 1.0
    # b has no variance: the interval is a's halved; a's sd of the mean is 0.5/sqrt(40)
    assert high - low == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(40) / 2, rel=0.25)
    assert bootstrap_mean_ci(values) == (mean, low, high)
    assert bootstrap_mean_ci({"a": [2.0, 2.0]}) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_mean_ci({})


def test_clopper_pearson_by_hand_and_against_the_exact_test():
    """Exact interval: k = n gives [(alpha/2)^(1/n), 1]; 0 / 0 has none; at level 1 - a it
    excludes 1/2 exactly when the exact two-sided binomial (McNemar) p < a."""
    low, high = clopper_pearson(5, 0, 0.95)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 5))
    assert clopper_pearson(0, 3, 0.9)[0] == 0.0
    assert clopper_pearson(0, 0) is None
    for a in (0.05, 0.05 / 3, 0.05 / 7):
        for wins in range(13):
            for losses in range(13 - wins):
                if wins + losses == 0:
                    continue
                lo, hi = clopper_pearson(wins, losses, 1 - a)
                assert (lo > 0.5 or hi < 0.5) == (mcnemar_exact(wins, losses) < a), (
                    a, wins, losses)
